"""The rank's side of the start-up check that a run directory is one filesystem for every rank
(the driver's side: fitrl/trainer/rundir.py, ``check_shared``): a rank looks for the driver's
marker in the run directory as it sees it and, if it finds it, leaves its own beside it.

Here, below the roles, because a policy rank runs it (fitrl/roles/workers.py, ``run_dir_view``).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Optional

from fitrl.core.faults import own_disk

SHARE_DIR = ".fitrl-shared"  # the start-up check's markers, removed after it
DRIVER_MARK = "driver.json"


def rank_view(run_dir: str, token: str, rank: int) -> dict:
    """On a rank: does this process see the driver's marker of the check ``token`` in ``run_dir``?
    If so it leaves its own beside it; if not it writes nothing (its directory is not the
    driver's: nothing of this run should land on it)."""
    probe = own_disk(Path(run_dir), "run_dir") / SHARE_DIR / token
    view = {"rank": rank, "host": socket.gethostname(), "node_id": _ray_node_id(), "sees": str(probe)}
    try:
        seen = json.loads((probe / DRIVER_MARK).read_text()).get("token") == token
    except (OSError, ValueError):
        seen = False
    if seen:
        try:
            (probe / f"rank{rank}.json").write_text(json.dumps(view))
        except OSError as e:
            view["cannot_write"] = e.strerror or str(e)
    return {**view, "sees_driver": seen}


def _ray_node_id() -> Optional[str]:
    """The Ray node this process runs on, when it is a Ray worker (hosts of one machine share a name)."""
    ray = sys.modules.get("ray")
    try:
        return ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else None
    except Exception:  # not a Ray worker after all: the host name says enough
        return None
