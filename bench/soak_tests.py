"""The test suite under load: run ``make test``'s pytest command N times in a row while CPU
burners spin beside it, and print per run the outcome, duration and the machine's load.

CI runs on a shared, loaded machine; a test that bounds wall-clock time tightly or races a
timer fails there and nowhere else (issue 12). This is how to find such a test before CI does.

    .venv/bin/python bench/soak_tests.py --runs 5 --burners 2            # the whole suite
    .venv/bin/python bench/soak_tests.py --runs 3 --burners 1 -- -m "not slow"

Each burner is a process spinning a pure-Python loop (one core each). The figures go to stdout
and, with ``--out``, to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def burn() -> None:  # pragma: no cover - runs in a child process until terminated
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def summary_line(output: str) -> str:
    """pytest's closing line, e.g. ``612 passed, 3 skipped in 501.2s``."""
    lines = [ln.strip("= ") for ln in output.splitlines() if re.search(r"\b(passed|failed|error)\b", ln)]
    return lines[-1] if lines else "(no summary line)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--burners", type=int, default=2, help="CPU-spinning processes beside the tests")
    parser.add_argument("--out", type=Path, help="write the per-run figures as JSON")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()

    burners = [mp.Process(target=burn, daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    results = []
    try:
        for i in range(1, args.runs + 1):
            start = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.pytest_args],
                                  cwd=ROOT, capture_output=True, text=True)
            wall = time.monotonic() - start
            load1, load5, _ = os.getloadavg()
            result = {"run": i, "exit": proc.returncode, "wall_s": round(wall, 1), "load1": round(load1, 2),
                      "load5": round(load5, 2), "summary": summary_line(proc.stdout)}
            results.append(result)
            print(f"run {i}/{args.runs}: exit {proc.returncode}, {wall:.0f} s, load avg {load1:.1f}/{load5:.1f} "
                  f"({os.cpu_count()} cores, {args.burners} burners): {result['summary']}", flush=True)
            if proc.returncode != 0:
                failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
                print("\n".join(failed[:20]), flush=True)
    finally:
        for b in burners:
            b.terminate()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    passed = sum(r["exit"] == 0 for r in results)
    print(f"{passed} of {len(results)} runs passed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
