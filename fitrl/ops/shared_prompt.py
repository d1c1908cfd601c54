"""One forward of a shared prompt for every response that follows it (``actor.share_prompts``).

A GRPO step samples ``n`` responses per prompt, so a micro-batch of consecutive rows holds each
prompt up to ``n`` times, and a plain forward runs every copy through every layer: with 23-token
prompts and 32-token responses, 42 % of an update's tokens. Here the forward is split in two
passes of the model's own forward:

1. the micro-batch's distinct prompts, one row each, ``(G, P)``, fill a KV cache
   (``DynamicCache``, autograd on);
2. the cache's rows are repeated for the rows that share them (``index_select``: its backward
   sums the rows' gradients into their prompt's, as the plain forward's weight gradients sum
   over the copies) and the ``(B, R)`` responses run on it, as a prefill continues.

Every response token sees exactly the keys and values it sees in the plain forward, so log-probs
and gradients agree to rounding (tests/test_shared_prompt.py). The prompt's last position
predicts each row's first response token: its hidden state comes from pass 1.

Not for: vision-language inputs (the prompt's images and multimodal positions), sliding-window
attention (its cache layers crop), and gradient checkpointing in training (a checkpointed layer
recomputed in backward would append to the cache again). :func:`can_share` says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from transformers import DynamicCache

from fitrl.core.padding import model_positions
from fitrl.ops.sharing import SKIPPED_PROMPTS, full_attention


@dataclass(frozen=True)
class PromptGroups:
    """``rows`` (G,): one row holding each distinct prompt; ``inverse`` (B,): each row's group."""
    rows: torch.Tensor
    inverse: torch.Tensor

    @property
    def shared(self) -> bool:
        """Does any prompt occur twice (else the split forward only adds work)?"""
        return self.rows.numel() < self.inverse.numel()

    def record_skipped(self, attention_mask: torch.Tensor, prompt_len: int) -> None:
        """Note the prompt copies a pass sharing these groups does not run (their token counts:
        one host sync per micro-batch, after ``find_prompt_groups``' own) for ``perf/*``."""
        skipped = torch.ones(self.inverse.numel(), dtype=torch.bool, device=self.inverse.device)
        skipped[self.rows] = False
        SKIPPED_PROMPTS.record(attention_mask[skipped, :prompt_len].sum(-1).tolist())


def find_prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> PromptGroups:
    """Rows with the same prompt (ids and padding of the first ``prompt_len`` columns) form a group."""
    mask = attention_mask[:, :prompt_len].long()
    key = torch.cat([input_ids[:, :prompt_len] * mask, mask], dim=1)  # pad ids never count
    _, inverse = torch.unique(key, dim=0, return_inverse=True)  # (B,)
    B = inverse.numel()
    groups = int(inverse.max()) + 1 if B else 0
    rows = torch.full((groups,), B, dtype=torch.long, device=inverse.device)
    rows.scatter_reduce_(0, inverse, torch.arange(B, device=inverse.device), "amin")  # first row of each
    return PromptGroups(rows, inverse)


def can_share(model: torch.nn.Module, position_ids: torch.Tensor, model_kwargs: Optional[dict]) -> bool:
    """Can :func:`shared_prompt_forward` run this model's forward (see the module docstring)?"""
    if model_kwargs or position_ids.dim() != 2:  # images, multimodal rope
        return False
    if model.training and _checkpointed(model):
        return False
    return full_attention(vars(model.config))  # the attributes config.json's keys became


def _checkpointed(model: torch.nn.Module) -> bool:
    """Activation checkpointing on (transformers 5 renamed the flag; the old name warns)?"""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if flag is None else flag)


def shared_prompt_forward(model: torch.nn.Module, head: torch.nn.Module,
                          head_fn: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor,
                          attention_mask: torch.Tensor, position_ids: torch.Tensor, response_length: int,
                          groups: PromptGroups) -> torch.Tensor:
    """The model's output over the responses, from two passes (the module docstring).

    ``head`` is the model's output embedding; for the call it is ``head_fn``, which takes the
    (B, R, H) hidden states that predict the R response tokens. input_ids (B, P+R) as
    :func:`fitrl.ops.logprob.response_logprobs` has them (padding trimmed).
    """
    R = response_length
    P = input_ids.shape[1] - R
    rows, inverse = groups.rows, groups.inverse
    last: dict[str, torch.Tensor] = {}

    def keep_last(hidden: torch.Tensor) -> torch.Tensor:  # (G, 1, H): predicts each row's first token
        last["hidden"] = hidden
        return hidden.new_zeros(hidden.shape[:-1])  # the pass's output: not a view of what the next uses

    def response_head(hidden: torch.Tensor) -> torch.Tensor:  # (B, R, H): position t predicts t + 1
        return head_fn(torch.cat([last.pop("hidden").index_select(0, inverse), hidden[:, :-1]], dim=1))

    cache = DynamicCache()
    head.forward = keep_last  # an instance attribute shadows nn.Linear.forward
    try:
        model(input_ids=input_ids[rows, :P], attention_mask=attention_mask[rows, :P],
              position_ids=model_positions(position_ids[rows, :P]), past_key_values=cache, use_cache=True,
              logits_to_keep=1)
        for layer in cache.layers:  # (G, heads, P, d) -> (B, heads, P, d)
            layer.keys = layer.keys.index_select(0, inverse)
            layer.values = layer.values.index_select(0, inverse)
        head.forward = response_head
        return model(input_ids=input_ids[:, P:], attention_mask=attention_mask,
                     position_ids=model_positions(position_ids[:, P:]), past_key_values=cache, use_cache=True,
                     logits_to_keep=R).logits
    finally:
        del head.forward
