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
    shape = labels.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    logps, entropies = [], []
    for start in range(0, flat_labels.shape[0], chunk_size):
        chunk = flat_logits[start:start + chunk_size].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        log_norm = torch.logsumexp(chunk, dim=-1)
        picked = chunk.gather(-1, flat_labels[start:start + chunk_size, None]).squeeze(-1)
        logps.append(picked - log_norm)
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                probs = torch.softmax(chunk, dim=-1)
                entropies.append(log_norm - (probs * chunk).sum(-1))
    logp = torch.cat(logps).reshape(shape) if logps else flat_logits.new_zeros(shape, dtype=torch.float32)
    entropy = None
    if with_entropy:
        entropy = torch.cat(entropies).reshape(shape) if entropies else torch.zeros_like(logp)
    return logp, entropy


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
