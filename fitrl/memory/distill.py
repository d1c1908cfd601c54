"""The teacher's top-k outputs while its pass runs (fitrl/roles/teacher.py, ``compute_teacher_logprob``).

Per micro-batch, :func:`fitrl.roles.topk_heads.teacher_token_stats` returns three tensors cut from
its head's (b, R, 1 + 2k) fp32 output: the sampled token's log-prob (a view, which keeps that
whole output alive), the top-k log-probs (a fp32 copy) and ids (an int64 copy): ``4 + 20k``
bytes per response token, kept in lists until the last micro-batch, then concatenated (``4 +
12k``, what the pass returns). So the pass holds up to ``8 + 32k`` bytes per token at its end,
and the earlier micro-batches' outputs while its last one runs. Measured with the storage
counter of the plan's traces (tests/test_plan_moe_held.py): a tiny teacher's pass over 4,096
response tokens peaked at 32.03 MiB with k = 256, exactly ``4,096 x (8 + 32 x 256)`` bytes,
against 12.0 MiB for the ``12k`` bytes per token it returns.
"""

from __future__ import annotations

from fitrl.memory.run import Run

KEPT_PER_TOPK = 2 * 4 + 4 + 8 + 4 + 8
"""Bytes per top-k entry and token while the pass runs: the head's output's two fp32 columns (log-prob
and id as a float), the fp32 and int64 copies, and their concatenations (32)."""
KEPT_PER_TOKEN = 4 + 4
"""Bytes per token besides: the head's output's sampled log-prob column and its concatenation."""


def teacher_topk_pass(run: Run, seqs: int, micro: int, traced: int) -> int:
    """Bytes the pass's top-k outputs add to its traced transient ``traced`` (one micro-batch's
    activations and logits) over ``seqs`` sequences in micro-batches of ``micro``: the larger of
    the earlier micro-batches' outputs, held while the last one runs, and the concatenation at
    the end (when the activations are freed); 0 without top-k."""
    k = run.cfg.algorithm.distill.top_k
    if not k:
        return 0
    per_micro = 4 + 20 * k  # (the lists: the output's 1 + 2k fp32 columns, the two copies)
    earlier = (seqs - micro) * run.response_len * per_micro
    end = seqs * run.response_len * (KEPT_PER_TOKEN + KEPT_PER_TOPK * k)
    return max(earlier, end - traced)
