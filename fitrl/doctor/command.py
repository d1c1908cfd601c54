"""``fitrl doctor [--device auto|cpu|cuda] [--only RUNG ...] [--skip RUNG ...] [--json PATH]
[--timeout-s S] [--ray-address ADDR] [--work-dir DIR]``.

Wired into the main parser by ``fitrl.cli`` through :func:`add_doctor_command`. Exit status: 0
when every rung that ran passed, 1 when one failed, 2 on input this node cannot serve (no GPU
where ``--device cuda`` asks for one, a Ray address that does not answer, an unknown rung),
raised as :class:`~fitrl.doctor.ladder.DoctorInputError` (one line, no traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Optional

from fitrl.doctor.ladder import BY_NAME, DoctorInputError, Result, pick

CPU_WORLD = 2
"""Processes of the CPU node's collective, FSDP2 and checkpoint rungs (gloo): two, the fewest that
shard, and what a 2-core CI machine runs."""
RAY_PROBE_S = 3.0


def add_doctor_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "doctor", help="self-test this node before a real run: devices, collectives, FSDP2, checkpoints, the "
                       "engine, the memory plan, attention kernels (one line per rung, docs/doctor.md)",
        description="A ladder of rungs, each one line: pass, fail with its cause and fix, or skip with the reason. "
                    "Each runs in processes of its own under its own time limit; a rung whose prerequisite failed "
                    f"is skipped. Rungs: {', '.join(BY_NAME)}. Exit status 0: every rung that ran passed; "
                    "1: one failed; 2: bad input.")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA where this machine has it, else CPU (default)")
    p.add_argument("--only", nargs="+", default=[], metavar="RUNG", help="run only these rungs")
    p.add_argument("--skip", nargs="+", default=[], metavar="RUNG", help="leave these rungs out")
    p.add_argument("--json", metavar="PATH", help="write the report here (JSON)")
    p.add_argument("--timeout-s", type=float, default=None, metavar="S",
                   help="each rung's time limit (default: the rung's own, 1 to 10 minutes)")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="a running Ray cluster (HOST:PORT, or auto for the one started on this node): the "
                        "all-reduce across its nodes (rung ray)")
    p.add_argument("--work-dir", metavar="DIR", help="keep the tiny model, the ranks' logs and checkpoints here "
                                                     "(default: a temporary directory, removed at the end)")
    p.set_defaults(fn=cmd_doctor)
    return p


def cmd_doctor(args: argparse.Namespace) -> int:
    rungs = pick(_names(args.only), _names(args.skip))
    if args.timeout_s is not None and args.timeout_s <= 0:
        raise DoctorInputError(f"--timeout-s {args.timeout_s:g}: must be > 0")
    device, world, cpu_because = resolve_device(args.device)
    if args.ray_address and any(r.name == "ray" for r in rungs):
        check_ray_address(args.ray_address)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="fitrl-doctor-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, rungs, device, world, work.resolve(), cpu_because)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, rungs, device: str, world: int, work: Path, cpu_because: str) -> int:
    from fitrl.doctor.runner import run_ladder

    started = time.perf_counter()
    print(f"fitrl doctor: {platform.node()}, {device}, {world} rank(s) for the node's rungs; {len(rungs)} rung(s)",
          flush=True)
    model_dir = make_model(work) if any(r.needs_model for r in rungs) else None
    results = run_ladder(rungs, device=device, world=world, work=work, model_dir=model_dir,
                         options={"ray_address": args.ray_address, "cpu_because": cpu_because}, limit_s=args.timeout_s,
                         out=lambda r: print(r.line(), flush=True), known=known_skips(args))
    status = 1 if any(r.status == "fail" for r in results) else 0
    took = time.perf_counter() - started
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "skip")}
    where = f"; report: {args.json}" if args.json else ""
    print(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped in {took:.0f} s{where}")
    if args.json:
        write_report(Path(args.json), results, device=device, world=world, seconds=took, status=status)
    return status


def known_skips(args: argparse.Namespace) -> dict[str, Result]:
    """Skips the parent can tell without starting a rung's processes."""
    if not args.ray_address:
        return {"ray": Result("ray", "skip", "no --ray-address given: this node only")}
    return {}


def _names(values: list[str]) -> list[str]:
    """``--only a b`` and ``--only a,b`` alike."""
    return [n.strip() for v in values for n in v.split(",") if n.strip()]


def resolve_device(asked: str) -> tuple[str, int, str]:
    """(cpu | cuda, ranks of the node's rungs, why the CPU where it is). Asking whether CUDA is
    there creates no CUDA context in this process (the parent never computes on a device)."""
    import torch

    if asked == "cpu":
        return "cpu", CPU_WORLD, "--device cpu"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count:
        return "cuda", count, ""
    why = ("this torch is built without CUDA" if torch.version.cuda is None else
           f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device, "
           f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}")
    if asked == "cuda":
        raise DoctorInputError(f"--device cuda: no CUDA device here ({why}); run it on a GPU node, or --device cpu")
    return "cpu", CPU_WORLD, why


def check_ray_address(address: str) -> None:
    """A Ray address that does not answer is bad input: probed with a TCP connect before Ray is
    imported (a Ray client waits a minute or more for an absent cluster)."""
    if address == "auto":
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if not current.is_file():
            raise DoctorInputError("--ray-address auto: no Ray cluster was started on this node (no "
                                   f"{current}); start one with `ray start --head`, or give HOST:PORT")
        address = current.read_text().strip()
    host, port = _host_port(address)
    try:
        socket.create_connection((host, port), timeout=RAY_PROBE_S).close()
    except OSError as e:
        raise DoctorInputError(f"--ray-address {address}: nothing answers at {host}:{port} "
                               f"({e.strerror or type(e).__name__}); start the cluster (`ray start --head` on its head "
                               "node) or give the address `ray status` shows") from None


def _host_port(address: str) -> tuple[str, int]:
    client = address.startswith("ray://")
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    try:
        return host, int(port) if port else (10001 if client else 6379)
    except ValueError:
        raise DoctorInputError(f"--ray-address {address}: not HOST:PORT (e.g. 10.0.0.1:6379)") from None


def make_model(work: Path) -> Path:
    """The tiny policy every model rung shares, built once here (nothing is downloaded): head size
    32, which vLLM's kernels run on CPU and GPU alike."""
    from fitrl.models.tiny import make_tiny_model

    out = work / "tiny-qwen2"
    if not (out / "config.json").is_file():
        log = work / "logs" / "model.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f, contextlib.redirect_stderr(f):  # (transformers' progress bars)
            make_tiny_model(out, arch="qwen2", size="tiny", seed=0, head_dim=32)
    return out


def write_report(path: Path, results: list[Result], *, device: str, world: int, seconds: float,
                 status: int, extra: Optional[dict] = None) -> None:
    import fitrl

    report = {"fitrl": fitrl.__version__, "host": platform.node(), "device": device, "world": world,
              "seconds": round(seconds, 1), "exit_status": status, "rungs": [r.as_dict() for r in results],
              **(extra or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
