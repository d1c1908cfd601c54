"""The one reader of a model directory's ``config.json`` (:func:`read_config_json`) and the check
that a model path is a local directory (:func:`check_path`).

Kept apart from the validator (fitrl/models/check.py) so that what reads a model's config, the
model shape (fitrl/models/shape.py), the families (fitrl/models/families/) and the memory plan,
imports no checks: the validator imports the families to ask which model types they claim, and
the families import this module, so neither imports the other. Standard library only.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from fitrl.core.errors import ModelDirError


def check_path(path: str, what: str) -> Path:
    """``path`` is an existing local directory; ``what`` is its config key (``actor.model.path``)."""
    if not path:
        raise ModelDirError(f"{what} is empty: point it at a local Hugging Face model directory or a Hub id "
                            "(org/name), or make one with `fitrl make-tiny-model DIR`")
    p = Path(path)
    if not p.exists():
        # (a Hub id, org/name[@revision], never comes here: fitrl/models/hub.py resolved it to its snapshot)
        raise ModelDirError(f"{what}={path!r} does not exist (fitrl reads local directories only at a path like this; "
                            f"a Hugging Face Hub model is named org/name or org/name@revision){_near(p)}")
    if not p.is_dir():
        raise ModelDirError(f"{what}={path!r} is a file, not a directory: give the directory that holds it")
    return p


def read_config_json(path: str | Path, what: str = "actor.model.path") -> dict[str, Any]:
    """The parsed ``config.json`` of the model directory ``path`` (or that file itself): the one
    reader of it (the model shape, the families and the checks all come here), each failure a
    one-line :class:`ModelDirError` naming the file."""
    if Path(path).is_file():
        file = Path(path)
    else:
        file = check_path(str(path), what) / "config.json"
        if not file.is_file():
            raise ModelDirError(f"{what}={str(path)!r} is not a model directory (no config.json there); fitrl loads "
                                "local Hugging Face checkpoints only")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{file}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno}); restore the config.json "
                            "that came with the weights") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelDirError(f"cannot read {file}: {e}") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{file} holds a JSON {type(config).__name__}, not the object of a model config")
    return config


def _near(p: Path) -> str:
    """``; did you mean '/data/qwen2.5-7b'?`` when a sibling's name is close (a typo in the path)."""
    parent = p.parent
    if not parent.is_dir():
        return f" (nor does {parent})" if str(parent) not in ("", ".") else ""
    try:
        names = [c.name for c in parent.iterdir()]
    except OSError:
        return ""
    near = difflib.get_close_matches(p.name, names, n=1, cutoff=0.75)
    return f"; did you mean {str(parent / near[0])!r}?" if near else ""
