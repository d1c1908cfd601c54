"""A rollout worker of its own (``rollout.workers``, docs/async.md): a whole copy of the policy
that only generates, beside the trainer ranks instead of inside them.

The trainer sends its weights after every update (:meth:`RolloutWorker.receive_weights`, or over
the weight channel, :meth:`RolloutWorker.receive_broadcast`: ``rollout.weight_transport``). They
arrive in a mailbox, beside a generation that may be running (under Ray on the actor's
``mailbox`` thread; in one process from the driver's thread), and are loaded into the copy only
between generations, or, with ``partial``, between micro-batches of one (``rollout.mode=async``):
a generation in flight finishes its micro-batch with the weights it started with and continues
with the new ones. Every sequence records the version it was sampled under
(``rollout_version``, (B,)): the driver turns it into staleness and the loss's importance
weights use the engine's own log-probs, taken under that version.

An engine with a copy of its own (``rollout.engine: vllm``) is built from a ``meta`` module (the
architecture, no weights: the engine's copy is the only one); a loaded version is streamed into
it, one tensor at a time, as the colocated engine's pushes are.

Memory: the copy (weights only, in the policy's compute dtype; no gradients or optimizer states), the engine's generation
transients, and one version in the mailbox until it is loaded (host memory): the planner's
``rollout`` role (fitrl/memory/roles.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch

from fitrl.config.schema import FitrlConfig, SamplingConfig
from fitrl.core.device import resolve_device
from fitrl.data.batch import Batch
from fitrl.distributed.weight_sync import ChannelAddress, WeightChannel
from fitrl.models.description import ModelDescription, RunModels
from fitrl.models.loading import build_model, described, load_tokenizer
from fitrl.rollout import build_engine
from fitrl.rollout.agent import AgentRollout
from fitrl.rollout.engine import EngineContext, RolloutEngine
from fitrl.rollout.layout import concat_rollouts, eos_ids, gather_rollouts
from fitrl.telemetry.guard import GUARD
from fitrl.telemetry.progress import PROGRESS
from fitrl.workers.group import dispatch

WAIT_FOR_WEIGHTS_S = 600.0
"""How long a generation waits for the weights version it needs (sent before it was asked for:
a longer wait means the trainer's send was lost)."""


def compute_dtype(cfg: FitrlConfig) -> str:
    """The dtype the policy computes in, which its rollout workers hold and receive."""
    return "bfloat16" if cfg.actor.fsdp.mixed_precision else cfg.actor.model.dtype


def episode_runner(cfg: FitrlConfig, engine: RolloutEngine, model: torch.nn.Module, tokenizer,
                   inputs) -> AgentRollout | None:
    """Multi-turn episodes on ``engine`` (``rollout.agent``, fitrl/rollout/agent.py), or None."""
    if not cfg.rollout.agent.enabled:
        return None
    end = eos_ids(model, tokenizer)
    return AgentRollout(engine, tokenizer, cfg.rollout.agent, max_response_length=cfg.rollout.max_response_length,
                        eos_ids=end, pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end[0],
                        inputs=inputs, max_error_fraction=cfg.reward.max_error_fraction,
                        max_prompt_length=cfg.data.max_prompt_length)


def shape_only(model_cfg, description: ModelDescription) -> torch.nn.Module:
    """The policy's architecture on the ``meta`` device (no memory), with the checkpoint's
    generation config (its EOS ids), for an engine that holds the weights itself."""
    from transformers import GenerationConfig

    with torch.device("meta"):
        model = description.family.builders("causal_lm", model_cfg)[1]()
    try:
        model.generation_config = GenerationConfig.from_pretrained(model_cfg.path)
    except OSError:  # no generation_config.json: the one built from config.json stays
        pass
    return model


class RolloutWorker:
    def __init__(self, cfg: FitrlConfig, *, rank: int, world_size: int, models: RunModels | None = None):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        description = described(models, "actor.model", cfg.actor.model)
        self.device = resolve_device(cfg.trainer.device)
        GUARD.configure(cfg.memory)
        torch.manual_seed(cfg.trainer.seed + 104_729 + rank)  # its own sampling stream
        self.tokenizer = load_tokenizer(cfg.actor.model)
        # the policy as an engine sees it: LoRA adapters arrive merged, so the copy is the base
        # model, held in the dtype the policy computes in (bf16 under mixed precision: half the
        # memory of the trained fp32 weights, and half of every weight send)
        self.dtype = compute_dtype(cfg)
        model_cfg = dataclasses.replace(cfg.actor.model, dtype=self.dtype)
        self.own_copy = cfg.rollout.capabilities.holds_own_weights  # the engine holds the weights, not self.model
        self._pushing: dict[str, torch.Tensor] = {}  # the version being streamed into such an engine
        if self.own_copy:
            self.model = shape_only(model_cfg, description)
        else:
            self.model = build_model("causal_lm", model_cfg, cfg.actor, self.device, replicate=True,
                                     description=description)
        self.model.eval().requires_grad_(False)
        inputs = description.family.inputs_for(self.model)
        context = EngineContext(
            model_path=description.path, tokenizer_path=description.tokenizer_path,
            dtype=self.dtype, max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_response_length,
            seed=cfg.trainer.seed + 104_729 + rank, device=self.device,
            limit_images=cfg.data.limit_images if getattr(self.model.config, "vision_config", None) else 0,
            weights=lambda: iter(self._pushing.items()))
        # on a device of its own an engine never sleeps: nothing else there needs its memory back
        engine_cfg = dataclasses.replace(cfg.rollout, sleep_level=0) if self.own_copy else cfg.rollout
        self.engine = build_engine(engine_cfg, self.model, self.tokenizer, inputs=inputs, context=context)
        self.agent = episode_runner(cfg, self.engine, self.model, self.tokenizer, inputs)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.version = -1  # the weights in the copy: -1 until the first send (the trainer's step count after it)
        self._mailbox: tuple[int, dict[str, torch.Tensor]] | None = None
        self._arrived = threading.Condition()
        self.busy_s = 0.0  # seconds spent generating (the rest of the run it waited for work)
        self._since: float | None = None  # when the generation running now started

    @dispatch("all")
    def receive_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Leave ``version`` of the policy's weights for the next micro-batch boundary (a newer
        version replaces an unloaded older one: only the newest is ever loaded)."""
        with self._arrived:
            if version > max(self.version, self._mailbox[0] if self._mailbox else -1):
                self._mailbox = (version, weights)
            self._arrived.notify_all()

    @dispatch("all")
    def join_weight_channel(self, address: ChannelAddress) -> None:
        """Join the trainer's weight channel as rank ``1 + rank`` (``rollout.weight_transport``;
        blocks until every rank has joined)."""
        self.channel = WeightChannel(address, 1 + self.rank, self.device)

    @dispatch("all")
    def receive_broadcast(self, version: int) -> None:
        """Take ``version`` from the channel as the trainer broadcasts it (on the mailbox thread,
        beside a generation) and leave it in the mailbox as :meth:`receive_weights` does."""
        self.receive_weights(self.channel.receive(), version)

    def close(self) -> None:
        """End of the run in this process: the engine frees what it holds (fitrl/workers/group.py)."""
        self.engine.release()

    @dispatch("all")
    def busy_seconds(self) -> float:
        """Seconds spent generating so far, the running generation's included."""
        since = self._since
        return self.busy_s + (time.perf_counter() - since if since is not None else 0.0)

    def _load_newest(self, at_least: int = -1) -> None:
        """Load the mailbox's weights, first waiting (at most :data:`WAIT_FOR_WEIGHTS_S`) until a
        version of at least ``at_least`` has arrived."""
        deadline = time.monotonic() + WAIT_FOR_WEIGHTS_S
        with self._arrived:
            while max(self.version, self._mailbox[0] if self._mailbox else -1) < at_least:
                if not self._arrived.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic()))) \
                        and time.monotonic() >= deadline:
                    raise RuntimeError(f"rollout worker {self.rank}: weights version {at_least} did not arrive in "
                                       f"{WAIT_FOR_WEIGHTS_S:.0f} s (it has version {self.version})")
            taken, self._mailbox = self._mailbox, None
        if taken is None:
            return
        version, weights = taken
        if self.own_copy:
            self._pushing = weights
            try:
                self.engine.push_weights()  # (its own device, never asleep: streamed now)
            finally:
                self._pushing = {}
            self.version = version
            return
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = {k for k in missing if self.model.config.tie_word_embeddings and k.endswith("lm_head.weight")}
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"rollout worker {self.rank}: the trainer's weights do not fit the copy "
                               f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
        self.version = version

    @dispatch("dp", gather=gather_rollouts)  # workers generate to different widths
    def generate(self, prompts: Batch, sampling: SamplingConfig, min_version: int = 0,
                 partial: bool = False) -> Batch:
        """Responses to ``prompts`` under weights of version ``min_version`` or newer. ``partial``:
        newer weights that arrive meanwhile are taken between micro-batches (with
        ``rollout.partial_rollout=requeue``, what older weights made is generated again)."""
        start = self._since = time.perf_counter()
        requeue = partial and self.cfg.rollout.partial_rollout == "requeue"
        try:
            self._load_newest(at_least=min_version)
            per_chunk = max(1, self.cfg.rollout.micro_batch_size // sampling.n) if partial else len(prompts)
            outs, i = [], 0
            while i < len(prompts):
                if i:
                    before = self.version
                    self._load_newest()
                    if requeue and self.version != before:
                        outs, i = [], 0  # (at most rollout.max_staleness times: the trainer waits for this step)
                PROGRESS.beat()
                with torch.no_grad():
                    out = (self.agent or self.engine).generate(prompts.index(slice(i, i + per_chunk)), sampling)
                out.update(rollout_version=torch.full((len(out),), self.version, dtype=torch.long))
                outs.append(out.to("cpu"))
                i += per_chunk
            return concat_rollouts(outs, self.pad_id)
        finally:
            self.busy_s += time.perf_counter() - start
            self._since = None
