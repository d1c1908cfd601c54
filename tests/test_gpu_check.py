"""``make gpu-check`` (bench/gpu_check.py): its planning half runs anywhere (CI has no GPU), so do
its doctor step (the quick CPU rungs), its probes' plumbing and its variants' configs; and the
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
                        "--skip-doctor", "--skip-probes", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
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


# ----------------------------------------------------------------------------- doctor, probes, variants
def test_dry_mode_runs_the_doctor_and_the_probes_plumbing(tmp_path):
    """The dry run (CI) runs ``fitrl doctor``'s quick CPU rungs as step 0 and both probes in
    processes of their own: without CUDA the context probe says so, the host-cache probe
    measures unpinned tensors, and every figure lands in gpu_check.json and .md."""
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry", "--only", "q05", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    doctor = report["doctor"]
    assert doctor["rc"] == 0 and doctor["rungs"] == {"devices": "pass", "attention": "pass"}, doctor
    assert json.loads((tmp_path / "doctor.json").read_text())["device"] == "cpu"
    assert report["probes"]["context"] == {"skipped": "no CUDA device: no context to measure"}
    pinned = report["probes"]["pinned"]
    assert not pinned["pinned"] and pinned["tensors"] == len(gpu_check.PINNED_SIZES) * gpu_check.PINNED_REPEAT
    assert 0.8 < pinned["rss_factor"] < 1.5  # ordinary tensors: about their bytes
    assert report["comparisons"] == {}  # nothing measured
    md = (tmp_path / "gpu_check.md").read_text()
    assert "fitrl doctor (exit 0" in md and "PASS  devices" in md and "unpinned (no CUDA) host tensors" in md


def test_arguments_parse_and_an_unknown_case_is_refused(capsys):
    args = gpu_check.parse_args(["--dry", "--only", "q05", "q05-fp32", "--skip-doctor", "--doctor-timeout-s", "9"])
    assert args.dry and args.only == ["q05", "q05-fp32"] and args.skip_doctor and args.doctor_timeout_s == 9
    assert not args.skip_probes and args.probe is None
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(["--only", "q5"])
    assert e.value.code == 2 and "--only q5: no such case" in capsys.readouterr().err


def test_the_variants_change_one_thing_each(tmp_path):
    by = {c.name: c for c in gpu_check.CASES}
    (tmp_path / "config.json").write_text(json.dumps(gpu_check.model_config("qwen2.5-0.5b")))
    fp32 = gpu_check.run_config(by["q05-fp32"], tmp_path, tmp_path / "run", "cuda")
    assert fp32.actor.fsdp.mixed_precision is False  # the variant's override comes after the cases' default
    assert gpu_check.run_config(by["q05"], tmp_path, tmp_path / "run", "cuda").actor.fsdp.mixed_precision is True
    assert dict(by["q05-expandable"].env) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert "expandable_segments:True" in by["q05-expandable"].label and "fp32" in by["q05-fp32"].label


def test_probe_figures_from_readings():
    g = C.GIB
    c = gpu_check.context_figures(used_before=1 * g, free=70 * g, total=80 * g, reserved=2 * 1024**2,
                                  used_after_matmul=10 * g + 64 * 1024**2)
    assert c["context_gib"] == pytest.approx(9 - 2 / 1024) and c["first_matmul_gib"] == pytest.approx(1 / 16)
    assert gpu_check.context_figures(None, 70 * g, 80 * g, 0, 10 * g)["context_gib"] is None  # no nvidia-smi
    sizes = [3 * 1024**2] * 4  # each rounded up to 4 MiB by a power-of-two cache
    pin = gpu_check.pinned_figures(sizes, rss_before=g, rss_after=g + 16 * 1024**2, rss_freed=g + 16 * 1024**2,
                                   reserved=16 * 1024**2)
    assert pin["rss_factor"] == pytest.approx(4 / 3) and pin["rounding_per_tensor_mib"] == pytest.approx(1.0)
    assert pin["reserved_factor"] == pytest.approx(4 / 3) and pin["kept_after_free_gib"] == pytest.approx(1 / 64)


def test_comparisons_and_their_tables():
    def measured(reserved, step):
        return {"phases": {"update": {"gpu_peak": 10.0, "gpu_peak_reserved": reserved}},
                "perf": {"time/step": step, "time/update": step / 2, "time/rollout": step / 2,
                         "perf/update_tokens_per_s": 1000 / step}}
    cases = [{"case": "q05", "measured": measured(12.0, 10.0)}, {"case": "q05-fp32", "measured": measured(14.0, 25.0)},
             {"case": "q05-expandable", "measured": measured(10.5, 10.0)}]
    comp = gpu_check.comparisons(cases)
    assert comp["reserve_factor"] == {"expandable_off": {"update": 1.2}, "expandable_on": {"update": 1.05}}
    assert comp["precision"]["time/step"]["fp32_over_bf16"] == pytest.approx(2.5)
    text = gpu_check.extra_tables({"comparisons": comp})
    assert "| update | 1.200 | 1.050 |" in text and "| time/step | 10 | 25 | 2.50 |" in text
