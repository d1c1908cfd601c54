"""The Python API: ``fitrl.train(...)``, for people who drive training from a script or a
notebook (as TRL's ``GRPOTrainer(model=..., reward_funcs=[...], train_dataset=...)``).

It builds the same :class:`~fitrl.config.schema.FitrlConfig` the command line does (every check,
the memory plan and the run directory included) and runs the same loop. What a script has and a
YAML file cannot hold is turned into config:

- ``train_dataset`` / ``eval_dataset``: a list of row dicts, or anything with ``to_list()`` (a
  ``datasets.Dataset``), written once as JSON lines into ``<output_dir>/datasets/`` (named by their
  content, so a rerun resumes from the same files);
- ``reward_funcs``: a callable or a list, each in TRL's signature (``prompts``, ``completions``,
  ``completion_ids``, the dataset's columns and ``trainer_state`` as keyword arguments) or fitrl's
  ``fn(response, answer)``, summed with ``reward_weights`` and logged one component each
  (:mod:`fitrl.rewards.python`); they are scored in this process. The columns they name are
  checked on the user's rows before anything loads, and no answer column is needed when none
  reads one. An entry that is a path is a
  local reward model directory (TRL takes a model id there): a ``reward.sources`` entry of kind
  ``model`` (``rm``, ``rm2``, ...) with its weight, beside the callables' source ``functions``
  (docs/reward-models.md).
- TRL's ``GRPOConfig`` names (``args=fitrl.GRPOConfig(...)`` or keyword arguments): fitrl's keys
  (:mod:`fitrl.config.trl_names`);
- ``teacher_model`` (TRL's ``DistillationTrainer(teacher_model=...)``; its configs'
  ``teacher_model_name_or_path``): the teacher of on-policy distillation, ``teacher.model.path``,
  trained toward with ``algorithm.distill.weight`` (docs/algorithms.md); a teacher given with the
  weight left at 0 (which builds none) is one line.

Quick start: docs/python-api.md.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from fitrl.config import ConfigError, load_config
from fitrl.config.trl_names import GRPOConfig, trl_items
from fitrl.core.nested import flatten
from fitrl.rewards.python import ROW_KEY, TrlInputs, check_columns, register_python_rewards

Rows = Union[Sequence[Mapping[str, Any]], Any]
RewardFunc = Union[Callable[..., Any], str, Path]


def _lmbda(v: Any) -> Optional[str]:
    if float(v) == 1.0:
        return None
    return (f"lmbda={v}: GKD's fraction of batches the student generates; fitrl distills on the student's own "
            f"samples only (lmbda=1): drop it")


def _seq_kd(v: Any) -> Optional[str]:
    return "seq_kd=True: fitrl has no sequence-level KD on the teacher's generations; drop it" if v else None


TRL_DISTILL: dict[str, Callable[[Any], Optional[str]]] = {"lmbda": _lmbda, "seq_kd": _seq_kd}
"""Names of TRL's ``GKDConfig``/``DistillationConfig`` fitrl.train takes beside ``GRPOConfig``'s:
each value -> None (what fitrl does anyway) or the one-line refusal. ``teacher_model_name_or_path``
is ``teacher_model``; ``beta`` stays GRPOConfig's KL weight (fitrl's divergence is
``algorithm.distill.loss``: docs/python-api.md)."""


def train(config: Union[None, str, Path, Mapping[str, Any]] = None, *, model: Optional[str] = None,
          teacher_model: Optional[str] = None, train_dataset: Optional[Rows] = None, eval_dataset: Optional[Rows] = None,
          reward_funcs: Union[RewardFunc, Sequence[RewardFunc], None] = None,
          reward_weights: Optional[Sequence[float]] = None, args: Union[GRPOConfig, Mapping[str, Any], None] = None,
          overrides: Union[Mapping[str, Any], Sequence[str], None] = None, **trl: Any) -> list[dict[str, float]]:
    """Train and return each step's metrics (``metrics.jsonl`` holds them too).

    ``config``: a YAML path, a nested dict of sections, or None (the defaults). ``model``: a local
    checkpoint directory or Hub id (``actor.model.path``); ``teacher_model``: the distillation
    teacher's (``teacher.model.path``, with ``algorithm.distill.weight`` > 0 in ``config`` or
    ``overrides``). ``args`` (a :class:`GRPOConfig` or a dict) and
    further keyword arguments: TRL's ``GRPOConfig`` names (``num_generations=4``,
    ``learning_rate=1e-6``), each mapped to fitrl's key (:mod:`fitrl.config.trl_names`).
    ``overrides``: dotted keys, as a dict (``{"rollout.n": 4}``) or ``key=value`` strings; they win
    over ``config`` and the TRL names.
    """
    import fitrl.rollout  # noqa: F401  (registers the engines: rollout.engine is checked on load)
    import fitrl.sharding  # noqa: F401  (registers the sharding backends and their planners)
    from fitrl.trainer.run import train as run

    given = {**(args.given() if isinstance(args, GRPOConfig) else dict(args or {})), **trl}
    teacher = _teacher(teacher_model, given)
    items = _dotted(config) if isinstance(config, Mapping) else []
    path = str(config) if isinstance(config, (str, Path)) else None
    user = _dotted(overrides) if isinstance(overrides, Mapping) else list(overrides or [])
    if model is not None:
        user.append(f"actor.model.path={model}")
    if teacher is not None:
        user.append(f"teacher.model.path={teacher}")
    train_rows, eval_rows = _rows(train_dataset, "train"), _rows(eval_dataset, "eval")
    if given:
        cfg = load_config(path, items + user)
        mapped = trl_items(given, None if train_rows is None else len(train_rows), cfg.data.rollout_batch_size)
        items += [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in mapped]
    items += user
    cfg = load_config(path, items)
    if teacher is not None and not cfg.algorithm.distill.enabled:
        raise ConfigError(f"teacher_model={teacher!r} with algorithm.distill.weight=0 builds no teacher: set "
                          f"overrides={{'algorithm.distill.weight': 1.0}} (pure distillation, as TRL's "
                          f"DistillationTrainer) or a weight in (0, 1) to mix it with the reward's policy loss")
    funcs = _as_list(reward_funcs)
    calls = [f for f in funcs if not isinstance(f, (str, Path))]
    extra = []
    answer_key = cfg.data.answer_key
    if calls:  # the columns the functions read, checked on the user's rows before anything loads
        needs_answer = False
        for rows, name in ((train_rows, "train_dataset"), (eval_rows, "eval_dataset")):
            if rows is not None:
                _check_prompts(rows, name, cfg.data.prompt_key, cfg.data.prompt_template)
                needs_answer |= check_columns(calls, _columns(rows), name, answer_key)
        present = [r for r in (train_rows, eval_rows) if r is not None]
        files = (train_dataset is not None and train_rows is None) or (eval_dataset is not None and eval_rows is None)
        if present and not files and not needs_answer and not all(answer_key in _columns(r) for r in present):
            answer_key = ""  # no answer column and no function that reads one (TRL needs none)
            extra.append('data.answer_key=""')
    out = Path(cfg.trainer.output_dir) / "datasets"
    prompts: dict[str, Any] = {}
    for rows, given_as, split, key in ((train_rows, train_dataset, "train", "train_files"),
                                       (eval_rows, eval_dataset, "eval", "val_files")):
        if rows is None and given_as is None:
            continue
        if rows is not None and calls:  # each row marked, so TRL's functions get its prompt as given
            rows = [{**r, ROW_KEY: f"{split}:{i}"} for i, r in enumerate(rows)]
            prompts.update({r[ROW_KEY]: r.get(cfg.data.prompt_key) for r in rows})
        extra.append(f"data.{key}=[{_write_rows(given_as if rows is None else rows, out, split)}]")
    if funcs:
        inputs = TrlInputs(prompts=prompts, conversational=_conversational(train_rows, cfg.data.prompt_key),
                           tokenizer_path=cfg.actor.model.path or None, max_steps=cfg.trainer.max_steps)
        extra += _reward_items(funcs, reward_weights, answer_key, inputs)
    if extra:
        cfg = load_config(path, items + extra)
    return run(cfg)


def _teacher(teacher_model: Optional[str], given: dict[str, Any]) -> Optional[str]:
    """The teacher named by ``teacher_model`` or TRL's ``teacher_model_name_or_path`` (taken out
    of ``given``, as are the other names of :data:`TRL_DISTILL`)."""
    named = given.pop("teacher_model_name_or_path", None)
    if named is not None and teacher_model is not None and str(named) != str(teacher_model):
        raise ConfigError(f"teacher_model={teacher_model!r} and teacher_model_name_or_path={named!r} name two "
                          f"teachers; give one")
    for name in [n for n in TRL_DISTILL if n in given]:
        refusal = TRL_DISTILL[name](given.pop(name))
        if refusal:
            raise ConfigError(refusal)
    teacher = teacher_model if teacher_model is not None else named
    return None if teacher is None else str(teacher)


def _as_list(funcs: Any) -> list:
    """``reward_funcs``: one callable or path (as TRL takes it), or a list of them."""
    if funcs is None:
        return []
    if callable(funcs) or isinstance(funcs, (str, Path)):
        return [funcs]
    if not isinstance(funcs, (list, tuple)):
        raise ConfigError(f"reward_funcs is {type(funcs).__name__}; give a callable, a reward model path, or a list "
                          f"of them")
    return list(funcs)


def _rows(rows: Optional[Rows], split: str) -> Optional[list[dict]]:
    """The rows given in the script as a list (None for a path or nothing)."""
    if rows is None or isinstance(rows, (str, Path)):
        return None
    listed = rows.to_list() if hasattr(rows, "to_list") else list(_as_iterable(rows))
    if not listed:
        raise ConfigError(f"{split}_dataset has no rows")
    for i, r in enumerate(listed):
        if not isinstance(r, Mapping):
            raise ConfigError(f"{split}_dataset row {i} is {type(r).__name__}; a dataset is a list of row dicts")
    return [dict(r) for r in listed]


def _columns(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))


def _check_prompts(rows: list[dict], name: str, prompt_key: str, template: Optional[str]) -> None:
    if template:
        return
    for i, r in enumerate(rows):
        if prompt_key not in r:
            raise ConfigError(f"{name} row {i} has no {prompt_key!r} column (columns: {', '.join(map(str, r))}); "
                              f"name the prompt column {prompt_key!r} or set data.prompt_key")


def _conversational(rows: Optional[list[dict]], prompt_key: str) -> bool:
    """TRL's rule: the prompts are chat messages (a list of role/content dicts)."""
    first = rows[0].get(prompt_key) if rows else None
    return isinstance(first, list) and bool(first) and isinstance(first[0], Mapping) and "role" in first[0]


def _reward_items(funcs: list, weights: Optional[Sequence[float]], answer_key: str,
                  inputs: Optional[TrlInputs] = None) -> list[str]:
    """The overrides ``reward_funcs`` stands for: the callables as one batched Python reward, and
    each path as a reward model source."""
    weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights has {len(weights)} weights for {len(funcs)} reward functions")
    paths = [(f, w) for f, w in zip(funcs, weights) if isinstance(f, (str, Path))]
    calls = [(f, w) for f, w in zip(funcs, weights) if not isinstance(f, (str, Path))]
    items = []
    if calls:
        name = register_python_rewards([f for f, _ in calls], [w for _, w in calls], answer_key=answer_key,
                                       inputs=inputs)
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


def _write_rows(rows: Union[list[dict], str, Path], folder: Path, split: str) -> Path:
    """The rows as JSON lines, named by their content."""
    if isinstance(rows, (str, Path)):
        return Path(rows)
    try:
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
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
