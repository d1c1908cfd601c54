"""The parent's side of ``fitrl doctor``: sessions of child processes, each rung under its limit.

Consecutive rungs of one session run in one launch of its processes (``python -m
fitrl.doctor.child``, one per device for ``node``, else one), so the node's ranks start and
import once for the collective, FSDP2 and checkpoint rungs. The parent watches the files the
ranks write (fitrl/doctor/child.py): a rung past its limit, or a rank that died, ends that launch
(the whole process group, with anything it started: vLLM's engine processes), that rung fails
with the cause, and the session's remaining rungs start again in fresh processes.

Subprocesses rather than ``multiprocessing``: a launch's own process group can be killed whole,
and each rank's output goes to its own log under the work directory (named in a failure).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import fitrl
from fitrl.doctor.ladder import STARTUP_S, Result, Rung, merge, skipped_for
from fitrl.distributed.process_group import free_port

POLL_S = 0.1


def run_ladder(rungs: list[Rung], *, device: str, world: int, work: Path, model_dir: Optional[Path],
               options: dict, limit_s: Optional[float] = None, out: Callable[[Result], None] = lambda r: None,
               startup_s: float = STARTUP_S, known: Optional[dict[str, Result]] = None) -> list[Result]:
    """Run ``rungs`` (ladder order), calling ``out`` with each result as it is known; ``known``:
    results the parent already has (a skip it can tell without starting processes)."""
    known = known or {}
    results: dict[str, Result] = {}
    i = 0
    while i < len(rungs):
        session = [rungs[i]]
        while i + len(session) < len(rungs) and rungs[i + len(session)].session == rungs[i].session:
            session.append(rungs[i + len(session)])
        i += len(session)
        pending = []
        for rung in session:  # prerequisites that failed in an earlier session: skipped here, no launch
            skip = known.get(rung.name) or (skipped_for(rung, results) if not pending else None)
            if skip is not None:
                results[rung.name] = skip
                out(skip)
            else:
                pending.append(rung)
        launch = 0
        while pending:
            size = world if pending[0].session == "node" else 1
            got = _launch(pending, size, device, work, model_dir, options, results, limit_s, launch, startup_s)
            launch += 1
            for r in got:
                results[r.rung] = r
                out(r)
            pending = pending[len(got):]
    return list(results.values())


def _launch(rungs: list[Rung], world: int, device: str, work: Path, model_dir: Optional[Path], options: dict,
            prior: dict[str, Result], limit_s: Optional[float], launch: int, startup_s: float) -> list[Result]:
    """One launch of a session's processes; the results of its rungs up to the first that ended
    the launch (timed out, or a rank died) included."""
    session = rungs[0].session
    state = work / "state" / f"{session}-{launch}"
    shutil.rmtree(state, ignore_errors=True)  # a kept --work-dir holds an earlier doctor's results
    state.mkdir(parents=True)
    logs = [work / "logs" / f"{session}-{launch}-rank{r}.log" for r in range(world)]
    logs[0].parent.mkdir(parents=True, exist_ok=True)
    spec = {"rungs": [r.name for r in rungs], "world": world, "device": device, "work": str(work),
            "model_dir": str(model_dir) if model_dir else None, "port": free_port(), "state": str(state),
            "options": {**options, "limit_s": limit_s}, "prior": {k: v.as_dict() for k, v in prior.items()}}
    (state / "spec.json").write_text(json.dumps(spec))
    procs = [_start(state / "spec.json", r, world, device, log) for r, log in enumerate(logs)]
    done: list[Result] = []
    started = time.time()
    try:
        for rung in rungs:
            limit = limit_s if limit_s else rung.limit_s
            while True:
                ranks = [state / f"{rung.name}.rank{r}.json" for r in range(world)]
                if all(p.exists() for p in ranks):
                    done.append(merge(rung.name, [Result(**json.loads(p.read_text())) for p in ranks]))
                    break
                marker = state / f"{rung.name}.start"
                t0 = float(marker.read_text()) if marker.exists() and marker.stat().st_size else None
                # a rank that exited 0 has written every result of its own (the others may still write theirs)
                dead = [(r, p.returncode) for r, p in enumerate(procs)
                        if p.poll() is not None and (p.returncode != 0 or not ranks[r].exists())]
                if dead:
                    rank, code = dead[0]
                    why = "was killed" if code < 0 else f"exited with code {code}"
                    done.append(_failed(rung, f"rank {rank}'s process {why} during this rung"
                                        + _last_line(logs[rank]), logs[rank], t0))
                    return done
                now = time.time()
                if t0 is not None and now - t0 > limit:
                    done.append(_failed(rung, f"timed out after {limit:.0f} s (its limit; --timeout-s sets it)",
                                        logs[0], t0, fix=TIMEOUT_FIX.get(rung.session, "")))
                    return done
                if t0 is None and not done and now - started > startup_s:
                    done.append(_failed(rung, f"its processes did not start within {startup_s:.0f} s"
                                        + _last_line(logs[0]), logs[0], started))
                    return done
                time.sleep(POLL_S)
        return done
    finally:
        for p in procs:
            _end(p)


TIMEOUT_FIX = {
    "node": "a collective that never completes: a peer that did not join, or NCCL unable to connect the GPUs; "
            "rerun with NCCL_DEBUG=INFO and check `nvidia-smi topo -m`",
    "ray": "a node's ranks did not all join: check that every node can reach the head's rendezvous port "
           "(firewall, NCCL_SOCKET_IFNAME)",
    "engine": "the engine's build or a generate never returned: its log (below) shows the last step",
}


def _failed(rung: Rung, cause: str, log: Path, t0: Optional[float], fix: str = "") -> Result:
    from fitrl.doctor.ladder import known_fix

    text = log.read_text(errors="replace") if log.exists() else ""
    return Result(rung.name, "fail", cause, fix or known_fix(text[-4000:]),
                  time.time() - t0 if t0 else 0.0, {"log": str(log), "log_tail": text[-2000:]})


def _last_line(log: Path) -> str:
    lines = [x for x in (log.read_text(errors="replace").splitlines() if log.exists() else []) if x.strip()]
    return f": {lines[-1].strip()[:300]}" if lines else ""


def _start(spec: Path, rank: int, world: int, device: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = str(Path(fitrl.__file__).resolve().parent.parent)  # the checkout or site-packages fitrl came from
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # --device cpu on a GPU node: the ranks never touch a GPU
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    with log.open("w") as f:
        return subprocess.Popen([sys.executable, "-m", "fitrl.doctor.child", str(spec), str(rank)],
                                stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _end(p: subprocess.Popen) -> None:
    """The rank and everything it started (its own process group, from ``start_new_session``),
    whether or not the rank itself has exited: an engine's worker processes may outlive it."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait()
