"""Supervised fine-tuning batches (``fitrl sft``): each prompt followed by its target, the rows'
answer column as text, ending with the token that ends a response (so the warm-started policy
stops where the rollout stops it).

The batch has the rollout's layout (fitrl/rollout/layout.py): left-padded prompts, right-padded
responses, ``response_mask`` over the target tokens, so the actor's micro-batching, log-prob
chunks and FSDP2 passes serve supervised steps unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from fitrl.core.padding import left_pad, right_pad
from fitrl.data.batch import Batch


def target_text(answer: Any) -> str:
    """The target of a row: its answer column as text (a number as it prints: 8, 2.5)."""
    return answer if isinstance(answer, str) else str(answer)


def target_ids(answers: list[Any], tokenizer: Any, end_id: int, max_length: int) -> list[list[int]]:
    """Each answer's token ids and ``end_id``, cut to ``max_length`` tokens (a target cut short
    loses its end token, as a response at the length limit does)."""
    encoded = tokenizer([target_text(a) for a in answers], add_special_tokens=False)["input_ids"]
    return [(list(ids) + [end_id])[:max_length] for ids in encoded]


def supervised_batch(prompts: Batch, targets: list[list[int]], pad_id: int) -> Batch:
    """``prompts`` (a dataset batch: ``prompt_ids`` per row) with ``targets`` as their responses:
    ``input_ids`` / ``attention_mask`` (B, P+R), ``responses`` / ``response_mask`` (B, R); the
    prompts' fields are kept (a vision-language row's images travel with it)."""
    prompt_ids, prompt_mask = left_pad(prompts["prompt_ids"], pad_id, max(len(p) for p in prompts["prompt_ids"]))
    responses, response_mask = right_pad(targets, pad_id, max(len(t) for t in targets))
    return Batch(tensors={"input_ids": torch.cat([prompt_ids, responses], 1),
                          "attention_mask": torch.cat([prompt_mask, response_mask], 1),
                          "responses": responses, "response_mask": response_mask},
                 fields=dict(prompts.fields), meta=dict(prompts.meta))
