"""``fitrl doctor`` (fitrl/doctor/, docs/doctor.md): its CPU rungs run for real here (two gloo
ranks, the tiny model); GPU-only parts are skipped by name; bad input is one line and exit 2; a
rung that fails or hangs is reported with its cause and the other rungs still run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

from fitrl.doctor.ladder import BY_NAME, DoctorInputError, Result, Rung, pick, skipped_for  # noqa: E402

CPU_RUNGS = ["devices", "attention", "collective", "fsdp", "checkpoint", "engine", "memory"]


def doctor(*args: str, timeout: int = 240, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FITRL_DOCTOR_")}
    return subprocess.run([sys.executable, "-m", "fitrl.cli", "doctor", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**clean, "PYTHONPATH": str(ROOT), **env})


@pytest.mark.slow  # the ladder's processes: two gloo ranks among them
def test_cpu_ladder_passes_and_names_its_skips(tmp_path):
    report = tmp_path / "doctor.json"
    p = doctor("--device", "cpu", "--json", str(report))
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(report.read_text())
    status = {r["rung"]: r for r in got["rungs"]}
    assert list(status) == list(BY_NAME)  # every rung reported, in ladder order
    for name in CPU_RUNGS:
        assert status[name]["status"] == "pass", status[name]
    assert status["ray"]["status"] == "skip" and "--ray-address" in status["ray"]["detail"]
    # what only a GPU runs is named, with why
    assert "offload between phases" in status["fsdp"]["data"]["skipped"]
    assert "offload between phases" in status["checkpoint"]["data"]["skipped"]
    assert status["attention"]["data"]["varlen"] == "CUDA only"
    assert status["collective"]["data"]["backend"] == "gloo" and status["collective"]["data"]["world"] == 2
    assert status["engine"]["data"]["gaps"]["after the weight push"]["mean"] <= 1e-3
    assert set(status["memory"]["data"]["phases"]) >= {"rollout", "update"}
    lines = p.stdout.splitlines()
    assert sum(line.startswith(("PASS ", "SKIP ")) for line in lines) == len(BY_NAME)
    assert got["exit_status"] == 0 and got["device"] == "cpu"


@pytest.mark.cli
@pytest.mark.parametrize("args, says", [
    (["--device", "cuda"], "--device cuda: no CUDA device here"),
    (["--ray-address", "127.0.0.1:1"], "--ray-address 127.0.0.1:1: nothing answers at 127.0.0.1:1"),
    (["--only", "fsdb"], "no such rung (did you mean 'fsdp'?)"),
], ids=["cuda-without-gpu", "ray-unreachable", "unknown-rung"])
def test_bad_input_is_one_line_exit_2(args, says):
    if args[:2] == ["--device", "cuda"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA device")
    p = doctor(*args, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and says in p.stderr
    assert p.stderr.startswith("fitrl: doctor: ") and "Traceback" not in p.stderr


@pytest.mark.slow  # the ladder's processes: two gloo ranks among them
def test_a_failing_rung_names_its_cause_and_the_others_run(tmp_path):
    report = tmp_path / "doctor.json"
    p = doctor("--device", "cpu", "--skip", "engine", "memory", "--json", str(report), FITRL_DOCTOR_FAIL="fsdp")
    assert p.returncode == 1, p.stdout + p.stderr
    status = {r["rung"]: r for r in json.loads(report.read_text())["rungs"]}
    assert status["fsdp"]["status"] == "fail" and "injected failure (FITRL_DOCTOR_FAIL=fsdp)" in status["fsdp"]["detail"]
    assert status["checkpoint"] == {**status["checkpoint"], "status": "skip", "detail": "needs fsdp, which failed"}
    assert all(status[n]["status"] == "pass" for n in ("devices", "attention", "collective"))
    assert "FAIL  fsdp" in p.stdout


@pytest.mark.slow  # the ladder's processes: two gloo ranks among them
def test_a_hung_rung_times_out_and_the_next_runs(tmp_path):
    report = tmp_path / "doctor.json"
    p = doctor("--device", "cpu", "--only", "attention", "collective", "--timeout-s", "6", "--json", str(report),
               FITRL_DOCTOR_HANG="attention")
    assert p.returncode == 1, p.stdout + p.stderr
    status = {r["rung"]: r for r in json.loads(report.read_text())["rungs"]}
    assert status["attention"]["status"] == "fail" and "timed out after 6 s" in status["attention"]["detail"]
    assert status["attention"]["data"]["log"]  # the rank's log, for what it was doing
    assert status["collective"]["status"] == "pass", status["collective"]


def test_pick_keeps_ladder_order_and_refuses_unknown_names():
    assert [r.name for r in pick(["memory", "devices"], [])] == ["devices", "memory"]
    assert "fsdp" not in [r.name for r in pick([], ["fsdp"])]
    with pytest.raises(DoctorInputError, match="--skip nope: no such rung"):
        pick([], ["nope"])


def test_a_prerequisite_left_out_does_not_skip_a_rung():
    rung = Rung("b", "b", "local", "m:f", 1, depends=("a",))
    assert skipped_for(rung, {}) is None  # --only b: b builds what it needs itself
    assert skipped_for(rung, {"a": Result("a", "pass", "")}) is None
    assert skipped_for(rung, {"a": Result("a", "skip", "")}).detail == "needs a, which was skipped"


def test_a_failure_line_carries_its_cause_and_fix():
    line = Result("fsdp", "fail", "RuntimeError: boom", "do this", 1.25).line()
    assert line == "FAIL  fsdp        RuntimeError: boom Fix: do this (1.2 s)"
