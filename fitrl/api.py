"""The Python API: ``fitrl.train(...)``, for people who drive training from a script or a
notebook (as TRL's ``GRPOTrainer(model=..., reward_funcs=[...], train_dataset=...)``).

It builds the same :class:`~fitrl.config.schema.FitrlConfig` the command line does (every check,
the memory plan and the run directory included) and runs the same loop. What a script has and a
YAML file cannot hold is turned into config:

- ``train_dataset`` / ``eval_dataset``: a list of row dicts, or anything with ``to_list()`` (a
  ``datasets.Dataset``), written once as JSON lines into ``<output_dir>/datasets/`` (named by their
  content, so a rerun resumes from the same files);
- ``reward_funcs``: Python callables, TRL's ``fn(completions, **columns)`` or fitrl's
  ``fn(response, answer)``, summed with ``reward_weights`` and logged one component each
  (:mod:`fitrl.rewards.python`); they are scored in this process. An entry that is a path is a
  local reward model directory (TRL takes a model id there): a ``reward.sources`` entry of kind
  ``model`` (``rm``, ``rm2``, ...) with its weight, beside the callables' source ``functions``
  (docs/reward-models.md).

Quick start: docs/python-api.md.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from fitrl.config import ConfigError, load_config
from fitrl.core.nested import flatten

Rows = Union[Sequence[Mapping[str, Any]], Any]


def train(config: Union[None, str, Path, Mapping[str, Any]] = None, *, model: Optional[str] = None,
          train_dataset: Optional[Rows] = None, eval_dataset: Optional[Rows] = None,
          reward_funcs: Optional[Sequence[Union[Callable[..., Any], str, Path]]] = None,
          reward_weights: Optional[Sequence[float]] = None,
          overrides: Union[Mapping[str, Any], Sequence[str], None] = None) -> list[dict[str, float]]:
    """Train and return each step's metrics (``metrics.jsonl`` holds them too).

    ``config``: a YAML path, a nested dict of sections, or None (the defaults). ``model``: a local
    checkpoint directory (``actor.model.path``). ``overrides``: dotted keys, as a dict
    (``{"rollout.n": 4}``) or ``key=value`` strings; they win over ``config``.
    """
    import fitrl.rollout  # noqa: F401  (registers the engines: rollout.engine is checked on load)
    from fitrl.trainer.run import train as run

    items = _dotted(config) if isinstance(config, Mapping) else []
    items += _dotted(overrides) if isinstance(overrides, Mapping) else list(overrides or [])
    if model is not None:
        items.append(f"actor.model.path={model}")
    path = str(config) if isinstance(config, (str, Path)) else None
    cfg = load_config(path, items)
    out = Path(cfg.trainer.output_dir) / "datasets"
    extra = []
    if train_dataset is not None:
        extra.append(f"data.train_files=[{_write_rows(train_dataset, out, 'train')}]")
    if eval_dataset is not None:
        extra.append(f"data.val_files=[{_write_rows(eval_dataset, out, 'eval')}]")
    if reward_funcs is not None:
        extra += _reward_items(list(reward_funcs), reward_weights, cfg.data.answer_key)
    if extra:
        cfg = load_config(path, items + extra)
    return run(cfg)


def _reward_items(funcs: list, weights: Optional[Sequence[float]], answer_key: str) -> list[str]:
    """The overrides ``reward_funcs`` stands for: the callables as one batched Python reward, and
    each path as a reward model source."""
    from fitrl.rewards.python import register_python_rewards

    weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights has {len(weights)} weights for {len(funcs)} reward functions")
    paths = [(f, w) for f, w in zip(funcs, weights) if isinstance(f, (str, Path))]
    calls = [(f, w) for f, w in zip(funcs, weights) if not isinstance(f, (str, Path))]
    items = []
    if calls:
        name = register_python_rewards([f for f, _ in calls], [w for _, w in calls], answer_key=answer_key)
        items += [f"reward.function={name}", "reward.batched=true", "reward.num_workers=0"]
    if not paths:
        return items
    if calls:  # the callables' weighted sum is one source beside the models
        items += ["reward.sources.functions.kind=function", "reward.sources.functions.weight=1.0"]
    for i, (path, w) in enumerate(paths):
        name = "rm" if i == 0 else f"rm{i + 1}"
        items += [f"reward.sources.{name}.kind=model", f"reward.sources.{name}.model.path={path}",
                  f"reward.sources.{name}.weight={w}"]
    return items


def _dotted(values: Mapping[str, Any]) -> list[str]:
    """``{"rollout": {"n": 4}}`` or ``{"rollout.n": 4}`` -> ``["rollout.n=4"]``."""
    return [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in flatten(values).items()]


def _write_rows(rows: Rows, folder: Path, split: str) -> Path:
    """The rows as JSON lines, named by their content."""
    if isinstance(rows, (str, Path)):
        return Path(rows)
    listed = rows.to_list() if hasattr(rows, "to_list") else list(_as_iterable(rows))
    if not listed:
        raise ConfigError(f"{split}_dataset has no rows")
    try:
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in listed)
    except TypeError as e:
        raise ConfigError(f"{split}_dataset: a row is not JSON data ({e}); save it as parquet and pass the path, "
                          f"or give rows of plain values") from None
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"{split}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.jsonl"
    if not file.exists():
        tmp = file.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(file)
    return file


def _as_iterable(rows: Any) -> Iterable:
    if isinstance(rows, Mapping) or not hasattr(rows, "__iter__"):
        raise ConfigError("a dataset must be a list of row dicts, a datasets.Dataset, or a file path")
    return rows
