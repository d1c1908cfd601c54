"""A reward model's forward: padded token lists and the score at each sequence's last token."""

from __future__ import annotations

import torch


def right_padded(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of token lists padded on the right: positions count real tokens as unpadded."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask


def left_padded(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) padded on the left, as ``generate`` continues every row from the last column."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


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
