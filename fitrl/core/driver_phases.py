"""The phases of a step as the driver names them: what ``trainer.hang_timeouts`` keys, the
metrics' ``time/<phase>`` and the memory records are named by.

One list for all of them: the driver's timer refuses a phase that is not here
(fitrl/telemetry/timer.py), and the config refuses a ``trainer.hang_timeouts`` key that is not
here (fitrl/config/run.py), so a phase added to the loop is a phase the config accepts.
Standard library only: the config imports it.
"""

from __future__ import annotations

DRIVER_PHASES = ("data", "rollout", "baseline_rollout", "reward", "old_logprob", "ref", "teacher_logprob", "values",
                 "advantage", "critic_update", "update", "weight_sync", "validation", "checkpoint_save")
"""In the order a step runs them (``data``: drawing the prompts; ``baseline_rollout``: ReMax's
greedy pass; ``ref``: the reference's log-probs; ``teacher_logprob``: the distillation teacher's;
``values``: the critic's)."""

OTHER_NAMES = {"ref_logprob": "ref", "value_update": "critic_update", "ref_log_prob": "ref",
               "old_log_prob": "old_logprob", "actor_update": "update", "generate": "rollout",
               "save": "checkpoint_save"}
"""Names a user may have read elsewhere (the memory plan's ``ref_logprob``, veRL's timing keys)
for a driver phase: what a refused ``trainer.hang_timeouts`` key suggests, never an alias."""


def suggest(name: str) -> str:
    """The driver phase ``name`` most likely means, or "".

    >>> suggest("ref_logprob"), suggest("checkpoint_sav"), suggest("bogus_phase")
    ('ref', 'checkpoint_save', '')
    """
    import difflib

    if name in OTHER_NAMES:
        return OTHER_NAMES[name]
    near = difflib.get_close_matches(name, DRIVER_PHASES, n=1)
    return near[0] if near else ""
