"""Per-phase memory readings stay cheap: RSS from kernel counters at every phase, USS (a walk
of the page tables, ~14 ms per GiB of RSS) once every ``memory.uss_every`` steps, near the
guard's threshold, or per phase only when ``memory.uss_min_phase_s`` asks for it."""

import io
import os

import psutil
import pytest
from rich.console import Console

import fitrl.telemetry.phases as phases
from fitrl.config import ConfigError
from fitrl.config.schema import MemoryConfig
from fitrl.telemetry import memory
from fitrl.telemetry.guard import GUARD, MemoryGuard
from fitrl.telemetry.leaks import LeakDetector
from fitrl.telemetry.phases import PhaseRecorder
from fitrl.trainer.memory_watch import report_metrics
from helpers import read_metrics, toy_config

GIB = 2**30
PHASES = ("rollout", "old_logprob", "update")


@pytest.fixture
def walks(monkeypatch):
    """Counts USS readings (page-table walks), each returning a fixed 1 GiB."""
    calls = []

    def uss_bytes():
        calls.append(1)
        return GIB
    monkeypatch.setattr(memory, "uss_bytes", uss_bytes)  # read_memory(uss=True)
    monkeypatch.setattr(phases, "uss_bytes", uss_bytes)  # the recorder's end-of-step reading
    return calls


@pytest.fixture(autouse=True)
def restore_guard_and_recorder():
    saved = (GUARD.settings, GUARD.process, GUARD.phase)
    recorder = phases.RECORDER
    saved_recorder = (recorder.enabled, recorder.uss_every, recorder.uss_min_s, recorder.phase_peaks)
    recorder._uss_wanted = False  # another test's guard may have asked
    yield
    GUARD.settings, GUARD.process, GUARD.phase = saved
    recorder.enabled, recorder.uss_every, recorder.uss_min_s, recorder.phase_peaks = saved_recorder
    recorder._uss_wanted = False
    recorder.drain(end_of_step=False)


def recorder(uss_every=10, uss_min_s=None) -> PhaseRecorder:
    r = PhaseRecorder()
    r.uss_every, r.uss_min_s = uss_every, uss_min_s
    return r


def step(r: PhaseRecorder) -> dict:
    for name in PHASES:
        with r.phase(name):
            pass
    return r.drain()


def uss_phases(records: dict) -> list[str]:
    return [name for name, rec in records.items() if rec.host_uss]


def test_cheap_readings_match_psutil():
    rss = psutil.Process().memory_info().rss
    assert abs(memory.rss_bytes() - rss) < 64 * 2**20
    vm = psutil.virtual_memory()
    assert memory.node_total_bytes() == vm.total
    assert abs(memory.node_available_bytes() - vm.available) < 0.05 * vm.total  # a shared machine moves
    assert 0 < memory.uss_bytes() <= 2 * memory.rss_bytes()


def test_read_memory_walks_only_when_asked(walks):
    r = memory.read_memory()
    assert r.host_uss == 0 and r.host_rss > 0 and r.node_total > 0 and not walks
    assert memory.read_memory(uss=True).host_uss == GIB and len(walks) == 1


def test_uss_once_every_uss_every_steps_on_the_last_phase(walks):
    r = recorder(uss_every=3)
    seen = [uss_phases(step(r)) for _ in range(7)]
    # steps 1, 4, 7: one walk each, on the step's last phase; none at any phase boundary
    assert seen == [["update"], [], [], ["update"], [], [], ["update"]]
    assert len(walks) == 3


def test_uss_every_1_and_0(walks):
    r = recorder(uss_every=1)
    assert [uss_phases(step(r)) for _ in range(3)] == [["update"]] * 3
    r = recorder(uss_every=0)
    assert [uss_phases(step(r)) for _ in range(3)] == [[]] * 3
    assert len(walks) == 3


def test_per_phase_uss_on_request(walks):
    r = recorder(uss_every=10, uss_min_s=0)  # every phase, as earlier versions did after phases >= 0.1 s
    assert uss_phases(step(r)) == list(PHASES) and len(walks) == 3  # the end-of-step reading reuses update's
    r = recorder(uss_every=0, uss_min_s=3600)  # no phase that long
    assert uss_phases(step(r)) == []


def test_what_came_before_the_first_step_is_not_a_step(walks):
    r = recorder(uss_every=2)
    with r.phase("load"):
        pass
    assert uss_phases(r.drain(end_of_step=False)) == [] and not walks
    assert uss_phases(step(r)) == ["update"]  # step 1 still reads it
    assert uss_phases(step(r)) == []


def test_metric_key_present_only_when_read(walks):
    r = recorder(uss_every=2)
    first, second = report_metrics({"rank0": step(r)}), report_metrics({"rank0": step(r)})
    assert first["mem/rank0/update/host_uss_gib"] == 1.0
    assert not any(k.endswith("host_uss_gib") for k in second)
    for m in (first, second):  # the cheap fields are there every step, for every phase
        for phase in PHASES:
            for field in ("host_rss_gib", "host_peak_gib", "node_available_gib"):
                assert m[f"mem/rank0/{phase}/{field}"] > 0


def test_guard_near_its_threshold_asks_for_uss(walks, monkeypatch):
    monkeypatch.setattr(memory, "node_total_bytes", lambda: 100 * GIB)
    g = MemoryGuard()
    g.configure(MemoryConfig(uss_every=0), process="rank0")  # threshold 7 GiB; USS never per step
    r = phases.RECORDER
    monkeypatch.setattr(memory, "node_available_bytes", lambda: 50 * GIB)
    g.check()
    assert uss_phases(step(r)) == []
    monkeypatch.setattr(memory, "node_available_bytes", lambda: 10 * GIB)  # under 1.5 x 7 GiB, not under 7
    g.check()
    assert uss_phases(step(r)) == ["rollout"]  # the next phase's end, once
    assert len(walks) == 1


def test_config_checks():
    assert (MemoryConfig().uss_every, MemoryConfig().uss_min_phase_s) == (10, None)
    with pytest.raises(ConfigError, match="memory.uss_every"):
        MemoryConfig(uss_every=-1)
    with pytest.raises(ConfigError, match="uss_min_phase_s"):
        MemoryConfig(uss_min_phase_s=-0.5)


def test_leak_detection_reads_no_uss():
    """Levels and retained RSS only: a leak is found in records that carry no USS at all."""
    from test_leaks import simulate

    det = LeakDetector()
    warnings = []
    for n, report in simulate(60, {"old_logprob": 8.0}, seed=1):
        for rec in report["rank0"].values():
            rec.host_uss = 0
        warnings += det.observe(n, report)
    assert warnings and warnings[0].phase == "old_logprob"


def test_run_reports_uss_every_uss_every_steps(tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    train(toy_config(tiny_model_dir, tmp_path, "trainer.max_steps=3", "memory.uss_every=2",
                     "data.rollout_batch_size=4", "rollout.n=4", "actor.mini_batch_size=4", "actor.micro_batch_size=16",
                     "trainer.val_before_train=false", "data.val_files=[]", "checkpoint.save_final=false"),
          Console(file=io.StringIO()))
    steps = [r for r in read_metrics(tmp_path) if "reward/mean" in r]
    uss = [[k for k in r if k.endswith("/host_uss_gib")] for r in steps]
    assert [len(keys) for keys in uss] == [1, 0, 1], uss  # steps 1 and 3, on rank0's last phase
    assert uss[0][0].startswith("mem/rank0/") and steps[0][uss[0][0]] > 0
    assert all("mem/rank0/update/host_rss_gib" in r for r in steps)


def test_phase_peaks_leave_the_kernels_peak_alone():
    """Issue 37: by default (``memory.phase_peaks=sample``) the kernel's high-water mark, what
    ``/usr/bin/time -v`` reports, is never rewound. A phase that raises it reads its peak from it,
    exactly; a phase that does not gets the largest RSS the helper process saw in it."""
    import mmap
    import resource
    import time

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("no procfs here")

    def touched_map(size: int) -> mmap.mmap:
        # an anonymous mapping, touched: its pages are resident until close() unmaps them, whatever
        # the allocator would do with a freed block of that size (CI once saw glibc keep an
        # np.ones block resident after del, which made this test's baseline move)
        m = mmap.mmap(-1, size)
        page = b"\x01" * 4096
        for offset in range(0, size, 4096):
            m[offset:offset + 4096] = page
        return m

    r = recorder()
    assert r.phase_peaks == "sample"
    # enough touched pages to pass this process's lifetime peak (earlier tests may have set it high)
    record = max(256 * 2**20, memory.peak_rss_bytes() - memory.rss_bytes() + 128 * 2**20)
    with r.phase("big"):
        touched_map(record).close()  # a new lifetime peak
    with r.phase("held"):
        before = memory.rss_bytes()
        block = touched_map(128 * 2**20)  # 128 MiB: under the mark, seen only by sampling
        deadline = time.monotonic() + 30  # a loaded machine: wait for a reading of the whole block, not a bound
        while r.sampler.peak_so_far() < before + 120 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.01)
        block.close()
    with r.phase("quiet"):
        pass
    rec = r.drain()
    mark = memory.peak_rss_bytes()
    assert abs(rec["big"].host_peak - mark) <= 4 * 2**20  # the kernel's mark, which nothing rewound
    assert rec["held"].host_peak >= rec["held"].host_rss + 120 * 2**20
    assert rec["quiet"].host_peak <= rec["held"].host_peak - 120 * 2**20
    assert rec["big"].host_peak >= rec["held"].host_peak + 120 * 2**20
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 >= rec["big"].host_peak - 4 * 2**20


def test_the_lifetime_peak_survives_the_phases_rewinds():
    """With ``memory.phase_peaks=rewind`` each phase rewinds the kernel's RSS high-water mark to
    read its own peak; the process's lifetime peak (``mem/host_peak_rss_gib``) is kept apart and
    never decreases (issue 37)."""
    import numpy as np

    from fitrl.telemetry.memory import host_memory, lifetime_peak_rss_bytes, peak_rss_bytes, reset_peak_rss

    if not reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs here")
    block = np.ones(256 * 2**20, dtype=np.uint8)  # 256 MiB, touched
    high = peak_rss_bytes()
    del block
    before = host_memory()["mem/host_peak_rss_gib"]
    reset_peak_rss()
    assert peak_rss_bytes() < high - 128 * 2**20  # the kernel's mark is rewound...
    assert lifetime_peak_rss_bytes() >= high - 4 * 2**20  # ...the lifetime one is not (the kernel syncs RSS lazily)
    assert host_memory()["mem/host_peak_rss_gib"] >= before


@pytest.mark.parametrize("open_phase", [True, False])
def test_the_peak_sampler_ends_with_its_process(open_phase):
    """The helper process never outlives the process it watches, killed in a phase or between."""
    import signal
    import subprocess
    import sys
    import time

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("no procfs here")
    code = ("import sys, time\nfrom fitrl.telemetry.peak_sampler import SAMPLER\nSAMPLER.arm()\n"
            "if sys.argv[1] == '0':\n    SAMPLER.disarm()\nprint(SAMPLER._helper.pid, flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(int(open_phase))], stdout=subprocess.PIPE, text=True)
    helper = int(proc.stdout.readline())
    assert psutil.pid_exists(helper)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not psutil.pid_exists(helper) or psutil.Process(helper).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the sampler {helper} outlived its process")
