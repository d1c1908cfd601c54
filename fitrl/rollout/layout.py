"""The column layout of a rollout batch, and joining rollouts made by separate generate calls.

``input_ids``/``attention_mask``/``position_ids`` are (B, P+R): a left-padded prompt of width P
then a right-padded response of width R; ``responses``/``response_mask``/``rollout_logprobs``
are (B, R). Each generate call (each DAPO round, each data-parallel rank) picks its own P and R.
"""

from __future__ import annotations

import torch

from fitrl.data.batch import Batch

FULL_WIDTH = ("input_ids", "attention_mask", "position_ids")
RESPONSE_WIDTH = ("responses", "response_mask", "rollout_logprobs")


def concat_rollouts(batches: list[Batch], pad_id: int = 0) -> Batch:
    """Concatenate rollouts from separate generate calls, whose prompt width P and response
    width R differ: prompts are left-padded and responses right-padded to the widest."""
    if len(batches) == 1:
        return batches[0]
    resp_w = max(b["responses"].shape[1] for b in batches)
    prompt_w = max(b["input_ids"].shape[1] - b["responses"].shape[1] for b in batches)
    out = []
    for b in batches:
        r = b["responses"].shape[1]
        p = b["input_ids"].shape[1] - r
        tensors = dict(b.tensors)
        for k in FULL_WIDTH:
            fill = pad_id if k == "input_ids" else 0
            prompt, resp = tensors[k][:, :p], tensors[k][:, p:]
            tensors[k] = torch.cat([torch.nn.functional.pad(prompt, (prompt_w - p, 0), value=fill),
                                    torch.nn.functional.pad(resp, (0, resp_w - r), value=fill)], dim=1)
        for k in RESPONSE_WIDTH:
            fill = pad_id if k == "responses" else 0
            tensors[k] = torch.nn.functional.pad(tensors[k], (0, resp_w - r), value=fill)
        out.append(Batch(tensors, b.fields, b.meta))
    return Batch.concat(out)


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
    return input_ids[:, left:right], attention_mask[:, left:right], position_ids[:, left:right], keep_r
