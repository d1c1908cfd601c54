"""One rank of a ``fitrl doctor`` session: ``python -m fitrl.doctor.child SPEC.json RANK``.

Runs the session's rungs in order and writes each one's result to ``<state>/<rung>.rank<R>.json``
(a marker ``<rung>.start`` first, so the parent times the rung and not the imports). The ranks
of a multi-rank session wait for each other's results after every rung, so they all take the
same decision about the next one (a rank that went on alone would hang in a collective).

Test hooks (the parent passes the environment on): ``FITRL_DOCTOR_FAIL=rung[,rung]`` makes those
rungs raise, ``FITRL_DOCTOR_HANG=rung`` makes one never return (its time limit ends it).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fitrl.doctor.ladder import BY_NAME, Failure, Passed, Result, Skip, known_fix, merge, skipped_for

FAIL_ENV, HANG_ENV = "FITRL_DOCTOR_FAIL", "FITRL_DOCTOR_HANG"


@dataclass
class RankContext:
    """What a rung knows about where it runs."""

    rank: int
    world: int
    device_type: str                  # cpu | cuda
    work: Path                        # the doctor's work directory (shared by the ranks: one node)
    model_dir: Optional[Path] = None  # the tiny model the parent built (rungs with needs_model)
    port: int = 0                     # rank 0's rendezvous port (sessions with several ranks)
    options: dict = field(default_factory=dict)  # ray_address, ...
    _group: bool = False

    @property
    def device(self):
        import torch

        return torch.device("cuda", self.rank % torch.cuda.device_count()) if self.device_type == "cuda" \
            else torch.device("cpu")

    def group(self) -> str:
        """Join the session's process group (once) with the backend fitrl's workers use; its name."""
        from fitrl.distributed.process_group import DistEnv, default_backend, init_distributed

        backend = default_backend(self.device_type == "cuda")
        if not self._group:
            env = DistEnv(self.rank, self.world, self.rank, self.world, "127.0.0.1", self.port)
            init_distributed(env, backend, timeout_s=max(60.0, float(self.options.get("limit_s") or 0)))
            self._group = True
        return backend


def run_rung(name: str, ctx: RankContext) -> Result:
    rung = BY_NAME[name]
    t0 = time.perf_counter()
    try:
        if name in _listed(FAIL_ENV):
            raise RuntimeError(f"injected failure ({FAIL_ENV}={os.environ[FAIL_ENV]})")
        if name in _listed(HANG_ENV):
            time.sleep(10**6)
        module, fn = rung.fn.split(":")
        got: Passed = getattr(importlib.import_module(module), fn)(ctx)
        result = Result(name, "pass", got.detail, data=got.data)
    except Skip as e:
        result = Result(name, "skip", str(e))
    except Failure as e:
        result = Result(name, "fail", e.cause, e.fix or known_fix(e.cause), data=e.data)
    except Exception as e:  # any other error is this rung's cause; its traceback goes to the log
        traceback.print_exc()
        text = f"{type(e).__name__}: {_first_line(e)}"
        result = Result(name, "fail", text, known_fix(f"{text} {e}"))
    result.seconds = time.perf_counter() - t0
    return result


def _listed(env: str) -> set[str]:
    return {x.strip() for x in os.environ.get(env, "").split(",") if x.strip()}


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or repr(e)
    return text.splitlines()[0][:400]


def _write(path: Path, result: Result) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.as_dict()))
    tmp.replace(path)  # the parent never reads half a file


def _wait_for_ranks(state: Path, name: str, world: int) -> list[Result]:
    paths = [state / f"{name}.rank{r}.json" for r in range(world)]
    while not all(p.exists() for p in paths):  # the parent's time limit ends a wait that never returns
        time.sleep(0.05)
    return [Result(**json.loads(p.read_text())) for p in paths]


def main(spec_path: str, rank: int) -> int:
    spec = json.loads(Path(spec_path).read_text())
    state = Path(spec["state"])
    ctx = RankContext(rank=rank, world=spec["world"], device_type=spec["device"], work=Path(spec["work"]),
                      model_dir=Path(spec["model_dir"]) if spec.get("model_dir") else None, port=spec["port"],
                      options=spec.get("options", {}))
    results = {k: Result(**v) for k, v in spec.get("prior", {}).items()}
    for name in spec["rungs"]:
        result = skipped_for(BY_NAME[name], results)
        if result is None:
            if rank == 0:
                (state / f"{name}.start").write_text(str(time.time()))
            result = run_rung(name, ctx)
        _write(state / f"{name}.rank{rank}.json", result)
        results[name] = merge(name, _wait_for_ranks(state, name, ctx.world)) if ctx.world > 1 else result
    sys.stdout.flush()
    sys.stderr.flush()
    # No teardown: the results are written, and destroying a process group or an engine whose peer
    # failed can block for minutes. The process's exit frees its devices.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
