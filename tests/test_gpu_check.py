"""``make gpu-check`` (bench/gpu_check.py): its planning half runs anywhere (CI has no GPU), and the
figures a lent H100 recorded (bench/gpu_calibration/) stay within the plan's measured GPU band
(``fitrl.memory.calibration.GPU_PLAN_BAND``): a change to the planner that moves a GPU
prediction away from what the device measured fails here, not on a user's device."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402

from fitrl.memory import calibration as C  # noqa: E402

RECORDED = sorted((ROOT / "bench" / "gpu_calibration").glob("*.json"))


def test_dry_mode_writes_the_plan_table_and_json(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry", "--only", "q05", "q15-lora-kl",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry"] and [c["case"] for c in report["cases"]] == ["q05", "q15-lora-kl"]
    lora = report["cases"][1]["plan"]["caps"]
    assert set(lora) == {"rollout", "ref_logprob", "update"}
    # every phase that computes carries the device's context and the allocator's reserve
    for phase in lora.values():
        assert phase["gpu_parts"]["cuda context"] == pytest.approx(C.CUDA_CONTEXT / C.GIB)
        assert phase["gpu_parts"]["allocator reserve"] > 0
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| q05 | update |" in table and "| q15-lora-kl | ref_logprob |" in table


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.stem)
def test_recorded_gpu_figures_are_within_the_plans_band(path):
    report = json.loads(path.read_text())
    checked = 0
    for r in report["cases"]:
        case = next(c for c in gpu_check.CASES if c.name == r["case"])
        measured = r["measured"]
        plan = gpu_check.plan_case(case, int(measured["device_total_gib"] * C.GIB))
        for phase, m in measured["phases"].items():
            device_peak = m["gpu_peak_reserved"] + m["gpu_device_used"] - m["gpu_reserved"]
            planned = plan["caps"][phase]["gpu"]
            assert abs(planned - device_peak) <= C.GPU_PLAN_BAND * device_peak, (r["case"], phase, planned, device_peak)
            checked += 1
    assert checked >= 10


def test_table_renders_recorded_measurements():
    report = json.loads(RECORDED[-1].read_text())
    text = gpu_check.table(report["cases"])
    assert "| q3-ckpt | update |" in text and "update MFU" in text and "—" not in text.split("\n\n")[0]
