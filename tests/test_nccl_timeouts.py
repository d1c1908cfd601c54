"""The collectives' timeout against the hang watchdog, and the stuck-stack report's split of the
ranks waiting in a collective from those at a Python-level point (fitrl/trainer/watchdog.py)."""

from __future__ import annotations

import os

import pytest
import torch

from fitrl.trainer.watchdog import (COLLECTIVE_MARGIN_S, UNWATCHED_COLLECTIVE_TIMEOUT_S, HangWatchdog,
                                    collective_timeout_s, split_stuck)
from fitrl.workers.ray_actor import collectives_issued


@pytest.mark.parametrize("default_s,per_phase,expected", [
    (1800, {}, 1800 + COLLECTIVE_MARGIN_S),
    (10, {}, 10 + COLLECTIVE_MARGIN_S),                          # small limits: still above a minute (rendezvous)
    (1800, {"checkpoint_save": 3600}, 3600 + COLLECTIVE_MARGIN_S),  # a per-phase limit reaches it
    (1800, {"update": 600}, 1800 + COLLECTIVE_MARGIN_S),        # a shorter phase does not lower it
    (0, {}, UNWATCHED_COLLECTIVE_TIMEOUT_S),                    # watchdog off: defined, finite
    (0, {"update": 7200}, 7200 + COLLECTIVE_MARGIN_S),          # other phases unwatched, update's limit above
    (600, {"checkpoint_save": 0}, UNWATCHED_COLLECTIVE_TIMEOUT_S),  # one phase unwatched: the hour
])
def test_the_collective_timeout_sits_above_every_watchdog_limit(default_s, per_phase, expected):
    timeout = collective_timeout_s(default_s, per_phase)
    assert timeout == expected
    assert all(timeout >= limit + COLLECTIVE_MARGIN_S for limit in [default_s, *per_phase.values()])
    assert timeout >= 60  # rendezvous and loading


def test_the_margin_covers_the_watchdogs_own_delays():
    """The watchdog fires up to one poll and one health round after the limit, then waits out the
    main thread's grace: NCCL must not abort a rank before that."""
    from fitrl.trainer import watchdog as w

    assert COLLECTIVE_MARGIN_S > w.MAX_POLL_S + w.HEALTH_TIMEOUT_S + w.EXIT_GRACE_S
    watchdog = HangWatchdog(lambda phase: 1e6, lambda timeout: [], report=lambda text, event: "")
    assert watchdog._interval() <= w.MAX_POLL_S


def _frames(*frames: tuple[str, int, str, str]) -> str:
    return "".join(f'  File "{path}", line {line}, in {fn}\n    {src}\n' for path, line, fn, src in frames)


TRAIN = ("/app/fitrl/trainer/loop.py", 200, "_fit", "self.update(batch)")
# NCCL's all-reduce returned at enqueue: rank 0 then blocks reading the loss on the host
AT_HOST_SYNC = _frames(TRAIN, ("/app/fitrl/roles/actor.py", 357, "update", "metrics['loss'] = loss.item()"))
IN_GLOO = _frames(TRAIN, ("/app/.venv/lib/python3.12/site-packages/torch/distributed/c10d_logger.py", 81,
                          "wrapper", "return func(*args, **kwargs)"),
                  ("/app/.venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", 2900,
                   "all_reduce", "work.wait()"))
IN_USER_CODE = _frames(TRAIN, ("/data/my_reward.py", 12, "score", "time.sleep(0.1)"))


def rank(n: int, stack: str, collectives, role: str = "policy") -> dict:
    return {"role": role, "rank": n, "idle_s": 100.0, "phase": "update", "stack": stack, "collectives": collectives}


def names(ranks: list[dict]) -> list[str]:
    return [f"{r['role']}{r['rank']}" for r in ranks]


def test_a_rank_ahead_in_collectives_waits_though_its_stack_is_at_a_host_sync():
    """Rank 0 enqueued collective #13 and blocks at ``.item()``; rank 1 never got past #12: rank 1
    is the one to look at (today's report, reading stacks alone, blames both)."""
    culprits, waiting = split_stuck([rank(0, AT_HOST_SYNC, 13), rank(1, IN_USER_CODE, 12)])
    assert names(culprits) == ["policy1"] and names(waiting) == ["policy0"]


def test_a_rank_in_a_c10d_frame_waits():
    culprits, waiting = split_stuck([rank(0, IN_GLOO, 5), rank(1, IN_USER_CODE, 5)])
    assert names(culprits) == ["policy1"] and names(waiting) == ["policy0"]
    windows = IN_GLOO.replace("/", "\\")
    assert names(split_stuck([rank(0, windows, None), rank(1, IN_USER_CODE, None)])[0]) == ["policy1"]


def test_three_ranks_at_three_counts_name_the_one_behind():
    culprits, waiting = split_stuck([rank(0, AT_HOST_SYNC, 7), rank(1, AT_HOST_SYNC, 6), rank(2, IN_USER_CODE, 5)])
    assert names(culprits) == ["policy2"] and names(waiting) == ["policy0", "policy1"]


def test_ranks_level_at_a_python_point_are_all_named():
    """No rank ahead, none in a collective (all stuck in a user's function): every one is a culprit."""
    culprits, waiting = split_stuck([rank(0, IN_USER_CODE, 4), rank(1, IN_USER_CODE, 4)])
    assert names(culprits) == ["policy0", "policy1"] and waiting == []


def test_every_rank_waiting_names_them_all():
    culprits, waiting = split_stuck([rank(0, IN_GLOO, 9), rank(1, IN_GLOO, 9)])
    assert names(culprits) == names(waiting) == ["policy0", "policy1"]


def test_counts_are_compared_within_a_role():
    """A reference rank with fewer collectives than a policy rank is not behind it: they share no group."""
    culprits, waiting = split_stuck([rank(0, IN_USER_CODE, 50), rank(0, IN_USER_CODE, 3, role="ref"),
                                     rank(1, IN_USER_CODE, 3, role="ref")])
    assert names(culprits) == ["policy0", "ref0", "ref1"] and waiting == []


def test_a_rank_that_did_not_answer_is_named_with_the_rest():
    silent = {"role": "policy", "rank": 1, "idle_s": None, "error": "timeout"}
    culprits, waiting = split_stuck([rank(0, AT_HOST_SYNC, 13), silent])
    # no count to compare with, and rank 0's stack is at a Python-level point: both are named
    assert names(culprits) == ["policy0", "policy1"] and waiting == []


def test_the_report_names_the_rank_behind_and_the_one_waiting(monkeypatch):
    from fitrl.telemetry.progress import PROGRESS
    from fitrl.trainer import watchdog as w

    monkeypatch.setattr(w, "_raise_in_main", lambda error: None)
    monkeypatch.setattr(w, "EXIT_GRACE_S", 0.0)
    monkeypatch.setattr(w.os, "_exit", lambda status: None)
    texts = []
    watchdog = HangWatchdog(lambda phase: 10.0, lambda timeout: [], report=lambda text, event: texts.append(text) or "")
    monkeypatch.setattr(PROGRESS, "last", PROGRESS.last - 100)
    watchdog.fire("update", 10.0, [rank(0, AT_HOST_SYNC, 13), rank(1, IN_USER_CODE, 12)])
    first = texts[0].splitlines()[0]
    assert first.endswith("stuck: policy rank 1 (policy rank 0 waiting in a collective)"), first
    assert "13 collectives issued (waiting in a collective)" in texts[0]


def test_collectives_issued_counts_every_collective_on_every_group(tmp_path):
    """The count the report compares is c10d's own, and every collective moves it (gloo here; NCCL
    keeps the same per-group sequence number)."""
    import torch.distributed as dist

    assert collectives_issued() is None  # no process group yet
    os.environ.update(MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sub = dist.new_group([0])
        before = collectives_issued()
        t = torch.ones(2)
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        dist.all_reduce(t, group=sub)
        assert collectives_issued() == before + 3
    finally:
        dist.destroy_process_group()
