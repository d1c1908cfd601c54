"""The column layout of a rollout batch, and joining rollouts made by separate generate calls.

``input_ids``/``attention_mask``/``position_ids`` are (B, P+R): a left-padded prompt of width P
then a right-padded response of width R; ``responses``/``response_mask``/``rollout_logprobs``
are (B, R), a mixture of experts' optional ``routed_experts`` (B, R, layers, k). Each generate
call (each DAPO round, each data-parallel rank) picks its own P and R.
"""

from __future__ import annotations

from typing import Optional

import torch

from fitrl.core.padding import first_eos_mask, pad_right
from fitrl.data.batch import Batch
from fitrl.models.families.base import ModelInputs
from fitrl.models.moe_routing import ROUTED_EXPERTS, pad_routed

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
            prompt, resp = tensors[k][..., :p], tensors[k][..., p:]  # (B, [k,] P+R): a multimodal rope's 3 axes
            tensors[k] = torch.cat([torch.nn.functional.pad(prompt, (prompt_w - p, 0), value=fill),
                                    torch.nn.functional.pad(resp, (0, resp_w - r), value=fill)], dim=-1)
        for k in RESPONSE_WIDTH:
            fill = pad_id if k == "responses" else 0
            tensors[k] = torch.nn.functional.pad(tensors[k], (0, resp_w - r), value=fill)
        if ROUTED_EXPERTS in tensors:  # (B, R, layers, k): a MoE's recorded experts
            tensors[ROUTED_EXPERTS] = pad_routed(tensors[ROUTED_EXPERTS], resp_w)
        out.append(Batch(tensors, b.fields, b.meta))
    return Batch.concat(out)



def gather_rollouts(results: list[Batch]) -> Batch:
    """Joins the rollouts of data-parallel ranks (each generated to its own widths)."""
    return concat_rollouts(results, pad_id=results[0].meta.get("pad_id", 0))


def assemble_rollout(prompts: Batch, seqs: Batch, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                     responses: list[torch.Tensor], logprobs: list[torch.Tensor], *, eos_ids: list[int], pad_id: int,
                     inputs: ModelInputs, tokenizer, routed_experts: Optional[list[torch.Tensor]] = None) -> Batch:
    """The rollout batch of :mod:`fitrl.rollout.engine` from an engine's raw output.

    ``seqs``: the prompts' fields repeated n times (one row per sequence); ``prompt_ids`` /
    ``prompt_mask``: (B, P) left-padded; ``responses`` / ``logprobs``: chunks of (b, r) rows in
    sequence order, each chunk padded to its own width r (any EOS-ended tail after the first EOS
    is masked out here). ``routed_experts``: a MoE's chunks of (b, r, layers, k) experts per
    sampled token (fitrl/models/moe_routing.py), the optional ``routed_experts`` column, -1 where
    the response mask is 0."""
    device = prompt_ids.device
    resp_len = max(r.shape[1] for r in responses)
    responses = torch.cat([pad_right(r.to(device), resp_len, pad_id) for r in responses])
    logprobs = torch.cat([pad_right(lp.to(device), resp_len, 0.0) for lp in logprobs])
    response_mask = first_eos_mask(responses, eos_ids)
    finished = torch.isin(responses, torch.tensor(eos_ids, device=device)).any(-1).long()
    out = rollout_batch(prompts, seqs, prompt_ids, prompt_mask, responses, response_mask, response_mask, finished,
                        logprobs, pad_id=pad_id, inputs=inputs)
    out.fields["response_text"] = decode_responses(tokenizer, responses, response_mask, eos_ids)
    if routed_experts is not None:
        routed = torch.cat([pad_routed(x.to(device), resp_len) for x in routed_experts])
        out.tensors[ROUTED_EXPERTS] = routed.masked_fill(~response_mask.bool()[:, :, None, None], -1)
    return out


def rollout_batch(prompts: Batch, seqs: Batch, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                  responses: torch.Tensor, response_attention: torch.Tensor, response_mask: torch.Tensor,
                  finished: torch.Tensor, logprobs: torch.Tensor, *, pad_id: int, inputs: ModelInputs) -> Batch:
    """The rollout layout (this module's docstring) from its parts: (B, P) left-padded prompts and
    (B, R) responses with ``response_attention`` (1: a real token, attended) and ``response_mask``
    (1: a token the loss counts; an engine's are the real tokens, an agent's only the model's own,
    fitrl/rollout/agent.py), ``finished`` (B,) and the engine's ``logprobs`` (B, R), masked here.
    Fields: ``seqs``'s (one row per sequence); meta: ``prompts``'s and ``pad_id``."""
    input_ids = torch.cat([prompt_ids, responses], dim=1)
    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
    return Batch(
        tensors={
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": inputs.positions(input_ids, attention_mask, seqs),
            "responses": responses,
            "response_mask": response_mask,
            "finished": finished,
            "rollout_logprobs": logprobs * response_mask,
        },
        fields=dict(seqs.fields),
        meta={**prompts.meta, "pad_id": pad_id},
    )


def decode_responses(tokenizer, responses: torch.Tensor, response_mask: torch.Tensor, eos: list[int]) -> list[str]:
    """Response text without the EOS and padding."""
    stop = set(eos)
    return [tokenizer.decode([t for t, keep in zip(row, m) if keep and t not in stop], skip_special_tokens=True)
            for row, m in zip(responses.tolist(), response_mask.tolist())]


def eos_ids(model, tokenizer) -> list[int]:
    """The ids that end a response: the model's generation config's, then the tokenizer's."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        for i in source if isinstance(source, (list, tuple)) else [source]:
            if i not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("the tokenizer and generation_config define no EOS token: generation could never stop")
    return ids
