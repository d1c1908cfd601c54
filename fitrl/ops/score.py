"""A reward model's forward: the score at each right-padded sequence's last token."""

from __future__ import annotations

import torch


def last_token_scores(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) float32: the score head's output at each right-padded row's last real token. The
    head's per-token output is read by a hook, not through the model's own pooling, which finds
    the last token by the pad id and so misses a sequence that ends in a token equal to it."""
    head = getattr(model, "score", None)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no 'score' head: fitrl reads reward models whose "
                         f"sequence-classification head is named score (Qwen2, Llama, Mistral, Gemma, ...)")
    seen: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        handle.remove()
    per_token = seen[-1]  # (B, T, 1)
    last = mask.sum(-1) - 1
    return per_token[torch.arange(len(ids), device=ids.device), last, 0].float()
