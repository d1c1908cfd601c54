"""Restarts under fire: a 2-rank Ray run whose workers are SIGKILLed from outside at random
points, with ``trainer.max_restarts`` equal to the number of kills. At the end every step must
be in ``metrics.jsonl`` exactly once, with one ``restart`` event per kill.

    .venv/bin/python bench/restart_soak.py --steps 60 --kills 2 --compare   # issue 42's bar
    .venv/bin/python bench/restart_soak.py --steps 300 --kills 8            # the soak

The kill steps are drawn at random (``--seed``); at each, once the step before it is recorded, a
random ``ray::RankActor`` process (either rank) is SIGKILLed after a random part of a step's
time, so the kill lands in any phase: generation, the update, a checkpoint save. ``--compare``
also runs the same command never killed and compares every step's data-determined metrics and
the final weights, bit for bit (a checkpoint every step and exact resume on CPU make both exact).
Prints the steps, the kills, the restarts, the wall times. CPU only; the tiny model, built locally.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
EXACT_PREFIXES = ("actor/", "reward/", "response/", "advantage/", "returns/")  # (no times, no memory)


def command(model: Path, run_dir: Path, steps: int, restarts: int) -> list[str]:
    return [sys.executable, "-m", "fitrl.cli", "train", "examples/arith.yaml", f"actor.model.path={model}",
            f"trainer.run_dir={run_dir}", "data.val_files=[]", "data.rollout_batch_size=4", "rollout.n=2",
            "actor.mini_batch_size=4", "actor.micro_batch_size=2", "trainer.device=cpu", "trainer.backend=ray",
            "trainer.devices_per_node=2", "checkpoint.save_freq=1", "checkpoint.save_limit=2",
            f"trainer.max_steps={steps}", f"trainer.max_restarts={restarts}", "trainer.progress_bar=false",
            "memory.plan=off"]


def recorded_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if "reward/mean" in record:
            steps.append(record["step"])
    return steps


def rank_processes() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        title = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
        if title.startswith("ray::RankActor"):
            found.append(p)
    return found


def killer(run_dir: Path, kill_steps: list[int], rng: random.Random, done: threading.Event, log: list) -> None:
    """SIGKILL a random rank inside each of ``kill_steps`` (once each, whatever the rewinds)."""
    pending, last, step_s = sorted(kill_steps), (0, time.monotonic()), 1.0
    while pending and not done.is_set():
        steps = recorded_steps(run_dir)
        top = max(steps, default=0)
        if top > last[0]:  # a step's time, from the pace of the recorded ones
            now = time.monotonic()
            step_s = min(30.0, (now - last[1]) / (top - last[0])) if last[0] else step_s
            last = (top, now)
        if top >= pending[0] - 1:
            time.sleep(rng.uniform(0.0, step_s))
            ranks = rank_processes()
            if ranks:
                victim = rng.choice(ranks)
                try:
                    victim.send_signal(signal.SIGKILL)
                    log.append((pending.pop(0), victim.pid))
                except psutil.NoSuchProcess:
                    pass
                continue
        time.sleep(0.2)


def run(model: Path, run_dir: Path, steps: int, kills: int, seed: int) -> tuple[int, float, str, list]:
    rng = random.Random(seed)
    kill_steps = sorted(rng.sample(range(2, steps), kills)) if kills else []
    done, log = threading.Event(), []
    thread = threading.Thread(target=killer, args=(run_dir, kill_steps, rng, done, log), daemon=True)
    start = time.perf_counter()
    proc = subprocess.Popen(command(model, run_dir, steps, kills), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)
    thread.start()
    out = proc.communicate()[0]
    done.set()
    thread.join()
    return proc.returncode, time.perf_counter() - start, out, log


def records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]


def final_weights(run_dir: Path, steps: int, out: Path) -> dict:
    from safetensors.torch import load_file

    from fitrl.checkpoint.export import export_checkpoint

    export_checkpoint(str(run_dir / "checkpoints" / f"step_{steps}"), str(out))
    tensors = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def compare(killed: Path, plain: Path, steps: int, tmp: Path) -> tuple[bool, str]:
    a, b = records(killed), records(plain)
    keys = sorted(k for k in b[0] if k.startswith(EXACT_PREFIXES))
    differ = [(x["step"], k) for x, y in zip(a, b) for k in keys if x.get(k) != y.get(k)]
    wa, wb = final_weights(killed, steps, tmp / "w-killed"), final_weights(plain, steps, tmp / "w-plain")
    import torch

    same = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return not differ and same, (f"{len(keys)} data-determined metrics x {len(b)} steps: {len(differ)} differ{f' {differ[:5]}' if differ else ''}; "
            f"final weights ({len(wa)} tensors) bitwise equal: {same}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kills", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="draws the kill steps, the delays and the victims")
    p.add_argument("--compare", action="store_true", help="also run it never killed; compare metrics and weights")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "tiny"
        subprocess.run([sys.executable, "-m", "fitrl.cli", "make-tiny-model", str(model)], check=True,
                       capture_output=True, cwd=ROOT)
        code, took, out, log = run(model, tmp / "soak", args.steps, args.kills, args.seed)
        steps = recorded_steps(tmp / "soak")
        restarts = [r for r in map(json.loads, (tmp / "soak" / "metrics.jsonl").read_text().splitlines())
                    if r.get("event") == "restart"]
        ok = code == 0 and steps == list(range(1, args.steps + 1)) and len(restarts) == len(log)
        print(f"exit {code}; {len(steps)} steps recorded, {len(set(steps))} distinct, every step once: "
              f"{steps == list(range(1, args.steps + 1))}; kills aimed at steps {[s for s, _ in log]}; "
              f"{len(restarts)} restarts (at checkpoints {[r['step'] for r in restarts]}); {took:.0f} s")
        for r in restarts:
            print(f"  restart {r['restart']}: {r['cause'][:160]}")
        if args.compare:
            plain_code, plain_s, plain_out, _ = run(model, tmp / "plain", args.steps, 0, args.seed)
            ok = ok and plain_code == 0
            print(f"never killed: exit {plain_code}, {plain_s:.0f} s; a restart cost "
                  f"{(took - plain_s) / max(1, len(restarts)):.0f} s on average")
            equal, text = compare(tmp / "soak", tmp / "plain", args.steps, tmp)
            ok = ok and equal
            print(text)
        if not ok:
            print(out[-4000:])
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
