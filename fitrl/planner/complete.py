"""Every extension owns its whole footprint: the completeness check behind
``tests/test_extension_points.py``.

A rollout engine is registered twice, beside itself (fitrl/rollout/): its runtime in
:data:`fitrl.rollout.engine.ROLLOUT_ENGINES` and its memory planner in
:data:`fitrl.memory.engines.ENGINE_PLANNERS`, under the same name. A name with only one of the two
would run unplanned or plan what cannot run; :func:`missing_counterparts` names each such gap, so
a new engine without its planner fails a test rather than a user's plan. The config's
``rollout.engine`` is checked against the engines' registry when it loads
(fitrl/core/registry.py, ``CHECKED_ON_LOAD``).
"""

from __future__ import annotations


def missing_counterparts() -> list[str]:
    """One line per registered name that lacks a counterpart (empty: every extension is complete)."""
    import fitrl.rollout  # noqa: F401  (registers the built-in engines and their planners)
    from fitrl.memory.engines import ENGINE_PLANNERS
    from fitrl.rollout.engine import ROLLOUT_ENGINES

    out = []
    for name in ROLLOUT_ENGINES:
        if name not in ENGINE_PLANNERS:
            out.append(f"rollout engine {name!r} has no memory planner (fitrl/memory/engines.py, ENGINE_PLANNERS)")
    for name in ENGINE_PLANNERS:
        if name not in ROLLOUT_ENGINES:
            out.append(f"engine planner {name!r} plans an engine that is not registered (ROLLOUT_ENGINES)")
    return out
