"""memory.trim_heap: CPU processes give the heap's free pages back (glibc malloc_trim) at the end
of each role's phase, and the CPU memory plan follows whether they do."""

from __future__ import annotations

import pytest
import torch

from fitrl.config.schema import FSDPConfig
from fitrl.roles import workers
from fitrl.roles.workers import OffloadBetweenPhases
from fitrl.telemetry import memory as mem
from helpers import toy_config


@pytest.fixture
def trims(monkeypatch):
    calls = []
    monkeypatch.setattr(workers, "trim_heap", lambda: calls.append(1) or True)
    return calls


def test_phase_end_trims_on_cpu(trims):
    offload = OffloadBetweenPhases(torch.nn.Linear(2, 2), FSDPConfig(), torch.device("cpu"), trim=True)
    assert len(trims) == 1  # once built (what loading freed)
    with offload.phase():
        assert len(trims) == 1
    assert len(trims) == 2
    with pytest.raises(RuntimeError), offload.phase(needs_optimizer=True):
        raise RuntimeError("a phase that fails still ends")
    assert len(trims) == 3


def test_no_trim_when_off_or_not_cpu(trims):
    off = OffloadBetweenPhases(torch.nn.Linear(2, 2), FSDPConfig(), torch.device("cpu"), trim=False)
    with off.phase():
        pass
    # a CUDA role (FSDP2 CPU offload: nothing moves, so no CUDA call here) keeps its host heap
    cuda = OffloadBetweenPhases(torch.nn.Linear(2, 2), FSDPConfig(cpu_offload=True), torch.device("cuda"), trim=True)
    with cuda.phase():
        pass
    assert trims == []


def test_config_key(tmp_path, tiny_model_dir):
    assert toy_config(tiny_model_dir, tmp_path).memory.trim_heap is True
    assert toy_config(tiny_model_dir, tmp_path, "memory.trim_heap=false").memory.trim_heap is False


@pytest.mark.parametrize("trim", [True, False])
def test_policy_phases_trim(tmp_path, tiny_model_dir, trims, trim):
    """Each of a CPU policy's calls (generate, log-probs, update) ends with one trim, or none."""
    from fitrl.config.schema import SamplingConfig
    from fitrl.data.batch import Batch

    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.device=cpu", f"memory.trim_heap={str(trim).lower()}")
    worker = workers.PolicyWorker(cfg, rank=0, world_size=1)
    built = len(trims)
    batch = worker.generate(Batch(fields={"prompt_ids": [[10, 11, 12], [13, 14]]}),
                            SamplingConfig(n=2, max_tokens=4, ignore_eos=True))
    batch.update(worker.compute_logprob(batch))
    batch.update(advantages=torch.ones_like(batch["response_mask"], dtype=torch.float32))
    worker.update(batch)
    assert len(trims) - built == (3 if trim else 0)


@pytest.mark.skipif(mem._libc() is None, reason="no glibc")
def test_trim_heap_returns_free_pages():
    """Freed heap blocks below glibc's mmap threshold stay resident until trimmed."""
    blocks = [bytearray(64 * 1024) for _ in range(1600)]  # 100 MiB on the heap, every page touched
    keep = blocks[-1]  # holds the heap's top: only malloc_trim(0)'s walk of the free chunks can return the rest
    del blocks
    before = mem.rss_bytes()
    assert mem.trim_heap() is True
    assert before - mem.rss_bytes() > 50 * mem.MIB
    del keep
