"""Multimodal rotary positions of Qwen2-VL and Qwen2.5-VL, as the released models lay them out.

A sequence is runs of text tokens and runs of vision tokens (one run per image or video, its
pad tokens). Positions are (3, T): temporal, height, width.

- A text run counts up on all three axes from the position after the largest one so far.
- A vision run of grid ``(t, h, w)`` (``h``, ``w`` after the ``merge x merge`` patch merge) starts
  at that same position ``s``: token ``(i, j, k)`` gets ``(s + floor(i * step), s + j, s + k)``.
  ``step`` is 1 for Qwen2-VL, and ``tokens_per_second * second_per_grid_t`` for a Qwen2.5-VL
  video (an image has ``t = 1``).
- The text after a vision run resumes after the run's largest position on any axis, the
  temporal one included.

The last rule is where transformers 5.x departs from the released models: its
``get_rope_index`` resumes text at ``s + max(h, w)``, whatever the video's temporal extent, so a
Qwen2.5-VL video whose last temporal position passes its width puts the following text on
positions it already used. vLLM follows the released layout; fitrl uses this module for the
trainer's positions and for Hugging Face ``generate`` alike (the rollout/trainer log-prob
mismatch would otherwise be exactly this difference, ``tests/test_mrope.py``).
"""

from __future__ import annotations

import itertools
from typing import Iterable, Optional

import torch


def vision_run_positions(start: int, grid: tuple[int, int, int], merge: int, step: float) -> torch.Tensor:
    """(3, t*h*w/merge**2) positions of one image's or video's tokens, in token order (t, h, w)."""
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    temporal = (torch.arange(t, dtype=torch.float64) * step).long()
    tt, hh, ww = torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def sequence_positions(token_types: list[int], image_grids: Iterable, video_grids: Iterable,
                       video_steps: Iterable[float], merge: int) -> torch.Tensor:
    """(3, len(token_types)) positions of one unpadded sequence; ``token_types``: 0 text, 1 image
    pad, 2 video pad; grids and steps are consumed in order of appearance (iterators shared by a
    batch's rows are consumed as far as this row goes)."""
    grids = {1: iter(image_grids), 2: zip(video_grids, video_steps)}
    runs, next_pos = [], 0
    for kind, group in itertools.groupby(token_types):
        n = len(list(group))
        if kind == 0:
            run = torch.arange(n).expand(3, -1) + next_pos
        else:
            grid, step = (next(grids[1]), 1.0) if kind == 1 else next(grids[2])
            run = vision_run_positions(next_pos, grid, merge, step)
            if run.shape[1] != n:
                raise ValueError(f"a run of {n} vision tokens does not match its grid {list(map(int, grid))} "
                                 f"(merge {merge}: {run.shape[1]} tokens)")
        runs.append(run)
        next_pos = int(run.max()) + 1
    return torch.cat(runs, dim=1) if runs else torch.zeros(3, 0, dtype=torch.long)


def rope_index(token_types: torch.Tensor, attention_mask: Optional[torch.Tensor], image_grid_thw: Optional[torch.Tensor],
               video_grid_thw: Optional[torch.Tensor], second_per_grid_ts: Optional[torch.Tensor], *, merge: int,
               tokens_per_second: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (3, B, T) of a batch and the rope deltas (B, 1) that generation adds to the text
    positions of later tokens (``max position + 1 - real tokens``, transformers 5.x's convention).
    Padding (``attention_mask`` 0) gets position 0. ``tokens_per_second`` None: Qwen2-VL (video
    temporal step 1); else Qwen2.5-VL's step ``tokens_per_second * second_per_grid_ts`` (1 s per
    temporal grid when a video has none)."""
    B, T = token_types.shape
    mask = attention_mask.bool() if attention_mask is not None else torch.ones(B, T, dtype=torch.bool)
    images = image_grid_thw.tolist() if image_grid_thw is not None else []
    videos = video_grid_thw.tolist() if video_grid_thw is not None else []
    if tokens_per_second is None:
        steps = [1.0] * len(videos)
    else:
        seconds = second_per_grid_ts.tolist() if second_per_grid_ts is not None else [1.0] * len(videos)
        steps = [tokens_per_second * float(s) for s in seconds]
    positions = torch.zeros(3, B, T, dtype=torch.long)
    deltas = torch.zeros(B, 1, dtype=torch.long)
    types, keep = token_types.cpu(), mask.cpu()
    images, videos, steps = iter(images), iter(videos), iter(steps)  # rows take theirs in batch order
    for b in range(B):
        row = types[b][keep[b]].tolist()
        pos = sequence_positions(row, images, videos, steps, merge)
        positions[:, b, keep[b]] = pos
        deltas[b, 0] = (int(pos.max()) + 1 if pos.numel() else 0) - len(row)
    device = token_types.device
    return positions.to(device), deltas.to(device)
