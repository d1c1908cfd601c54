"""Where fitrl keeps what it measures or computes once per machine (plans, the CPU's peak FLOP/s):
``$FITRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/fitrl``, else ``~/.cache/fitrl``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("FITRL_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "fitrl")
    return Path(root)
