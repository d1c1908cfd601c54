"""Shared fixtures: tiny models are built once per session (random weights, local tokenizer);
a Ray cluster per module for the multi-process tests."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

UNIT_FILES = {line.strip() for line in (Path(__file__).parent / "unit_files.txt").read_text().splitlines()
              if line.startswith("test_")}
MODEL_FIXTURES = {"tiny_model_dir", "tiny_llama_dir"}


def pytest_collection_modifyitems(config, items):
    """The unit tier: the tests of tests/unit_files.txt that build no model and start no process."""
    for item in items:
        if (item.path.name in UNIT_FILES and not MODEL_FIXTURES & set(item.fixturenames)
                and not any(item.get_closest_marker(m) for m in ("cli", "slow", "gpu", "vllm"))):
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def _earlier_vllm_engines_collected(request):
    """Before a vLLM test: engines an earlier test built and dropped (a PolicyWorker made by hand,
    not released) are collected now. Collected later, during this test, vLLM's teardown of the
    dropped engine destroys the process-wide parallel state this test's engine runs on ("pipeline
    model parallel group is not initialized"). Runs release theirs (fitrl/workers/group.py)."""
    if request.node.get_closest_marker("vllm"):
        import gc

        gc.collect()
        _remove_stale_vllm_shm()
    yield


_SESSION_START = time.time()


def _remove_stale_vllm_shm() -> None:
    """vLLM's CPU communicator names the shared-memory segments of an unnamed TP group by its ranks
    alone (``/dev/shm/-tp:0-[0-1]-cpushm_0``); Ray actors killed at a group's shutdown leave them,
    and the next test session's engine then fails to create them ("create shm in SHMManager failed.
    errno: 17"). Those left by an earlier session (older than this one) are removed."""
    for seg in Path("/dev/shm").glob("-tp:*cpushm_*"):
        try:
            if seg.stat().st_mtime < _SESSION_START:
                seg.unlink()
        except OSError:
            pass


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from fitrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", arch="qwen2", size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from fitrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama", size="tiny", seed=0)


@pytest.fixture(scope="module")
def ray_cluster():
    """A private 2-CPU Ray cluster for one test module, shut down after it. Per module, not per
    session: a module whose test leaks an actor or a placement group (or kills a worker) cannot
    starve or break the next module's 2 CPUs, and each module gets the cluster it asks for
    (``ensure_ray`` is a no-op once Ray is up, whatever its arguments)."""
    ray = pytest.importorskip("ray")
    from fitrl.workers.ray_group import ensure_ray

    ensure_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, tiny_model_dir):
    """A two-step toy run with a complete checkpoint (tests/badcases.py), built once."""
    from badcases import make_finished_run

    return make_finished_run(tmp_path_factory.mktemp("finished"), tiny_model_dir)


@pytest.fixture
def workspace(tmp_path, tiny_model_dir, finished_run):
    """A private model copy, data, config and finished run for one bad-input case."""
    from badcases import new_workspace

    return new_workspace(tmp_path, tiny_model_dir, finished_run)


@pytest.fixture(scope="session")
def _session_traces(tmp_path_factory):
    return tmp_path_factory.mktemp("fitrl-traces")


@pytest.fixture(autouse=True)
def _private_plan_cache(tmp_path_factory, monkeypatch, _session_traces):
    """Each test its own pre-flight plan cache (fitrl/memory/cache.py), never the user's. The
    traces under it are the session's: a trace is a pure function of its key (the spec and the
    code), and each ``fitrl`` subprocess of a test would otherwise trace its plan afresh (seconds
    each). Tests of the trace cache itself set a directory of their own (tests/test_plan_cache.py)."""
    root = tmp_path_factory.mktemp("fitrl-cache")  # (beside the test's tmp_path: some list theirs)
    (root / "traces").symlink_to(_session_traces, target_is_directory=True)
    monkeypatch.setenv("FITRL_CACHE_DIR", str(root))
