"""Does ``/usr/bin/time -v`` agree with fitrl's own peaks? (issue 37, "telemetry without side effects")

Runs ``fitrl train`` under ``/usr/bin/time -v`` on a Qwen2.5-0.5B-shaped model (its config.json
shape, random bf16 weights as ``bench/gpu_check.py`` builds them, loaded as fp32 on the CPU) and
the shipped arith task, once per ``memory.phase_peaks`` mode, and compares:

- ``Maximum resident set size`` (the kernel's ``ru_maxrss`` at exit, what ``time -v`` prints);
- the largest per-phase peak fitrl logged (``mem/<process>/<phase>/host_peak_gib``, any step);
- the process's lifetime peak fitrl logged (``mem/host_peak_rss_gib``), and whether it ever fell.

With ``sample`` (the default) the first two should agree within a few per cent (the peak is in
a phase); with ``rewind`` the kernel's figure is only the peak since the last phase began.

    .venv/bin/python bench/peak_rss_time.py                   # both modes, 3 steps each (~5 min)
    .venv/bin/python bench/peak_rss_time.py --modes sample --steps 2
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GIB = 1024**3


def max_rss_bytes(time_v_output: str) -> int:
    """``Maximum resident set size (kbytes): N`` of GNU time's ``-v`` report, in bytes."""
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_v_output)
    if match is None:
        raise ValueError("no 'Maximum resident set size' line: is /usr/bin/time GNU time?")
    return int(match.group(1)) * 1024


def logged_peaks(metrics_path: Path) -> dict:
    """The largest phase peak (and where), and the lifetime-peak series, of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "mem/host_peak_rss_gib" in r]
    phase_keys = [(r[k], k) for r in steps for k in r if k.count("/") == 3 and k.endswith("/host_peak_gib")]
    top, where = max(phase_keys)
    lifetime = [r["mem/host_peak_rss_gib"] for r in steps]
    last = {k.split("/")[2]: v for k, v in steps[-1].items() if k.count("/") == 3 and k.endswith("/host_peak_gib")}
    return {"last_step_phase_peaks_gib": last, "phase_peak_gib": top, "phase_peak_at": where.split("/", 1)[1].rsplit("/", 1)[0],
            "lifetime_peak_gib": lifetime[-1], "lifetime_monotone": all(a <= b for a, b in zip(lifetime, lifetime[1:])),
            "steps": len(steps)}


def run_mode(mode: str, model_dir: Path, work: Path, steps: int) -> dict:
    run_dir = work / f"run-{mode}"
    cmd = ["/usr/bin/time", "-v", str(Path(sys.executable).parent / "fitrl"), "train", str(ROOT / "examples/arith.yaml"),
           f"actor.model.path={model_dir}", f"trainer.run_dir={run_dir}", f"trainer.max_steps={steps}",
           "data.rollout_batch_size=4", "actor.mini_batch_size=4", "rollout.n=4", "actor.micro_batch_size=4",
           "trainer.val_freq=0", "trainer.val_before_train=false", "trainer.progress_bar=false",
           "checkpoint.save_final=false", "memory.plan=warn", f"memory.phase_peaks={mode}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    kernel = max_rss_bytes(proc.stderr) / GIB
    out = {"mode": mode, "time_v_max_rss_gib": kernel, **logged_peaks(run_dir / "metrics.jsonl")}
    out["time_v_vs_phase_peak"] = kernel / out["phase_peak_gib"] - 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["sample", "rewind"], choices=["sample", "rewind"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    from bench.gpu_check import build_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model("qwen2.5-0.5b", Path(tmp) / "model")
        for mode in args.modes:
            rows.append(run_mode(mode, model_dir, Path(tmp), args.steps))
    print(f"Qwen2.5-0.5B shape (fp32 on CPU), examples/arith.yaml, 4 prompts x 4 samples, {args.steps} steps")
    print(f"{'phase_peaks':<12} {'time -v max RSS':>16} {'largest phase peak':>19} {'at':<16} {'diff':>7} "
          f"{'lifetime (logged)':>18} {'never fell':>10}")
    for r in rows:
        print(f"{r['mode']:<12} {r['time_v_max_rss_gib']:>12.2f} GiB {r['phase_peak_gib']:>15.2f} GiB "
              f"{r['phase_peak_at']:<16} {r['time_v_vs_phase_peak']:>+7.1%} {r['lifetime_peak_gib']:>14.2f} GiB "
              f"{'yes' if r['lifetime_monotone'] else 'NO':>10}")
    phases = sorted({p for r in rows for p in r["last_step_phase_peaks_gib"]})
    print(f"\nlast step's phase peaks, GiB: {' '.join(f'{p:>12}' for p in phases)}")
    for r in rows:
        cells = [f"{r['last_step_phase_peaks_gib'].get(p, float('nan')):>12.3f}" for p in phases]
        print(f"{r['mode']:<28} {' '.join(cells)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
