"""The harness of the bad-input tables (``tests/test_bad_*.py``, issue 12).

A case is a user's mistake or an injected fault, run through the real command line. Every case
must end with

* the expected exit status (2 for a user's mistake, 1 for a run stopped for a reason, 130/143
  for signals),
* no Python traceback on stderr (unless the case says a traceback is the point),
* a message matching ``message`` (a regular expression searched in stderr + stdout),
* nothing damaged: every file of the workspace's existing run directory (a complete checkpoint,
  ``metrics.jsonl``, ``config.yaml``) has the digest it had before, unless the case lists it in
  ``may_change``.

Each case gets a fresh :class:`Workspace` in its own temporary directory: a copy of a tiny model,
the toy data, a config pointing at both, and a finished two-step run with a complete checkpoint
(built once per session, copied per case). ``prepare(ws)`` breaks something and returns the
command-line arguments (without the leading ``fitrl``).

Cases run in this process through ``fitrl.cli.main`` (fast: no re-import of torch), or in a
subprocess (``subprocess=True``) when they need signals, a second run at the same time, or a
crash that would take pytest down.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import yaml

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data"


@dataclass
class Workspace:
    root: Path
    model: Path      # a private copy of the tiny model: break it freely
    data: Path       # a private copy of examples/data
    run: Path        # a finished run: config.yaml, metrics.jsonl, checkpoints/step_2 (complete)
    config: Path     # YAML pointing at model, data and a fresh run directory (root / "new-run")

    def write_config(self, **sections) -> Path:
        """Rewrite ``config`` with some sections replaced or extended (nested dicts merge)."""
        cfg = yaml.safe_load(self.config.read_text())
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key].update(value)
            else:
                cfg[key] = value
        self.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return self.config

    def train_args(self, *overrides: str, run_dir: Optional[Path] = None) -> list[str]:
        """``train CONFIG`` on the fresh run directory (or ``run_dir``), the plan off, quiet."""
        return ["train", str(self.config), f"trainer.run_dir={run_dir or self.root / 'new-run'}", *overrides]


@dataclass
class Case:
    id: str
    category: str
    prepare: Callable[[Workspace], list[str]]
    message: str                 # regex searched in stderr + stdout
    exit: int = 2
    subprocess: bool = False
    traceback: bool = False      # True only for cases where a traceback is expected (internal errors)
    may_change: tuple[str, ...] = ()   # paths relative to ws.run allowed to change
    env: dict = field(default_factory=dict)
    timeout: float = 300.0       # subprocess cases: 10x slack over a quiet run
    check: Optional[Callable[[Workspace, "Outcome"], None]] = None   # extra assertions

    def __str__(self) -> str:
        return self.id


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str


def base_config(model: Path, data: Path) -> dict:
    cfg = yaml.safe_load((ROOT / "examples" / "arith.yaml").read_text())
    cfg["data"].update(train_files=[str(data / "arith_train.jsonl")], val_files=[str(data / "arith_val.jsonl")])
    cfg["actor"]["model"]["path"] = str(model)
    cfg["trainer"].update(max_steps=2, val_freq=0, progress_bar=False, num_threads=1)
    cfg.setdefault("memory", {})["plan"] = "off"
    cfg["rollout"]["n"] = 4
    cfg["data"]["rollout_batch_size"] = 4
    cfg["actor"].update(mini_batch_size=4, micro_batch_size=16)
    return cfg


def make_finished_run(tmp: Path, model: Path) -> Path:
    """A two-step run with a complete checkpoint at step 2 (done once per session)."""
    from fitrl.cli import main

    cfg_path = tmp / "finished.yaml"
    cfg = base_config(model, DATA)
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run = tmp / "finished-run"
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", str(cfg_path), f"trainer.run_dir={run}"])
    assert code == 0 and (run / "checkpoints").is_dir(), "the finished run of the bad-input tables failed"
    return run


def new_workspace(root: Path, model: Path, finished_run: Path) -> Workspace:
    ws = Workspace(root=root, model=root / "model", data=root / "data", run=root / "run", config=root / "run.yaml")
    shutil.copytree(model, ws.model)
    shutil.copytree(DATA, ws.data)
    shutil.copytree(finished_run, ws.run)
    ws.config.write_text(yaml.safe_dump(base_config(ws.model, ws.data), sort_keys=False))
    return ws


def edit_json(path: Path, **changes) -> None:
    """Rewrite a JSON file with keys changed (``...`` removes a key): a fault in one line."""
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data, indent=2))


def digests(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def run_cli(args: list[str], *, subprocess_: bool, env: dict, timeout: float, cwd: Path) -> Outcome:
    if subprocess_:
        proc = subprocess.run([sys.executable, "-m", "fitrl.cli", *args], cwd=cwd, capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=timeout)
        return Outcome(proc.returncode, proc.stdout, proc.stderr)
    from fitrl.cli import main

    out, err = io.StringIO(), io.StringIO()
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as e:  # argparse
                code = e.code if isinstance(e.code, int) else 2
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return Outcome(code, out.getvalue(), err.getvalue())


def run_case(case: Case, ws: Workspace) -> Outcome:
    before = digests(ws.run)
    args = case.prepare(ws)
    outcome = run_cli(args, subprocess_=case.subprocess, env=case.env, timeout=case.timeout, cwd=ws.root)
    text = outcome.stderr + outcome.stdout
    where = f"case {case.id}: exit {outcome.code}\n--- stderr ---\n{outcome.stderr[-4000:]}\n--- stdout ---\n{outcome.stdout[-2000:]}"
    assert outcome.code == case.exit, where
    if not case.traceback:
        assert "Traceback (most recent call last)" not in text, where
    assert re.search(case.message, text, re.S), f"message /{case.message}/ not found\n{where}"
    after = digests(ws.run)
    # prompts.jsonl (each step's rows) is rewritten with metrics.jsonl, by the same resumes
    may_change = case.may_change + (("prompts.jsonl",) if "metrics.jsonl" in case.may_change else ())
    damaged = sorted(k for k, v in before.items() if k not in may_change and after.get(k) != v)
    assert not damaged, f"case {case.id} changed or removed files of the existing run: {damaged}\n{where}"
    if case.check is not None:
        case.check(ws, outcome)
    return outcome
