"""Variable-length attention for packed forwards on CUDA: no dense mask, one kernel call per layer.

A packed forward (fitrl/ops/packed.py) runs (rows, W) positions holding several sequences end to
end, each restarting its positions at 0. With ``attn_implementation=sdpa``, transformers builds
a (rows, 1, W, W) block-causal mask from those positions, and SDPA with an arbitrary mask cannot
use its flash kernel: it falls back to the memory-efficient or math kernel reading the whole
mask (at W = 8,192 and 4 rows, a 256 MiB bool mask per forward, and attention over the masked-out
blocks computed anyway). Here the sequences' boundaries become ``cu_seqlens`` and each layer
calls PyTorch's own flash varlen kernel (``torch.nn.attention.varlen.varlen_attn``): causal within
each sequence, nothing across.

Used for a pass (forward *and* backward: a checkpointed layer recomputes its forward in
backward and must attend the same way) with :func:`packed_attention` around it, only on CUDA,
with sdpa configured and the kernel present; elsewhere the model's own dense mask is kept, and
which of the two runs is said once per process in the log. Inside the pass, a call whose inputs
are not bf16/fp16 (the flash kernel's dtypes: fp32 compute) builds the block mask itself and
runs SDPA with it, as the dense path would.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

VARLEN = "fitrl_varlen"
"""The attention implementation's name in transformers' registry while a pass runs."""

Kernel = Callable[..., torch.Tensor]
_KERNEL: Optional[Kernel] = None  # a test's stand-in (reference_varlen) for torch's CUDA-only kernel
_SAID: set[str] = set()


def torch_varlen_kernel() -> Optional[Kernel]:
    """PyTorch's flash varlen attention where this build has it (torch >= 2.9), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def segments(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(rows, W) packed positions -> (cu_seqlens (N+1,) int32, an upper bound of the longest).

    Every position 0 starts a sequence (a row's filler counts 0, 1, ... as a sequence of its own,
    fitrl/core/packing.py), so the boundaries are where the flattened positions are 0. The bound
    is the row width W: the kernel sizes its grid by it, and an overestimate costs nothing, while
    the exact maximum would be a host sync in every layer.

    >>> segments(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]))
    (tensor([ 0,  3,  5,  9, 10], dtype=torch.int32), 5)
    """
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().squeeze(-1)
    end = torch.tensor([flat.numel()], device=flat.device, dtype=starts.dtype)
    return torch.cat([starts, end]).to(torch.int32), int(position_ids.shape[-1])


def reference_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: Optional[float] = None,
                     window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False) -> torch.Tensor:
    """What ``varlen_attn`` computes, one SDPA per sequence (any device and dtype): q (T, Hq, d),
    k/v (T, Hkv, d) -> (T, Hq, d). For tests and as the definition; slow with many sequences."""
    if window_size not in ((-1, -1), (-1, 0)):
        raise ValueError(f"reference_varlen: window_size {window_size} (full or causal only)")
    out = torch.empty_like(q)
    bounds = cu_seq_q.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[lo:hi].transpose(0, 1)[None] for t in (q, k, v))  # (1, H, L, d)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=window_size == (-1, 0), scale=scale,
                                           enable_gqa=enable_gqa)
        out[lo:hi] = o[0].transpose(0, 1)
    return out


def block_causal_mask(cu: torch.Tensor, width: int, rows: int) -> torch.Tensor:
    """(rows, 1, W, W) bool: True where a position may attend (its own sequence, not ahead)."""
    seq = torch.zeros(rows * width, dtype=torch.long, device=cu.device)
    seq[cu[1:-1].long()] = 1
    seq = seq.cumsum(0).reshape(rows, width)  # each position's sequence number
    causal = torch.ones(width, width, dtype=torch.bool, device=cu.device).tril()
    return ((seq[:, :, None] == seq[:, None, :]) & causal)[:, None]


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                     position_ids: Optional[torch.Tensor] = None, **kwargs):
    """transformers' attention signature: query (rows, Hq, W, d), key/value (rows, Hkv, W, d) ->
    ((rows, W, Hq, d), None). A call with a mask (a padded forward inside the pass) is SDPA's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError("varlen attention for packed sequences runs without attention dropout")
    rows, hq, width, d = query.shape
    hkv = key.shape[1]
    cu, longest = segments(position_ids)
    kernel = _KERNEL or torch_varlen_kernel()
    if kernel is None or (_KERNEL is None and query.dtype not in (torch.bfloat16, torch.float16)):
        _say("fp32", "attention for packed sequences: sdpa with a dense block mask (the flash varlen kernel "
                     f"takes bf16/fp16, this pass computes in {query.dtype})")
        mask = block_causal_mask(cu, width, rows)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scaling, **kwargs)
    q, k, v = (t.transpose(1, 2).reshape(rows * width, t.shape[1], d) for t in (query, key, value))  # (T, H, d)
    out = kernel(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, 0), enable_gqa=hq != hkv)
    return out.reshape(rows, width, hq, d), None


def _no_mask(*args, **kwargs):
    """The mask for a pass's forwards: none when the input has no padding mask (a packed forward:
    the positions carry the boundaries), SDPA's own otherwise."""
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, _no_mask)


def _say(key: str, line: str) -> None:
    if key not in _SAID:
        _SAID.add(key)
        log.info(line)


def packed_kernel(config, device: torch.device) -> tuple[Optional[str], str]:
    """(VARLEN or None, the line saying which attention packed forwards of this model run)."""
    impl = getattr(config, "_attn_implementation", "sdpa")
    if impl != "sdpa":
        return None, f"attention for packed sequences: {impl} (attn_implementation)"
    if _KERNEL is not None:
        return VARLEN, "attention for packed sequences: varlen (a test's kernel)"
    if device.type != "cuda":
        return None, f"attention for packed sequences: sdpa with a dense block mask (no varlen kernel on {device.type})"
    if torch_varlen_kernel() is None:
        return None, "attention for packed sequences: sdpa with a dense block mask (this torch has no varlen_attn)"
    return VARLEN, "attention for packed sequences: torch varlen_attn (flash, cu_seqlens, no mask)"


@contextlib.contextmanager
def packed_attention(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Around a pass (forwards and backwards): the model's sdpa attention runs as
    :func:`varlen_attention` where :func:`packed_kernel` chooses it; nothing otherwise."""
    config = model.config
    chosen, line = packed_kernel(config, device)
    _say(line, line)
    if chosen is None:
        yield
        return
    _register()
    inner, config._attn_implementation = config._attn_implementation, VARLEN
    try:
        yield
    finally:
        config._attn_implementation = inner


VISION = "fitrl_flash_varlen_vision"
"""The vision towers' attention on CUDA. The Qwen-VL towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL in
transformers 5.23) hand an implementation whose name holds "flash" their windows' ``cu_seqlens``
in one call; any other runs one SDPA call per window (Qwen2.5-VL: a picture's patches in windows
of 64, so one call per 64 patches in 28 of its 32 layers)."""


def vision_varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Optional[torch.Tensor] = None, dropout: float = 0.0,
                            scaling: Optional[float] = None, cu_seq_lens_q: Optional[torch.Tensor] = None,
                            max_length_q: Optional[int] = None, **kwargs):
    """A tower's attention over its windows: query/key/value (1, H, S, d), the windows'
    boundaries ``cu_seq_lens_q`` -> ((1, S, H, d), None). Bidirectional within each window. Where
    the kernel cannot run (fp32 compute, no kernel) each window is one SDPA call, as without it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for unused in ("cu_seq_lens_k", "max_length_k", "is_causal"):
        kwargs.pop(unused, None)
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=False, **kwargs)
    kernel = _KERNEL or torch_varlen_kernel()
    if kernel is None or (_KERNEL is None and not (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16))):
        lengths = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
        splits = [torch.split(t, lengths, dim=2) for t in (query, key, value)]
        outs = [sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=False,
                                       **kwargs)[0] for q, k, v in zip(*splits)]
        return torch.cat(outs, dim=1), None
    if dropout:
        raise ValueError("varlen attention for the vision tower runs without attention dropout")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (S, H, d)
    cu = cu_seq_lens_q.to(torch.int32)
    longest = int(max_length_q) if max_length_q is not None else int(q.shape[0])  # an upper bound suffices
    out = kernel(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, -1))
    return out[None], None


def use_varlen_vision(model: torch.nn.Module, device: torch.device) -> Optional[str]:
    """On CUDA with the kernel: the model's vision tower (a ``vision_config`` with sdpa) attends
    with :func:`vision_varlen_attention`, for every forward from now on (generation included:
    the tower's windows are its own, nothing like a packed pass's context). Returns the line
    saying so, None where nothing changes."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    if vision is None or getattr(vision, "_attn_implementation", None) != "sdpa":
        return None
    if _KERNEL is None and (device.type != "cuda" or torch_varlen_kernel() is None):
        return None
    from transformers import AttentionInterface

    AttentionInterface.register(VISION, vision_varlen_attention)
    vision._attn_implementation = VISION
    line = "vision tower attention: torch varlen_attn over its windows (one call per layer)"
    _say(line, line)
    return line


@contextlib.contextmanager
def using_kernel(kernel: Kernel) -> Iterator[None]:
    """Tests: run the varlen path with ``kernel`` (e.g. :func:`reference_varlen`) on any device."""
    global _KERNEL
    previous, _KERNEL = _KERNEL, kernel
    try:
        yield
    finally:
        _KERNEL = previous
