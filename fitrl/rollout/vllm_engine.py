"""Rollout with vLLM (``rollout.engine: vllm``), colocated with the policy on each rank.

With ``rollout.tensor_parallel_size`` 1, one engine per policy rank, built in the trainer's own
process (vLLM's in-process mode, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): there is no engine
process to orphan when the trainer is killed, and weights reach the engine as tensors, not
through a socket (docs/vllm.md). With tp > 1 and several policy ranks, ``tp`` consecutive ranks
make one engine, each rank one TP shard in its own process; with one policy rank, the engine's
TP workers are processes of vLLM's multiprocess executor, which the kernel kills with the
trainer (fitrl/rollout/vllm_worker.py, ``die_with_parent``), and weights reach them in bounded
buckets (fitrl/rollout/vllm_build.py says which layout is used when).

The engine's lifecycle per RL step (driven by :class:`fitrl.roles.workers.PolicyWorker`). On a
GPU it sleeps once built, before the roles that share its devices load, at the level
``rollout.sleep_level`` gives (``auto``: 2 in a training run, whose pushes overwrite the weights
anyway; 1 with ``trainer.val_only``), and says so in one line:

  update  -> push_weights()  streams the trainer's weights now if the engine is awake (CPU, sleep
                             level 0), else marks them stale
  generate: wake()           weights back (GPU, sleep level 1) -> stream the trainer's weights if
                             stale -> reset the prefix cache -> KV cache back
            generate(...)    all prompts x n in one call; vLLM schedules by KV capacity
            sleep()          GPU only: level 1 frees the KV cache and moves the weights to pinned
                             host memory, level 2 frees both (they are pushed again at wake)

The engine is built with ``load_format="dummy"``: it never reads the checkpoint, since the first
wake pushes the trainer's weights (LoRA adapters merged), one full tensor at a time. A push that
fails part-way leaves vLLM with half-loaded (meta) layers; the engine is then marked broken and
the step fails with :class:`~fitrl.core.errors.EngineBroken` while the trainer's state and its
last checkpoint stay intact; so does a failure of vLLM's own during generation (its engine core
or a TP worker process died). With ``trainer.max_restarts`` the run then restarts: the worker
groups, and with them the engine, are rebuilt and resume from the newest checkpoint.

Log-probs: those of the tempered distribution before top-k/top-p truncation, as the HF engine
records and the trainer recomputes (fitrl/rollout/vllm_worker.py says how). Greedy decoding is
sampled as top-k 1 at temperature 1, so that tokens the family never generates (image pads) are
masked the same way as in sampling.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import torch

from fitrl.config.schema import RolloutConfig, SamplingConfig
from fitrl.core.engines import EngineCapabilities
from fitrl.core.errors import ConfigError, Diverged, EngineBroken
from fitrl.core.padding import left_pad
from fitrl.data.batch import Batch
from fitrl.models.families import media_spec_of
from fitrl.models.families.base import TEXT_INPUTS, ModelInputs
from fitrl.rollout.engine import GENERATION, ROLLOUT_ENGINES, EngineContext, RolloutEngine
from fitrl.rollout.layout import assemble_rollout, eos_ids
from fitrl.rollout.tensor_ipc import to_wire
from fitrl.rollout.vllm_build import (SUPPORTED_VLLM, build_llm, engine_layout, trainer_group_kept,
                                      vllm_version)

PUSH_BUCKET_BYTES = 128 << 20
"""TP worker processes (layout ``workers``): full tensors per weight-push call at most (one larger
tensor goes alone). Every TP worker receives a bucket whole (a copy in its own memory while it
loads) and the trainer holds it until the call returns; the push never holds the whole model a
second time."""


@ROLLOUT_ENGINES.register("vllm")
class VllmRollout(RolloutEngine):
    capabilities = EngineCapabilities(holds_own_weights=True, sleeps=True, tensor_parallel=True, title="vLLM")

    def __init__(self, model: torch.nn.Module, tokenizer, cfg: RolloutConfig, *, inputs: ModelInputs,
                 context: EngineContext):
        if context.weights is None or not context.model_path:
            raise ValueError("the vLLM engine needs EngineContext.model_path and .weights")
        self.cfg, self.inputs, self.context, self.tokenizer = cfg, inputs, context, tokenizer
        self._model = model  # the trainer's module (checks only: weights reach vLLM through context.weights)
        self.device = context.device or next(model.parameters()).device
        self.cuda = self.device.type == "cuda"
        self.eos_ids = eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.sleep_level, why = cfg.sleep_level_for(pushes=context.pushes)
        self.sleeps = self.cuda and self.sleep_level > 0  # vLLM's sleep mode needs CUDA's allocator
        self.vision = media_spec_of(context.model_path)  # the family's media handling; None for a text model
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.vision.image_token) if self.vision else None
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.vision.video_token) if self.vision else None
        self.layout = engine_layout(cfg.tensor_parallel_size)
        self.tp = self.layout.tp
        # shared: the ranks of one engine exchange their requests (and a sampling seed) over this
        # group before each generate; new_group is itself a collective over the policy's ranks
        self.group = shared_groups(self.layout) if self.layout.mode == "shared" else None
        self.llm = build_llm(cfg, context, model, self.layout, cuda=self.cuda, sleep=self.sleeps, vision=self.vision)
        missing = self.llm.collective_rpc("fitrl_prepare", args=(list(inputs.never_generate), os.getpid()))[0]
        if missing:
            raise ConfigError(f"rollout.engine=vllm: this vLLM ({vllm_version()}) has no {missing}; fitrl's engine "
                              f"supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}")
        if self.vision is not None:
            self.llm.collective_rpc("fitrl_restore_input_norm", args=(list(self.vision.image_mean),
                                                                      list(self.vision.image_std), 1 / 255))
        self.awake = True
        self.eos_masked = False  # sampling.ignore_eos the worker masks EOS for (fitrl_mask_eos)
        self.stale = True  # dummy weights until the first push
        self.broken: Optional[str] = None
        self.last_push = {}  # seconds and tensors of the last push (perf metrics, benchmarks)
        if self.sleeps:
            # asleep from the start: the roles that load after the policy on its devices (reference,
            # critic, reward models; the policy's optimizer states) find the engine's memory free,
            # where an awake engine would hold it until the first rollout. The weights are still
            # vLLM's dummy ones (stale): the first wake pushes the trainer's whatever the level.
            self.sleep()
        if self.layout.rank == 0:
            print(sleep_line(self.cuda, self.sleep_level, why), flush=True)

    @classmethod
    def from_config(cls, model, tokenizer, cfg, *, inputs=TEXT_INPUTS, context=EngineContext()) -> "VllmRollout":
        return cls(model, tokenizer, cfg, inputs=inputs, context=context)

    # ------------------------------------------------------------------ lifecycle

    def push_weights(self) -> None:
        """Awake (CPU, or sleep level 0): stream the weights now. Asleep: at the next wake, after
        the weights' memory is back and before the KV cache's. Either way every rank pushes at
        the same point (the end of its update, or the start of its rollout)."""
        self.stale = True
        if self.awake:
            self._push()

    def metrics(self) -> dict[str, float]:
        if not self.last_push:
            return {}
        return {"perf/weight_push_s": self.last_push["seconds"], "perf/weight_push_tensors": self.last_push["tensors"]}

    def wake(self) -> None:
        if self.broken:
            raise EngineBroken(self.broken)
        if not self.awake:
            self.llm.wake_up(tags=["weights"])
        if self.stale:
            self._push()
        if not self.awake:
            self.llm.wake_up(tags=["kv_cache"])
            self.awake = True

    def sleep(self) -> None:
        if self.sleeps and self.awake and not self.broken:
            self.llm.sleep(level=self.sleep_level)
            self.awake = False
            if self.sleep_level == 2:
                self.stale = True  # weights discarded: the next wake pushes them again

    def release(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            with trainer_group_kept():  # vLLM would destroy the policy's process group too
                core.shutdown()
        del llm
        if self.cuda:
            torch.cuda.empty_cache()

    def _push(self) -> None:
        start = time.perf_counter()
        try:
            if self.layout.mode != "workers":  # the worker is this process: the trainer's iterator as is
                count = self.llm.collective_rpc("fitrl_load_weights", args=(self.context.weights(),))[0]
            else:
                count = self._push_in_buckets()
        except BaseException as e:  # interrupts too: the engine is unusable either way
            self.broken = (f"the vLLM engine is unusable: a weight push failed part-way ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); the trainer's state and its last "
                           "checkpoint are intact: resume from the checkpoint")
            if isinstance(e, Exception):
                raise EngineBroken(self.broken) from e
            raise
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        if self.vision is not None:  # and cached image encodings (a cache miss then fails the request)
            self.llm.llm_engine.reset_encoder_cache()
        self.stale = False
        self.last_push = {"seconds": time.perf_counter() - start, "tensors": float(count)}

    def _push_in_buckets(self) -> int:
        """TP workers are processes: each call's arguments are pickled into vLLM's shared-memory
        queue (CPU tensors out of band; CUDA tensors as IPC handles, :func:`to_wire`), so the
        trainer's tensors go in buckets of at most :data:`PUSH_BUCKET_BYTES`, each a list of (name,
        full tensor) for every worker to shard."""
        rpc = self.llm.collective_rpc
        rpc("fitrl_begin_push")
        count, bucket, size = 0, [], 0
        for name, tensor in self.context.weights():
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > PUSH_BUCKET_BYTES:
                rpc("fitrl_load_bucket", args=(bucket,))
                bucket, size = [], 0
            # on a GPU an IPC handle of the device tensor, held until the bucket's call returns
            # (fitrl/rollout/tensor_ipc.py); on CPU the host tensor
            bucket.append((name, to_wire(tensor)))
            size += nbytes
            count += 1
        if bucket:
            rpc("fitrl_load_bucket", args=(bucket,))
        rpc("fitrl_finish_push")
        return count

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, prompts: Batch, sampling: SamplingConfig) -> Batch:
        """prompts: field ``prompt_ids`` (list[list[int]]) and any per-prompt fields, repeated
        ``n`` times in the result (layout: :mod:`fitrl.rollout.engine`)."""
        if self.broken:
            raise EngineBroken(self.broken)
        if self.stale or not self.awake:
            self.wake()
        GENERATION.safe_point()  # before the engine takes over: vLLM's own loop has none
        requests = [self._request(prompts, i) for i in range(len(prompts))]
        # No per-request seeds: in-process, vLLM's sampler draws from this process's torch RNG,
        # whose state fitrl checkpoints (a resumed run samples what the uninterrupted one would).
        # (Seeded requests also fail on vLLM 0.32's CPU backend once a prefill is chunked.)
        if sampling.ignore_eos != self.eos_masked:
            self.llm.collective_rpc("fitrl_mask_eos", args=(list(self.eos_ids) if sampling.ignore_eos else [],))
            self.eos_masked = sampling.ignore_eos
        if self.layout.mode == "shared":
            outputs = self._generate_shared(requests, sampling)
        else:
            if self.layout.mode == "workers":  # TP workers draw from their own RNGs: seeded from this process's
                self.llm.collective_rpc("fitrl_seed", args=(int(torch.randint(0, 2**62, ())),))
            outputs = self._engine_call(self.llm.generate, requests, self._params(sampling), use_tqdm=heartbeat_bar)
        responses, logprobs = [], []
        for out in outputs:
            for sample in sorted(out.outputs, key=lambda s: s.index):
                ids = list(sample.token_ids) or [self.pad_id]
                lps = [entry[tok].logprob for tok, entry in zip(sample.token_ids, sample.logprobs or [])]
                responses.append(torch.tensor([ids], dtype=torch.long))
                logprobs.append(torch.tensor([lps or [0.0]], dtype=torch.float32))
        lp_all = torch.cat([lp.flatten() for lp in logprobs])
        if not torch.isfinite(lp_all).all():
            raise Diverged("the policy's logits hold NaN or infinity during generation: its weights have diverged "
                           "(a learning rate too high: actor.optim.lr) or the weights it loaded are corrupt")
        seqs = prompts.repeat_interleave(sampling.n)
        width = max(len(p) for p in seqs["prompt_ids"])
        prompt_ids, prompt_mask = left_pad(seqs["prompt_ids"], self.pad_id, width)
        return assemble_rollout(prompts, seqs, prompt_ids, prompt_mask, responses, logprobs, eos_ids=self.eos_ids,
                                pad_id=self.pad_id, inputs=self.inputs, tokenizer=self.tokenizer)

    def _generate_shared(self, requests: list[dict], sampling: SamplingConfig) -> list:
        """One engine over ``tp`` ranks: each of them schedules and samples on its own, in lockstep,
        so all must submit the same requests from the same RNG state (different requests abort
        vLLM's TP all-reduce; different RNG states sample different tokens, silently). The group
        gathers its ranks' requests in rank order and samples from the first rank's seed; each
        rank keeps the outputs of its own prompts."""
        seed = int(torch.randint(0, 2**62, ()))  # every rank draws: all RNG streams advance alike
        gathered: list = [None] * self.tp
        torch.distributed.all_gather_object(gathered, (requests, seed), group=self.group)
        everyone = [r for part, _ in gathered for r in part]
        mine = self.layout.group.index(self.layout.rank)
        start = sum(len(part) for part, _ in gathered[:mine])
        devices = [torch.cuda.current_device()] if self.cuda else []
        with torch.random.fork_rng(devices=devices):  # the trainer's own stream resumes after
            torch.manual_seed(gathered[0][1])
            outputs = self._engine_call(self.llm.generate, everyone, self._params(sampling), use_tqdm=heartbeat_bar)
        return outputs[start:start + len(requests)]

    def _engine_call(self, fn, *args, **kwargs):
        """``fn`` (a call into vLLM); vLLM's own failure (its engine core or a TP worker process died,
        a scheduler error) marks the engine broken: an :class:`EngineBroken` naming the cause, which
        a restart rebuilds (``trainer.max_restarts``). fitrl's own stops pass through."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if not type(e).__module__.startswith("vllm"):
                raise
            self.broken = (f"the vLLM engine failed during generation ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else 'no message'}); the trainer's state and its last "
                           "checkpoint are intact: resume from the checkpoint (or set trainer.max_restarts)")
            raise EngineBroken(self.broken) from e

    def _request(self, prompts: Batch, i: int) -> dict[str, Any]:
        ids = list(prompts["prompt_ids"][i])
        media = prompts.fields.get("multi_modal_inputs")
        media = media[i] if media is not None else None
        if not media:
            return {"prompt_token_ids": ids}
        # vLLM expands one pad token per image or video itself (fitrl's prompts hold the expanded
        # runs: sent as is, each run would be expanded again), and takes pictures, not patches:
        # the exact resized pixels the trainer sees, which vLLM's processor leaves as they are
        pads = {self.image_token_id, self.video_token_id}
        collapsed = [t for j, t in enumerate(ids) if t not in pads or j == 0 or ids[j - 1] != t]
        data: dict[str, Any] = {}
        kwargs: dict[str, Any] = {}
        if media.get("pixel_values") is not None:
            data["image"] = self.vision.images_from_pixels(media["pixel_values"], media["image_grid_thw"])
            pixels = [im.width * im.height for im in data["image"]]
            kwargs.update(min_pixels=min(pixels), max_pixels=max(pixels))
        if media.get("pixel_values_videos") is not None:
            videos = self.vision.frames_from_pixels(media["pixel_values_videos"], media["video_grid_thw"])
            # Qwen2.5-VL's temporal positions step by second_per_grid_ts = temporal patch / fps:
            # the frame rate the trainer's positions were built with (Qwen2-VL reads none)
            steps = media.get("second_per_grid_ts")
            fps = [self.vision.temporal_patch_size / float(s) for s in steps] if steps is not None else [1.0] * len(videos)
            data["video"] = [(frames, {"fps": rate, "total_num_frames": len(frames), "duration": len(frames) / rate,
                                       "frames_indices": list(range(len(frames))), "video_backend": "fitrl"})
                             for frames, rate in zip(videos, fps)]
            # frames are already sampled, padded and resized (fitrl/models/families/qwen_vl/media.py);
            # images too are at their resized size, so no resize is right for both
            kwargs.update(do_resize=False, do_sample_frames=False)
        return {"prompt_token_ids": collapsed, "multi_modal_data": data, "mm_processor_kwargs": kwargs}

    def _params(self, sampling: SamplingConfig):
        from vllm import SamplingParams

        greedy = sampling.greedy
        return SamplingParams(
            n=sampling.n,
            # greedy = top-k 1 at temperature 1: argmax through the same (masking) sampler path,
            # and the recorded log-probs untempered, as the HF engine records them
            temperature=1.0 if greedy else sampling.temperature,
            top_k=1 if greedy else (sampling.top_k if sampling.top_k > 0 else 0),
            top_p=1.0 if greedy else sampling.top_p,
            max_tokens=sampling.max_tokens,
            # vLLM's ignore_eos only keeps going; like the HF engine, EOS must not be sampled
            # either: the worker masks it after the record (fitrl_mask_eos)
            ignore_eos=sampling.ignore_eos,
            stop_token_ids=list(self.eos_ids),
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,  # decoded once here, without EOS and padding
        )

    # ------------------------------------------------------------------ checks (tests, benchmarks)

    def sequence_logprobs(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """The engine's log-probs (temperature 1) of each sequence's tokens after the first: (len-1,)
        per sequence. Compared with the trainer's after a push, they show the push is exact."""
        from vllm import SamplingParams

        if self.stale or not self.awake:
            self.wake()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in token_ids], params, use_tqdm=heartbeat_bar)
        result = []
        for ids, out in zip(token_ids, outs):
            entries = out.prompt_logprobs[1:]  # the first token has none
            result.append(torch.tensor([e[t].logprob for t, e in zip(ids[1:], entries)], dtype=torch.float32))
        return result


def sleep_line(cuda: bool, level: int, why: str) -> str:
    """The engine's one line on how it sleeps between rollouts, and why."""
    if not cuda:
        return "vLLM engine: awake between rollouts (vLLM's sleep mode needs CUDA)"
    if level == 0:
        return f"vLLM engine: awake between rollouts, holding its weights and KV cache ({why})"
    kept = "weights kept in pinned host memory" if level == 1 else "weights discarded, pushed again at wake"
    return (f"vLLM engine: sleep level {level} from the start and between rollouts (KV cache freed, {kept}): "
            f"{why}")


def shared_groups(layout) -> Any:
    """This rank's engine group (gloo: the requests exchanged are Python objects on the host).
    Every rank creates every group, in the same order: ``new_group`` is a collective."""
    mine = None
    for first in range(0, layout.world, layout.tp):
        ranks = list(range(first, first + layout.tp))
        group = torch.distributed.new_group(ranks, backend="gloo")
        if layout.rank in ranks:
            mine = group
    return mine


def heartbeat_bar(*args, **kwargs):
    """vLLM's progress bar, writing nowhere: each finished request is a heartbeat for the hang
    watchdog (fitrl/telemetry/progress.py), which otherwise hears nothing while vLLM generates."""
    import io

    from tqdm import tqdm

    class Beats(tqdm):
        def update(self, n=1):
            GENERATION.step(guard=False)  # a guard raising inside vLLM's loop would leave it half-way
            return super().update(n)

    return Beats(*args, **{**kwargs, "file": io.StringIO()})
