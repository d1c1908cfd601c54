"""The model-family interface and its registry.

A family knows, for the checkpoints it claims (by ``config.json``'s ``model_type``):

- how to build its models: ``"causal_lm"`` (the policy and the reference: next-token logits)
  and ``"value"`` (the critic: one value per token, a token-classification head);
- which blocks become FSDP units (decoder layers; a vision-language family adds vision blocks);
- how to compute position ids and any extra model inputs for a batch (a causal LM counts real
  tokens; a Qwen-VL family computes multimodal rope indices from the image grid).

Families are stateless singletons registered in :data:`MODEL_FAMILIES`;
:func:`fitrl.models.families.family_for` picks one for a checkpoint.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from fitrl.config.schema import ModelConfig
from fitrl.core.registry import Registry

HEADS = ("causal_lm", "value")
"""What :meth:`ModelFamily.builders` can build: ``causal_lm`` (policy, reference), ``value`` (critic)."""

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

    @abstractmethod
    def position_ids(self, attention_mask: torch.Tensor, *, input_ids: Optional[torch.Tensor] = None,
                     **extra: Any) -> torch.Tensor:
        """Position ids for a (B, T) batch from its attention mask; a multimodal rope also reads
        ``input_ids`` and ``extra`` (the batch's other model inputs, what :meth:`extra_inputs`
        returns). A text family needs the mask only, so ``family.position_ids`` also serves where
        a ``mask -> positions`` function is expected."""

    def extra_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Model inputs beyond ids, mask and positions (pixel values, image grids), read from a
        batch's fields; none by default."""
        return {}

    def __repr__(self) -> str:
        return f"<model family {self.name!r}>"


MODEL_FAMILIES: Registry[ModelFamily] = Registry("model family", "actor.model.family")
