"""The column layout of prompt+response batches, and the helpers every engine and role share.

``input_ids``/``attention_mask``/``position_ids`` are (B, P+R): a left-padded prompt of width P
then a right-padded response of width R (``position_ids`` is (B, k, P+R) for a k-axis multimodal
rope); ``responses``/``response_mask`` are (B, R).
"""

from __future__ import annotations

import torch


def left_pad(sequences: list[list[int]], pad_id: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, width) ids and mask with each sequence right-aligned (prompts for batched generation)."""
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq):] = 1
    return ids, mask


def right_pad(sequences: list[list[int]], pad_id: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, width) ids and mask with each sequence left-aligned (responses; a reward model's rows,
    whose positions then count real tokens as unpadded)."""
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[i, :len(seq)] = 1
    return ids, mask


def pad_right(t: torch.Tensor, width: int, value) -> torch.Tensor:
    """(B, w) -> (B, width), filling the new columns with ``value``."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def first_eos_mask(responses: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """(B, R) -> 1 up to and including the first EOS (works when pad == eos too)."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    eos_before = is_eos.long().cumsum(-1) - is_eos.long()  # EOS strictly before position t
    return (eos_before == 0).long()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens, as HF ``generate`` does for left-padded prompts."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)


def trim_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 response_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Drop the columns that are padding in every row of a micro-batch: leading prompt padding
    (left) and trailing response padding (right). Works for every model, unlike packing.

    Returns the trimmed (ids, mask, positions) and the kept response width R' <= R. Results for
    the kept columns are unchanged: removed left columns were masked out, removed right columns
    come after every real token (causal attention).
    """
    R = response_length
    real_cols = attention_mask.any(dim=0)  # (P+R,)
    left = int(real_cols[: attention_mask.shape[1] - R].long().argmax()) if real_cols.any() else 0
    resp = attention_mask[:, -R:].any(dim=0)
    keep_r = int(resp.nonzero().max()) + 1 if resp.any() else 1
    right = attention_mask.shape[1] - (R - keep_r)
    return input_ids[:, left:right], attention_mask[:, left:right], position_ids[..., left:right], keep_r


def model_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """The batch's positions as the model's forward takes them: (B, T) as they are; a multimodal
    rope's (B, k, T) (kept batch-first so a batch splits on dim 0) as (k, B, T)."""
    return position_ids.transpose(0, 1) if position_ids.dim() == 3 else position_ids
