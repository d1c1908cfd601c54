"""Tiny models built in a child process, for benches that measure the memory of the process that
runs the training: built in that process, the random weights' freed pages and the builder's
objects stay in its heap and count against its plan (the Ray driver measured 0.08 GiB over its
plan for this reason alone, bench/RESULTS.md "Plan against telemetry per Ray process")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tiny_model_in_child(path: Path, **kwargs) -> Path:
    """:func:`fitrl.models.tiny.make_tiny_model` (``path``, ``**kwargs``: JSON values) in a fresh
    interpreter; returns ``path``."""
    code = ("import json, sys; from fitrl.models.tiny import make_tiny_model; "
            "make_tiny_model(sys.argv[1], **json.loads(sys.argv[2]))")
    subprocess.run([sys.executable, "-c", code, str(path), json.dumps(kwargs)], check=True, cwd=ROOT)
    return Path(path)
