"""Token-by-token decoding on the model's own forward with a KV cache: ``rollout.decode=loop``.

HF ``generate`` keeps every row of a micro-batch in the forward until the last one ends,
routes each step through its logits processors and stopping criteria, and draws with
``torch.multinomial``. :func:`decode_loop` instead

* drops finished rows from the batch and from the KV cache, so the forward shrinks as
  sequences end (with GRPO's spread of response lengths the tail of a micro-batch is a few long
  answers);
* computes logits for the last position only (``logits_to_keep=1``, the prefill included);
* prefills each distinct prompt once (a GRPO group's n samples share theirs) and copies its
  keys and values to the rows that share it;
* runs the sampling math of :func:`sample_step` directly, the one function that HF
  ``generate``'s :class:`~fitrl.rollout.hf.SampleAndRecord` calls too, so the two paths cannot
  drift, and draws by inverse CDF (:func:`draw`: 20x cheaper than ``torch.multinomial`` on CPU).

The KV cache is transformers' ``StaticCache`` (sized prompt + ``max_tokens``, written in place),
measured faster than ``DynamicCache`` (which concatenates every layer's keys and values each
step) on CPU: on the 32M ``small`` qwen2, 64 rows x 64 tokens on one thread, 9.7 against 11.1
CPU seconds; the same on the 0.16M ``tiny``. Its attention spans the whole preallocated length (masked),
which costs less than the copies at these lengths.

Outputs are what the ``generate`` path returns: (B, R) responses right-padded with the pad id
after each row's EOS, and (B, R) log-probs of the sampled tokens (0 after EOS), R the number
of steps until every row ended, at most ``max_tokens``. Greedy decoding equals ``generate``'s
token for token; sampling draws from the same distribution but not the same tokens under one
seed (other random numbers, and fewer of them once rows leave).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from fitrl.config.schema import SamplingConfig
from fitrl.core.errors import Diverged
from fitrl.core.padding import first_eos_mask, position_ids_from_mask
from fitrl.ops.shared_prompt import find_prompt_groups
from fitrl.ops.token_origin import ORIGINS
from fitrl.rollout.engine import GENERATION


def sample_step(logits: torch.Tensor, sampling: SamplingConfig, eos_ids: Sequence[int] = (),
                never_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's sampling math: logits (B, V) -> ``(scores, logprobs, nonfinite)``.

    ``logprobs`` (B, V) fp32: the log-softmax of the tempered logits *before* any masking or
    truncation, what the trainer recomputes (as veRL does). ``scores`` (B, V) fp32: what
    :func:`draw` samples from: EOS masked under ``ignore_eos``, ``never_ids`` masked (a Qwen-VL
    model's image pads), then top-k and top-p (not for greedy decoding). ``nonfinite`` () bool on
    the logits' device, no sync: a NaN or +inf logit was seen (diverged or corrupt weights); it is
    replaced by 0 so that the sampler does not fail (a device assert on a GPU), and the caller
    raises :class:`Diverged` at the end (:func:`raise_if_nonfinite`).
    """
    s = sampling
    scores = logits.float()
    bad = ~(scores < float("inf"))
    nonfinite = bad.any()
    scores = scores.masked_fill(bad, 0.0)  # a fresh tensor: masked in place below
    if not s.greedy and s.temperature != 1.0:
        scores = scores / s.temperature
    logprobs = torch.log_softmax(scores, dim=-1)
    if s.ignore_eos and eos_ids:
        scores[:, list(eos_ids)] = float("-inf")
    if never_ids:  # after the record, like ignore_eos: log-probs stay the full distribution's
        scores[:, list(never_ids)] = float("-inf")
    if s.greedy:
        return scores, logprobs, nonfinite
    if 0 < s.top_k < scores.shape[-1]:
        kth = torch.topk(scores, s.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        probs = torch.softmax(sorted_scores, dim=-1)
        # drop tokens once the mass *before* them already reaches top_p (always keep the first)
        drop_sorted = (probs.cumsum(-1) - probs) >= s.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores, logprobs, nonfinite


def draw(scores: torch.Tensor, greedy: bool) -> torch.Tensor:
    """(B, V) scores from :func:`sample_step` -> (B,) tokens: the argmax when greedy, else one
    draw from ``softmax(scores)``, the distribution HF ``generate`` samples.

    By inverse CDF (one uniform per row against the fp64 cumulative probabilities) rather than
    ``torch.multinomial``, whose single draw is an exponential race costing one random number
    per vocabulary entry: (64, 8192) takes 0.8 ms instead of 15 ms on one CPU thread. fp64 keeps
    the tail exact: in fp32 the cumulative sum near 1 moves in steps of 6e-8, so tokens rarer than
    that would be drawn as 0 or 6e-8. A token of probability 0 (masked: -inf) is never drawn:
    ``u < cdf[-1]`` (a double below 1 times the total stays below it) and the first entry above
    ``u`` is one where the sum grew.
    """
    if greedy:
        return scores.argmax(dim=-1)
    cdf = torch.softmax(scores, dim=-1).double().cumsum(dim=-1)  # (B, V)
    u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]  # (B, 1) in [0, total)
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def raise_if_nonfinite(nonfinite) -> None:
    """Raise :class:`Diverged` when :func:`sample_step` saw a NaN or infinite logit (one sync)."""
    if nonfinite is not None and bool(nonfinite):
        raise Diverged("the policy's logits hold NaN or infinity during generation: its weights have diverged "
                       "(a learning rate too high: actor.optim.lr) or the weights it loaded are corrupt")


def loop_unsupported(model: torch.nn.Module) -> Optional[str]:
    """Why :func:`decode_loop` cannot decode for ``model`` (None: it can): a vision-language
    model (its prefill takes images and a multimodal rope), or attention layers other than full
    attention (sliding windows, linear attention: their cache state is not a plain per-row K/V)."""
    config = model.config
    if getattr(config, "vision_config", None) is not None:
        return "a vision-language model"
    layers = StaticCache(config=config, max_cache_len=1).layers  # allocates nothing until the first update
    if not all(type(layer) is StaticLayer for layer in layers):
        return "attention layers other than full attention"
    return None


class _OwnDtypeLayer(StaticLayer):
    """A ``StaticLayer`` whose value buffer takes the values' dtype. ``StaticLayer`` allocates
    its values in the keys' dtype; under bf16 autocast they differ: the keys leave the rotary
    embedding in fp32 (its cos and sin follow the fp32 residual stream), the values leave a bf16
    projection. Each value buffer takes the values' own dtype, as ``generate``'s ``DynamicCache``
    keeps them (the planner charges 4 + 2 bytes per element pair: fitrl/rollout/hf_plan.py,
    ``_generation``).

    A subclass, not a function stored on each layer: a closure over its own layer is a
    reference cycle, which left every rollout's whole KV cache alive until Python's next full
    collection (the cyclic collector's oldest generation runs rarely in a process holding torch):
    one more cache per step, into the update (tests/test_decode.py)."""

    def lazy_initialization(self, key_states, value_states, *args, **kwargs):
        super().lazy_initialization(key_states, value_states, *args, **kwargs)
        if self.values.dtype != value_states.dtype:
            self.values = torch.zeros_like(self.values, dtype=value_states.dtype)


def _values_in_their_own_dtype(cache: StaticCache) -> StaticCache:
    """Every full-attention layer of ``cache`` keeps its values in their own dtype
    (:class:`_OwnDtypeLayer`); the layers allocate nothing until the first update."""
    for layer in cache.layers:
        if type(layer) is StaticLayer:
            layer.__class__ = _OwnDtypeLayer
    return cache


def _keep_rows(cache: StaticCache, rows: torch.Tensor) -> None:
    """Keep only ``rows`` of every layer's (b, heads, length, head_dim) keys and values. Layer by
    layer, so the copy held beside the cache at any time is one layer's."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
            layer.batch_size = rows.numel()


@torch.no_grad()
def decode_loop(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                sampling: SamplingConfig, *, eos_ids: Sequence[int], pad_id: int,
                never_ids: Sequence[int] = (), check_every: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``sampling.max_tokens`` tokens after each left-padded prompt.

    input_ids, attention_mask (B, P) -> responses (B, R) long, logprobs (B, R) fp32. Positions
    count real tokens (:func:`~fitrl.core.padding.position_ids_from_mask`), as ``generate`` and
    the trainer count them. ``check_every``: steps between looks at which rows have ended (each
    look is one host sync; the rows that ended leave the batch there). 0: every step on CPU,
    where a look costs nothing, every 8 on an accelerator, where a finished row decoding up to
    7 more pad tokens costs less than a stall per token.
    """
    device = input_ids.device
    B, P = input_ids.shape
    T = sampling.max_tokens
    if check_every <= 0:
        check_every = 1 if device.type == "cpu" else 8
    eos = torch.tensor(list(eos_ids), device=device)
    responses = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, T, dtype=torch.float32, device=device)
    rows = torch.arange(B, device=device)  # (b,) the output row of each row still in the batch
    # the whole mask up front, future columns included: step t's is a view of its first P + t + 1
    mask = torch.cat([attention_mask.long(), attention_mask.new_ones(B, T, dtype=torch.long)], dim=1)  # (B, P+T)
    positions = position_ids_from_mask(attention_mask)  # (B, P)
    next_pos = positions[:, -1:] + 1  # (b, 1)
    done = torch.zeros(B, dtype=torch.bool, device=device)  # (b,) ended, in the batch until the next look
    cache = _values_in_their_own_dtype(StaticCache(config=model.config, max_cache_len=P + T))
    nonfinite = None
    # a group's n samples share their prompt: each distinct prompt is prefilled once, and its
    # keys and values are copied to the rows that share it (the same per-row values)
    groups = find_prompt_groups(input_ids, attention_mask, P)
    first = groups.rows if groups.shared else slice(None)
    # logits of the last position only: (b, V), never (b, P, V) for the prompt
    logits = model(input_ids=input_ids[first], attention_mask=attention_mask[first], position_ids=positions[first],
                   past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    if groups.shared:
        groups.record_skipped(attention_mask, P)
        _keep_rows(cache, groups.inverse)
        logits = logits.index_select(0, groups.inverse)
    # each step a heartbeat, and a (time-limited, local) guard reading: within a long
    # micro-batch the KV cache grows token by token, and this stops it before the OS does
    for t in GENERATION.steps(range(T)):
        scores, logp, seen = sample_step(logits, sampling, eos_ids, never_ids)
        nonfinite = seen if nonfinite is None else nonfinite | seen
        tokens = draw(scores, sampling.greedy).masked_fill(done, pad_id)  # (b,) ended rows: pad, as generate
        responses[rows, t] = tokens
        logprobs[rows, t] = logp.gather(-1, tokens[:, None]).squeeze(-1).masked_fill(done, 0.0)
        done = done | torch.isin(tokens, eos)
        if t + 1 == T:
            break
        if (t + 1) % check_every == 0:
            live = (~done).nonzero().squeeze(1)  # the look: one sync
            if live.numel() == 0:
                break
            if live.numel() < rows.numel():  # the rows that ended leave the batch and the cache
                rows, tokens, mask, next_pos, done = rows[live], tokens[live], mask[live], next_pos[live], done[live]
                _keep_rows(cache, live)
        if ORIGINS.listening:  # this call runs token t of the rows left (a MoE's recorded routing: fitrl/rollout/hf.py)
            ORIGINS.feed((rows * T + t)[:, None])
        logits = model(input_ids=tokens[:, None], attention_mask=mask[:, :P + t + 1], position_ids=next_pos,
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        next_pos = next_pos + 1
    raise_if_nonfinite(nonfinite)
    # R: up to the last row's EOS (a look every few steps can leave columns of padding only)
    width = int(first_eos_mask(responses, list(eos_ids)).sum(1).max()) if B else 0
    return responses[:, :width], logprobs[:, :width]
