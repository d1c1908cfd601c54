"""Which parameters of the policy train: all of them (``full``) or LoRA adapters (``lora``).

A parameter set is applied to the model right after it is built (before gradient checkpointing
and FSDP2 sharding, on the meta-device copy and on rank 0's loaded copy alike), and then says
what a checkpoint must hold (:meth:`ParameterSet.trained_names`) and how to run the frozen base
(:meth:`ParameterSet.base_only`, the reference policy of a LoRA run). Optimizers only ever see
parameters with ``requires_grad``, so with LoRA the gradients and AdamW states are the adapters'.

LoRA comes from PEFT (``inject_adapter_in_model``): the adapters are injected into the
transformers module in place, so the model keeps its class, its ``generate`` and its decoder
layers (the FSDP2 units), and a linear layer's weight moves to ``<name>.base_layer.weight``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from fitrl.config.schema import LoRAConfig
from fitrl.core.errors import ConfigError
from fitrl.distributed.state import stream_full_tensors

ADAPTER = "default"  # PEFT's adapter name; one adapter per model


class ParameterSet:
    """Every parameter trains (full fine-tuning)."""

    name = "full"

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def trained_names(self, model: nn.Module) -> set[str] | None:
        """State-dict keys a checkpoint holds (None: the whole state dict)."""
        return None

    def inference_weights(self, model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights an inference engine loads, under the checkpoint's names, one full tensor at
        a time (a collective under FSDP2: see :func:`fitrl.distributed.state.stream_full_tensors`)."""
        yield from stream_full_tensors(model, dtype)

    @contextmanager
    def base_only(self, model: nn.Module) -> Iterator[None]:
        raise NotImplementedError("full fine-tuning has no frozen base: the reference is a model of its own")
        yield  # pragma: no cover


class LoRA(ParameterSet):
    """PEFT LoRA adapters on the linear layers ``cfg.target_modules``; the base is frozen."""

    name = "lora"

    def __init__(self, cfg: LoRAConfig):
        self.cfg = cfg

    def peft_config(self):
        from peft import LoraConfig  # PEFT imports accelerate: only runs with LoRA pay for it

        targets = self.cfg.target_modules
        return LoraConfig(r=self.cfg.rank, lora_alpha=self.cfg.alpha, lora_dropout=self.cfg.dropout,
                          target_modules="all-linear" if targets == ["all-linear"] else list(targets))

    def apply(self, model: nn.Module) -> nn.Module:
        from peft import inject_adapter_in_model

        # The same initial adapters on every rank and in every process, whatever the RNG state:
        # ranks that read the checkpoint themselves (fsdp.init=every_rank) must agree.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            try:
                inject_adapter_in_model(self.peft_config(), model, adapter_name=ADAPTER)
            except ValueError as e:  # PEFT: no module matched the target names
                raise ConfigError(f"actor.lora.target_modules={self.cfg.target_modules}: {e}") from None
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None and _is_lora_layer(head):
            # fitrl.ops.logprob applies the head's weight chunk by chunk; an adapter there would be
            # skipped in training while generation used it
            raise ConfigError(f"actor.lora.target_modules={self.cfg.target_modules} puts an adapter on the output "
                              "head, which fitrl does not support; target the decoder's linear layers (all-linear "
                              "leaves the head out)")
        return model

    def trained_names(self, model: nn.Module) -> set[str]:
        return {n for n, p in model.named_parameters() if p.requires_grad}

    def inference_weights(self, model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Merged weights ``W + scaling * B @ A`` under the base model's names (an engine without
        adapters sees the policy as trained). A layer's base weight waits for its two adapter
        matrices, which follow it in the state dict: one layer's tensors are held at a time."""
        pending: dict[str, torch.Tensor] = {}
        for name, t in stream_full_tensors(model):
            prefix, _, leaf = name.partition(".base_layer.")
            if leaf:  # the frozen linear's own weight or bias
                if leaf == "weight":
                    pending[prefix] = t
                else:
                    yield f"{prefix}.{leaf}", t.to(dtype) if dtype is not None else t
                continue
            for part in (f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"):
                if name.endswith(part):
                    prefix = name[: -len(part)]
                    pending[prefix + part] = t
                    a, b = pending.get(prefix + f".lora_A.{ADAPTER}.weight"), pending.get(prefix + f".lora_B.{ADAPTER}.weight")
                    if a is not None and b is not None:
                        scaling = model.get_submodule(prefix).scaling[ADAPTER]
                        w = pending.pop(prefix).float() + scaling * (b.float() @ a.float())
                        del pending[prefix + f".lora_A.{ADAPTER}.weight"], pending[prefix + f".lora_B.{ADAPTER}.weight"]
                        yield f"{prefix}.weight", w.to(dtype or t.dtype)
                    break
            else:
                yield name, t.to(dtype) if dtype is not None else t
        if pending:
            raise RuntimeError(f"LoRA layers without both adapter matrices in the state dict: {sorted(pending)[:3]}")

    @contextmanager
    def base_only(self, model: nn.Module) -> Iterator[None]:
        """The frozen base: every adapter switched off for the block (the LoRA run's reference)."""
        layers = [m for m in model.modules() if _is_lora_layer(m)]
        for m in layers:
            m.enable_adapters(False)
        try:
            yield
        finally:
            for m in layers:
                m.enable_adapters(True)


def parameter_set(cfg: LoRAConfig) -> ParameterSet:
    return LoRA(cfg) if cfg.enabled else ParameterSet()


def _is_lora_layer(m: nn.Module) -> bool:
    # PEFT's LoRA layers carry their adapters in ``lora_A``; duck-typed so that importing this
    # module does not import PEFT
    return hasattr(m, "lora_A") and hasattr(m, "enable_adapters")
