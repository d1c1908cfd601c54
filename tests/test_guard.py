"""The guard's safe points: readings against thresholds, and ranks leaving together."""

import pytest

from fitrl.config.schema import MemoryConfig
from fitrl.telemetry import memory
from fitrl.telemetry.guard import MemoryGuard, MemoryPressure

GIB = 2**30


def guard(**kwargs) -> MemoryGuard:
    g = MemoryGuard()
    g.configure(MemoryConfig(**kwargs), process="rank0")
    return g


def test_threshold_is_a_fraction_of_the_node_unless_given(monkeypatch):
    monkeypatch.setattr(memory, "node_total_bytes", lambda: 100 * GIB)
    monkeypatch.setattr(memory, "node_available_bytes", lambda: 8 * GIB)
    assert guard().reading() is None                              # 8 % left, guard at 7 %
    monkeypatch.setattr(memory, "node_available_bytes", lambda: 6 * GIB)
    p = guard().reading()
    assert p.kind == "host" and p.threshold == 7 * GIB and p.available == 6 * GIB
    assert "6.00 GiB available on the node, under the guard's 7.00 GiB of 100.0 GiB" in str(p)
    assert guard(guard_min_available_gib=5.0).reading() is None   # an explicit threshold wins
    assert guard(guard=False).reading() is None


def test_check_raises_and_note_defers(monkeypatch):
    monkeypatch.setattr(memory, "node_available_bytes", lambda: 0)
    g = guard()
    g.phase = "rollout"
    with pytest.raises(MemoryPressure, match="during 'rollout'"):
        g.check()
    g.note()
    g.note()  # the first crossing is kept
    first = g.take_deferred()
    assert first is not None and first.phase == "rollout" and g.take_deferred() is None


def test_pressure_survives_pickling_with_its_fields():
    import pickle

    p = MemoryPressure("gpu", "policy.rank3", "update", 2 * GIB, 4 * GIB, 80 * GIB, origin=False)
    q = pickle.loads(pickle.dumps(p))
    assert (q.kind, q.process, q.phase, q.available, q.origin) == ("gpu", "policy.rank3", "update", 2 * GIB, False)
    assert str(q) == str(p) and "another rank" in str(q)


def test_a_gpu_stop_names_fragmentation_when_the_cache_is_large():
    import pickle

    # 78 GiB in use, 12 of them the allocator's cache: fragmentation, and the setting that helps
    p = MemoryPressure("gpu", "rank0", "update", 2 * GIB, 2 * GIB, 80 * GIB, cache=12 * GIB)
    assert str(p).endswith("; 12.0 GiB of it is rank0's allocator cache (reserved, no tensor in it): fragmentation, "
                           "which memory.expandable_segments=on (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) "
                           "avoids")
    assert pickle.loads(pickle.dumps(p)).cache == 12 * GIB
    # a cache of 2 GiB in 78 is the allocator's ordinary slack: not said
    assert "fragmentation" not in str(MemoryPressure("gpu", "rank0", "update", 2 * GIB, 2 * GIB, 80 * GIB, cache=2 * GIB))


@pytest.mark.slow
def test_one_low_rank_makes_every_rank_leave_the_same_safe_point():
    import torch.multiprocessing as mp

    from fitrl.distributed.process_group import free_port
    from fsdp_spawn import guard_check_on_rank

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=guard_check_on_rank, args=(r, 2, port, 1, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    assert results[1] == (True, "host", "policy.rank1")    # its own reading
    assert results[0] == (False, "host", "policy.rank0")   # left because rank 1 did


def test_poll_reads_at_most_every_interval(monkeypatch):
    monkeypatch.setattr(memory, "node_available_bytes", lambda: 0)
    g = guard()
    with pytest.raises(MemoryPressure):
        g.poll()
    g.poll()  # within POLL_INTERVAL_S of the last reading: no reading, no raise
    g._last_poll -= 1.0
    with pytest.raises(MemoryPressure):
        g.poll()
