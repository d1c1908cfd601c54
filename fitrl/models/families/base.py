"""The model-family interface and its registry.

A family knows, for the checkpoints it claims (by ``config.json``'s ``model_type``):

- how to build its models: ``"causal_lm"`` (the policy and the reference: next-token logits)
  and ``"value"`` (the critic: one value per token, a token-classification head);
- which blocks become FSDP units (decoder layers; a vision-language family adds vision blocks);
- what a model instance takes besides ids and mask (:class:`ModelInputs`: position ids and extra
  inputs; a causal LM counts real tokens, a Qwen-VL family computes multimodal rope indices from
  the image grids and passes the pixel values);
- its text decoder, per model type it claims (:class:`fitrl.models.decoder.DecoderLayout`: the
  layers' tensors, the KV cache and FLOPs per token, dense or mixture of experts), what the memory
  plan and the FLOP counter read;
- for a vision-language family, its vision tower (tensors, FLOPs, image geometry: what the memory
  plan and the FLOP counter read) and its media processing (what the data path and the engines
  call), each from the model directory.

Families are stateless singletons registered in :data:`MODEL_FAMILIES`;
:func:`fitrl.models.families.family_for` picks one for a checkpoint.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from fitrl.config.schema import ModelConfig
from fitrl.core.padding import position_ids_from_mask
from fitrl.core.registry import Registry
from fitrl.data.media import MediaSpec
from fitrl.models.decoder import DecoderLayout
from fitrl.models.vision import VisionTower

HEADS = ("causal_lm", "value", "reward")
"""What :meth:`ModelFamily.builders` can build: ``causal_lm`` (policy, reference, judge), ``value``
(critic), ``reward`` (a reward model: one score per sequence)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``actor.model.dtype`` names to torch dtypes."""

Builder = Callable[[], nn.Module]


class ModelFamily(ABC):
    """How fitrl builds, shards and feeds the models of one architecture family."""

    name: str = ""
    model_types: frozenset[str] = frozenset()
    """``config.json`` ``model_type`` values this family claims (``causal_lm`` takes all others)."""

    @abstractmethod
    def builders(self, head: str, model: ModelConfig) -> tuple[Builder, Builder]:
        """``(from_pretrained, from_config)`` for ``head`` (one of :data:`HEADS`): the first reads
        the checkpoint's weights, the second only builds the architecture (called under
        ``torch.device("meta")`` by ranks that receive rank 0's weights)."""

    @abstractmethod
    def blocks_to_shard(self, model: nn.Module) -> list[nn.Module]:
        """The blocks that each become one FSDP unit (the root is wrapped after them)."""

    def inputs_for(self, model: nn.Module) -> "ModelInputs":
        """What this model instance takes besides ids and mask: its positions and extra inputs
        (a vision-language model's image tensors). Text families: :data:`TEXT_INPUTS`."""
        return TEXT_INPUTS

    def decoder_layout(self, model_type: str) -> Optional[DecoderLayout]:
        """The text decoder of ``model_type`` (a row of fitrl/core/model_types.py this family
        claims), of the row's kind: what the memory plan and the FLOP counter size from
        ``config.json``. None: this family describes none, so the planner refuses the type
        (fitrl/trainer/complete.py reports it)."""
        return None

    def vision_tower(self, config: dict[str, Any]) -> Optional[VisionTower]:
        """The vision tower of a ``config.json`` (as a dict) this family claims: its tensors, FLOPs
        and image geometry, for the memory plan and the FLOP counter. Text families: None; a
        vision-language family must describe it (fitrl/trainer/complete.py checks)."""
        return None

    def media_spec(self, model_path: str | Path) -> Optional[MediaSpec]:
        """How the data path and the engines turn a row's images into this model's inputs
        (:class:`fitrl.data.media.MediaSpec`), read from the model directory. Text families: None."""
        return None

    def __repr__(self) -> str:
        return f"<model family {self.name!r}>"


class ModelInputs:
    """The inputs of one model instance beyond ids and mask, for a rollout batch (or a slice of
    one): what the rollout engine, the actor, the reference and the critic all feed the model.

    The text version: positions count real tokens (as HF ``generate`` does for left-padded
    prompts) and there is nothing else. ``batch`` is anything with ``in`` and ``[]`` over field
    names (a :class:`~fitrl.data.batch.Batch`)."""

    never_generate: tuple[int, ...] = ()
    """Token ids the rollout never samples (a Qwen-VL model's image/video pads and vision markers:
    one in a response would be taken for an image the sample does not have)."""

    def positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  batch: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
        """(B, T) positions, or (B, k, T) for a k-axis rotary embedding, of whole sequences."""
        return position_ids_from_mask(attention_mask)

    def extra(self, batch: Optional[Mapping[str, Any]], device: torch.device) -> dict[str, torch.Tensor]:
        """Extra keyword inputs of a forward over ``batch``'s samples, on ``device``."""
        return {}

    def generate_extra(self, input_ids: torch.Tensor, batch: Optional[Mapping[str, Any]],
                       device: torch.device) -> dict[str, torch.Tensor]:
        """Extra keyword inputs of ``generate`` for the prompts ``input_ids`` of ``batch``."""
        return self.extra(batch, device)


TEXT_INPUTS = ModelInputs()


def auto_builders(auto_class: str, model: ModelConfig, **config_kwargs: Any) -> tuple[Builder, Builder]:
    """``(from_pretrained, from_config)`` through the transformers auto class named ``auto_class``
    (``AutoModelForCausalLM``, ``AutoModelForImageTextToText``, ...), in ``model.dtype`` with its
    attention kernel; ``config_kwargs`` change the loaded config (a value head's ``num_labels``).
    transformers is imported here: importing the family registry stays cheap."""
    import transformers

    cls = getattr(transformers, auto_class)
    kwargs = dict(dtype=DTYPES[model.dtype], attn_implementation=model.attn_implementation)

    def from_pretrained() -> nn.Module:
        return cls.from_pretrained(model.path, local_files_only=True, **config_kwargs, **kwargs)

    def from_config() -> nn.Module:
        config = transformers.AutoConfig.from_pretrained(model.path, local_files_only=True, **config_kwargs)
        return cls.from_config(config, **kwargs)
    return from_pretrained, from_config


MODEL_FAMILIES: Registry[ModelFamily] = Registry("model family", "actor.model.family")
