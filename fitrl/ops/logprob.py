"""Log-probabilities and entropy of sampled tokens from logits, computed in chunks.

The full fp32 ``log_softmax`` over ``tokens x vocab`` is often the true memory peak
(DESIGN §4: T=16k at a 152k vocabulary is ~9 GiB per copy); working ``chunk_size`` rows
at a time bounds the fp32 temporary to ``chunk_size x vocab x 4`` bytes.
"""

from __future__ import annotations

from typing import Optional

import torch


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits (..., V) any float dtype, labels (...) long -> logp (...) fp32 and entropy (...) fp32 or None.

    Entropy is computed without autograd unless ``entropy_grad`` (an entropy bonus in the
    loss): as a logged metric it would otherwise keep a softmax per chunk alive for backward.
    """
    if logits.dim() == 2:
        logits, labels = logits[None], labels[None]
        squeeze = True
    else:
        squeeze = False
    if logits.dim() != 3:
        raise ValueError(f"expected logits (B, T, V) or (T, V), got {tuple(logits.shape)}")
    logps, entropies = [], []
    # Chunks are views (row blocks, or pieces of one row when a row is longer than a chunk), so
    # a non-contiguous input such as ``logits[:, :-1]`` is never copied whole; only the fp32
    # chunk is materialised.
    for chunk, chunk_labels in _chunks(logits, labels, chunk_size):
        chunk = chunk.float()
        if temperature != 1.0:
            chunk = chunk / temperature
        log_norm = torch.logsumexp(chunk, dim=-1)
        picked = chunk.gather(-1, chunk_labels[..., None]).squeeze(-1)
        logps.append(picked - log_norm)
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                probs = torch.softmax(chunk, dim=-1)
                entropies.append(log_norm - (probs * chunk).sum(-1))
    logp = _join(logps, labels.shape)
    entropy = _join(entropies, labels.shape) if with_entropy else None
    if squeeze:
        logp = logp[0]
        entropy = entropy[0] if entropy is not None else None
    return logp, entropy


def _chunks(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int):
    """Yield (rows, T, V) blocks of about ``chunk_size`` tokens, or (1, t, V) pieces of long rows."""
    B, T, _ = logits.shape
    if T <= chunk_size:
        rows = max(1, chunk_size // max(T, 1))
        for b in range(0, B, rows):
            yield logits[b:b + rows], labels[b:b + rows]
    else:
        for b in range(B):
            for t in range(0, T, chunk_size):
                yield logits[b:b + 1, t:t + chunk_size], labels[b:b + 1, t:t + chunk_size]


def _join(parts: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """Reassemble chunk results (in _chunks order) into (B, T)."""
    B, T = shape
    if not parts:
        return torch.zeros(shape)
    if parts[0].shape[1] == T:  # row blocks
        return torch.cat(parts, dim=0)
    per_row = (T + parts[0].shape[1] - 1) // parts[0].shape[1]
    return torch.cat([torch.cat(parts[b * per_row:(b + 1) * per_row], dim=1) for b in range(B)], dim=0)


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of the last ``response_length`` tokens of each row under ``model``.

    input_ids (B, P+R): left-padded prompt then right-padded response. Only the R+1 last
    positions' logits are materialised (``logits_to_keep``): prompt logits are never needed.
    Returns (B, R) tensors.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=response_length + 1,
    )
    logits = out.logits[:, :-1]  # (B, R, V): position t predicts token t+1
    labels = input_ids[:, -response_length:]  # (B, R)
    return token_logprobs(logits, labels, temperature=temperature, chunk_size=chunk_size,
                          with_entropy=with_entropy, entropy_grad=entropy_grad)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens, as HF ``generate`` does for left-padded prompts."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)
