"""Workers: what one rank of a role holds, composed from pieces.

``PolicyWorker`` = a policy model + an :class:`Actor` (training) + the rollout engine that
``rollout.engine`` names (:class:`~fitrl.rollout.engine.RolloutEngine`; the default ``hf`` engine
shares the trained module, so generation sees the latest weights without a copy).
``ReferenceWorker`` = a frozen model computing log-probs. ``CriticWorker`` = a value model + a
:class:`Critic`. The reward models' and judges' ranks are in fitrl/roles/model_reward.py, the
distillation teacher's in fitrl/roles/teacher.py. No role flags; each is registered in :data:`ROLES` with its memory planner
beside it (fitrl/memory/roles.py). Under the Ray backend each rank's model is an
FSDP2-sharded module (:func:`fitrl.models.loading.build_model`); the code here is the same.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from fitrl.checkpoint.shared_dir import rank_view
from fitrl.checkpoint.sharded import load_role, save_role
from fitrl.config.batch_sizes import BatchSizes
from fitrl.config.schema import FitrlConfig, SamplingConfig
from fitrl.core.device import autocast, resolve_device
from fitrl.core.registry import Registry
from fitrl.data.batch import Batch
from fitrl.data.supervised import supervised_batch, target_ids
from fitrl.distributed.state import full_state_dict
from fitrl.distributed.ulysses import over_pass, sequence_groups
from fitrl.distributed.weight_sync import ChannelAddress, WeightChannel, open_rendezvous
from fitrl.ops.varlen import packed_attention
from fitrl.models.description import RunModels
from fitrl.models.loading import build_model, described, load_tokenizer
from fitrl.models.params import parameter_set
from fitrl.ops.logprob import response_logprobs
from fitrl.roles.actor import Actor
from fitrl.roles.critic import Critic
from fitrl.roles.moe import replay_routers, replaying
from fitrl.roles.offload import OffloadBetweenPhases, low_precision
from fitrl.roles.rollout_worker import RolloutWorker, episode_runner
from fitrl.rollout import build_engine
from fitrl.rollout.engine import EngineContext
from fitrl.rollout.layout import eos_ids, gather_rollouts
from fitrl.telemetry.guard import GUARD
from fitrl.workers.group import dispatch

ROLES: Registry[type] = Registry("role", "")
"""The model-holding roles by name, each a worker class (one instance per rank). A role's memory
planner is registered under the same name (fitrl/memory/roles.py, ``ROLE_PLANNERS``); a role
without one never runs (fitrl/trainer/run.py, ``make_group``) and fails
``tests/test_extension_points.py``. Each is built ``worker_cls(cfg, rank=, world_size=, models=)``:
``models``, the run's model descriptions read once by the driver (fitrl/models/description.py),
is None where a worker is built directly (it then reads its own model's directory)."""


class PolicyWorker:
    def __init__(self, cfg: FitrlConfig, *, rank: int, world_size: int, models: RunModels | None = None):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.description = described(models, "actor.model", cfg.actor.model)
        self.device = resolve_device(cfg.trainer.device)
        GUARD.configure(cfg.memory)
        torch.manual_seed(cfg.trainer.seed + rank)
        self.tokenizer = load_tokenizer(cfg.actor.model)
        self.params = parameter_set(cfg.actor.lora)  # full, or LoRA adapters on a frozen base
        self.model = build_model("causal_lm", cfg.actor.model, cfg.actor, self.device,
                                 nnodes=cfg.trainer.nnodes, params=self.params, description=self.description)
        inputs = self.description.family.inputs_for(self.model)  # positions, images
        self.autocast_dtype = low_precision(cfg.autocast_dtype("actor"))  # mixed precision in one process
        self.actor = Actor(self.model, cfg.actor, cfg.algorithm, total_steps=cfg.trainer.max_steps,
                           seed=cfg.trainer.seed, max_response_length=cfg.rollout.max_response_length,
                           inputs=inputs, autocast_dtype=self.autocast_dtype,
                           after_micro_batch=lambda: self.offload.micro_batch_done(),
                           sequence_group=sequence_groups(cfg.actor.ulysses_size), device=self.device)
        self.rollout = build_engine(dataclasses.replace(cfg.rollout, engine=cfg.rollout.trainer_engine), self.model,
                                    self.tokenizer, inputs=inputs,
                                    context=self.engine_context())
        self.offload = OffloadBetweenPhases(self.model, cfg.actor.fsdp, self.device, self.actor.optimizer,
                                            trim=cfg.memory.trim_heap)
        # multi-turn episodes on the engine (rollout.agent; fitrl/rollout/agent.py)
        self.agent = episode_runner(cfg, self.rollout, self.model, self.tokenizer, inputs)

    def engine_context(self) -> EngineContext:
        """What an engine with its own copy of the policy (vLLM) needs: where the model's files are,
        the precision it computes in, the longest sequence, a seed, and the weights to push."""
        cfg = self.cfg
        mixed = cfg.actor.fsdp.mixed_precision  # bf16 compute, by FSDP2 or by autocast
        return EngineContext(
            model_path=self.description.path, tokenizer_path=self.description.tokenizer_path,
            dtype="bfloat16" if mixed else cfg.actor.model.dtype,
            max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_response_length,
            # the ranks of one engine (rollout.tensor_parallel_size of them, consecutive) build it alike
            seed=cfg.trainer.seed + self.rank // cfg.rollout.tensor_parallel_size,
            limit_images=cfg.data.limit_images if getattr(self.model.config, "vision_config", None) else 0,
            weights=lambda: self.params.inference_weights(self.model), pushes=not cfg.trainer.val_only)

    @dispatch("dp", gather=gather_rollouts)  # ranks generate to different widths
    def generate(self, prompts: Batch, sampling: SamplingConfig) -> Batch:
        with self.offload.phase(), autocast(self.device, self.autocast_dtype):  # (no weight changes inside)
            self.rollout.wake()
            try:
                return (self.agent or self.rollout).generate(prompts, sampling).to("cpu")
            finally:
                self.rollout.sleep()

    @dispatch("dp", sequence_parallel=True)
    def compute_logprob(self, batch: Batch) -> Batch:
        with self.offload.phase():
            return self.actor.compute_logprob(batch.to(self.device), self.cfg.rollout.temperature).to("cpu")

    @dispatch("dp", sequence_parallel=True)
    def compute_ref_logprob(self, batch: Batch) -> Batch:
        """The reference log-probs of a LoRA run: the same weights with every adapter off (no
        reference model is built)."""
        with self.offload.phase(), self.params.base_only(self.model):
            out = self.actor.compute_logprob(batch.to(self.device), self.cfg.rollout.temperature,
                                             measure_routing=False)  # (the policy's pass measures)
        return Batch({"ref_logprobs": out["old_logprobs"]}).to("cpu")

    @dispatch("dp", sequence_parallel=True)
    def sft_update(self, prompts: Batch) -> dict[str, float]:
        """One step of supervised fine-tuning (``fitrl sft``) on this rank's share of the
        prompts: each row's answer, as text, then the token that ends a response, is the target
        (fitrl/data/supervised.py); the loss is its negative log-likelihood (``Actor.update``,
        ``supervised``), in ``actor.mini_batch_size`` prompts per optimizer step."""
        end = eos_ids(self.model, self.tokenizer)[0]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else end
        targets = target_ids(prompts["answer"], self.tokenizer, end, self.cfg.rollout.max_response_length)
        batch = supervised_batch(prompts, targets, pad)
        batch.update(position_ids=self.actor.inputs.positions(batch["input_ids"], batch["attention_mask"], batch))
        seqs = BatchSizes.supervised(self.cfg, self.cfg.data_parallel_size).mini_batch_per_rank
        with self.offload.phase(needs_optimizer=True):
            metrics = self.actor.update(batch.to(self.device), sequences_per_mini_batch=seqs, temperature=1.0,
                                        supervised=True)
        self.rollout.push_weights()  # validation samples from the updated policy
        metrics["sft/target_tokens"] = float(batch["response_mask"].sum())
        return metrics

    @dispatch("dp", sequence_parallel=True)
    def update(self, batch: Batch, distill_weight: float | None = None) -> dict[str, float]:
        """One RL step; ``distill_weight``: this step's (``algorithm.distill.weight_at``), said by the loop."""
        seqs = BatchSizes.of(self.cfg, self.cfg.data_parallel_size).mini_batch_per_rank
        own = self.cfg.old_logprob_source == "update"  # else the batch carries them (a pass, or the engine's)
        with self.offload.phase(needs_optimizer=True):
            metrics = self.actor.update(batch.to(self.device), sequences_per_mini_batch=seqs,
                                        temperature=self.cfg.rollout.temperature,
                                        old_logprobs_from="update" if own else "batch", distill_weight=distill_weight)
        self.rollout.push_weights()  # the next rollout samples from the updated policy
        return {**metrics, **self.rollout.metrics()}

    @dispatch("all")
    def inference_weights(self, dtype: str) -> dict[str, torch.Tensor] | None:
        """The weights a rollout worker of its own loads (fitrl/roles/rollout_worker.py): full
        tensors on the host in ``dtype``, LoRA adapters merged; a collective under FSDP2, kept by
        rank 0 only (the others drop each gathered tensor at once)."""
        with self.offload.phase(), torch.no_grad():
            out = {}
            for name, t in self.params.inference_weights(self.model, getattr(torch, dtype)):
                if self.rank == 0:
                    out[name] = t.to("cpu", copy=True)
            return out if self.rank == 0 else None

    # -- the weight channel to rollout workers of their own (rollout.weight_transport=collective) --

    @dispatch("all")
    def open_weight_channel(self, receivers: int, timeout_s: float) -> ChannelAddress | None:
        """Rank 0 hosts the channel's rendezvous on its node (MASTER_ADDR: where the policy's own
        group meets) for itself and ``receivers`` workers; its address, for them to join."""
        if self.rank != 0:
            return None
        self._channel_store, address = open_rendezvous(os.environ.get("MASTER_ADDR", "127.0.0.1"), receivers + 1,
                                                       timeout_s)
        return address

    @dispatch("all")
    def join_weight_channel(self, address: ChannelAddress) -> None:
        """Rank 0 joins as the channel's rank 0 (blocks until every worker has joined)."""
        if self.rank == 0:
            self.channel = WeightChannel(address, 0, self.device, store=self._channel_store)

    @dispatch("all")
    def broadcast_weights(self, dtype: str, bucket_bytes: int) -> int:
        """:meth:`inference_weights` over the channel: every rank gathers each full tensor on its
        device (a collective under FSDP2), rank 0 copies it into a bucket and drops it, and each
        full bucket is broadcast to the workers; returns rank 0's bucket count."""
        with self.offload.phase(), torch.no_grad():
            weights = self.params.inference_weights(self.model, getattr(torch, dtype))
            if self.rank == 0:
                return self.channel.send(weights, bucket_bytes)
            for _ in weights:  # (the other ranks drop each gathered tensor at once)
                pass
            return 0

    def close(self) -> None:
        """End of the run in this process: the engine frees what it holds (fitrl/workers/group.py)."""
        self.rollout.release()

    @dispatch("all")
    def num_parameters(self) -> int:
        # under FSDP2 parameters are DTensors whose numel() is the full (unsharded) size
        return sum(p.numel() for p in self.model.parameters())

    @dispatch("all")
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights on the host; a collective under FSDP2."""
        with self.offload.phase():
            return full_state_dict(self.model)

    # Checkpoints are written from wherever the shards live (device, or host when offloaded
    # between phases): no move to the device, no gather. A collective under FSDP2.
    # With LoRA only the adapters (and their AdamW states) are saved: the base is rebuilt from its path.
    @dispatch("all")
    def save_checkpoint(self, path: str, model_only: bool = False) -> None:
        save_role(path, self.model, None if model_only else self.actor.optimizer,
                  None if model_only else self.actor.state_dict(), rank=self.rank,
                  keep=self.params.trained_names(self.model))

    @dispatch("all")
    def run_dir_view(self, run_dir: str, token: str) -> dict:
        """This rank's view of the run directory, for the driver's check before step 1 that every
        rank writes its shards where it reads them (fitrl/checkpoint/shared_dir.py; the driver's side in fitrl/trainer/rundir.py, ``check_shared``)."""
        return rank_view(run_dir, token, self.rank)

    @dispatch("all")
    def load_checkpoint(self, path: str, weights_only: bool = False) -> None:
        what, rank = f"actor.model.path={self.cfg.actor.model.path}", self.cfg.actor.lora.rank
        if rank:
            what += f", actor.lora.rank={rank}"
        hint = (f"actor.lora.rank={rank}: a LoRA policy loads the adapters of a checkpoint saved with its actor.lora "
                "settings" if rank else "actor.lora.rank=0: full fine-tuning loads a checkpoint of the whole policy, "
                "not LoRA adapters")
        extra = load_role(path, self.model, None if weights_only else self.actor.optimizer, rank=self.rank,
                          what=what, keep=self.params.trained_names(self.model), hint=hint)
        self.offload.restored()  # the restored AdamW states where the next update reads them
        if extra is not None and not weights_only:
            self.actor.load_state_dict(extra)


class ReferenceWorker:
    def __init__(self, cfg: FitrlConfig, *, rank: int, world_size: int, models: RunModels | None = None):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = resolve_device(cfg.trainer.device)
        GUARD.configure(cfg.memory)
        model_cfg = cfg.ref.model or cfg.actor.model
        description = described(models, "ref.model", model_cfg)
        self.model = build_model("causal_lm", model_cfg, cfg.ref, self.device, what="ref.model.path",
                                 nnodes=cfg.trainer.nnodes, description=description)
        self.model.eval().requires_grad_(False)
        self.inputs = description.family.inputs_for(self.model)
        self.offload = OffloadBetweenPhases(self.model, cfg.ref.fsdp, self.device, trim=cfg.memory.trim_heap)
        self.sequence_group = sequence_groups(cfg.actor.ulysses_size)  # as the policy's ranks
        self.routers = replay_routers(self.model, cfg.actor)  # actor.routing_replay on a MoE (fitrl/roles/moe.py)

    def _attention(self):
        """As the policy's passes (fitrl/roles/actor.py, ``Actor.sequence_parallel``)."""
        if self.sequence_group is not None or not self.cfg.actor.packing:
            return over_pass(self.model, self.sequence_group)
        return packed_attention(self.model, self.device)

    @dispatch("dp", sequence_parallel=True)
    @torch.no_grad()
    def compute_ref_logprob(self, batch: Batch) -> Batch:
        batch = batch.to(self.device)
        out = []
        with self.offload.phase(), autocast(self.device, low_precision(self.cfg.autocast_dtype("ref"))), \
                self._attention():
            for micro in batch.split(self.cfg.ref.logprob_micro_batch_size):
                GUARD.check(self.device)  # safe point (read-only phase)
                with replaying(self.routers, micro):
                    lp, _ = response_logprobs(
                        self.model, micro["input_ids"], micro["attention_mask"], micro["position_ids"],
                        micro["responses"].shape[1], temperature=self.cfg.rollout.temperature,
                        chunk_size=self.cfg.actor.logprob_chunk_size,
                        model_kwargs=self.inputs.extra(micro, self.device),
                        share_prompts=self.cfg.actor.share_prompts, pack=self.cfg.actor.packing,
                        sequence_group=self.sequence_group)
                out.append(lp)
                self.offload.micro_batch_done()
        return Batch({"ref_logprobs": torch.cat(out).cpu()})


class CriticWorker:
    def __init__(self, cfg: FitrlConfig, *, rank: int, world_size: int, models: RunModels | None = None):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = resolve_device(cfg.trainer.device)
        GUARD.configure(cfg.memory)
        torch.manual_seed(cfg.trainer.seed + 7919)  # the value head's init (rank 0's is broadcast)
        model_cfg = cfg.critic.model or cfg.actor.model
        description = described(models, "critic.model", model_cfg)
        self.model = build_model("value", model_cfg, cfg.critic, self.device,
                                 what="critic.model.path", nnodes=cfg.trainer.nnodes, description=description)
        self.critic = Critic(self.model, cfg.critic, total_steps=cfg.trainer.max_steps,
                             max_response_length=cfg.rollout.max_response_length,
                             inputs=description.family.inputs_for(self.model),
                             after_micro_batch=lambda: self.offload.micro_batch_done())
        self.offload = OffloadBetweenPhases(self.model, cfg.critic.fsdp, self.device, self.critic.optimizer,
                                            trim=cfg.memory.trim_heap)

    @dispatch("dp")
    def compute_values(self, batch: Batch) -> Batch:
        with self.offload.phase():
            return self.critic.compute_values(batch.to(self.device)).to("cpu")

    @dispatch("dp")
    def update(self, batch: Batch) -> dict[str, float]:
        seqs = BatchSizes.of(self.cfg, self.world_size, role="critic").mini_batch_per_rank
        with self.offload.phase(needs_optimizer=True):
            return self.critic.update(batch.to(self.device), sequences_per_mini_batch=seqs)

    @dispatch("all")
    def save_checkpoint(self, path: str, model_only: bool = False) -> None:
        save_role(path, self.model, None if model_only else self.critic.optimizer,
                  None if model_only else self.critic.state_dict(), rank=self.rank)

    @dispatch("all")
    def load_checkpoint(self, path: str, weights_only: bool = False) -> None:
        model = self.cfg.critic.model or self.cfg.actor.model
        extra = load_role(path, self.model, None if weights_only else self.critic.optimizer, rank=self.rank,
                          what=f"critic.model.path={model.path}")
        self.offload.restored()  # the restored AdamW states where the next update reads them
        if extra is not None and not weights_only:
            self.critic.load_state_dict(extra)


from fitrl.roles.model_reward import JudgeWorker, RewardModelWorker  # noqa: E402  (needs no name of this module)
from fitrl.roles.teacher import TeacherWorker  # noqa: E402

for _name, _worker in (("actor", PolicyWorker), ("ref", ReferenceWorker), ("teacher", TeacherWorker),
                       ("critic", CriticWorker),
                       ("reward_model", RewardModelWorker), ("judge", JudgeWorker), ("rollout", RolloutWorker)):
    ROLES.add(_name, _worker)
