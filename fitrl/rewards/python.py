"""Reward functions given as Python callables (``fitrl.train(reward_funcs=...)``), in either of two
shapes, told apart by the signature:

- TRL's (any of ``prompts``, ``completions``, ``completion_ids``, ``trainer_state`` among the
  parameters, or keyword arguments only): one call per batch with the keyword arguments TRL's
  ``GRPOTrainer`` documents, each a list over the batch: ``prompts`` (the prompt column as the
  dataset holds it: text or chat messages), ``completions`` (``[{"role": "assistant", "content":
  ...}]`` per completion when the prompts are conversational, the text otherwise),
  ``completion_ids`` (the completion's text tokenised again by the policy's tokenizer), every
  dataset column but the prompt by its name, and ``trainer_state`` (:class:`TrainerState`). A
  function taking ``**kwargs`` gets them all, one naming some gets those. It returns one float per
  completion (``None``: not applicable, counted 0 in the sum);
- fitrl's ``fn(response, answer) -> float | dict`` (a dict's ``score``), one call per completion.

Several functions are summed with ``reward_weights`` (default 1 each), each logged as a component
under its own name. A callable lives in this process, so it is scored here (``reward.num_workers=0``):
the registry below maps the name a config carries to the function, for this process only.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from fitrl.core.errors import ConfigError

PYTHON_REWARDS: dict[str, Callable[..., Any]] = {}
"""``python:<names>`` -> the batched function that scores with the given callables (this process only)."""
WANTS_SAMPLED_IDS: set[str] = set()
"""The names of :data:`PYTHON_REWARDS` with a TRL function that reads ``completion_ids``: only their
samples carry the sampled ids (:data:`SAMPLED_IDS_KEY`), a response's worth of ints each."""

TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state")
"""What TRL's GRPOTrainer passes besides the dataset's columns."""

ROW_KEY = "_fitrl_row"
SAMPLED_IDS_KEY = "_fitrl_completion_ids"
"""In each sample's ``extra``: the token ids the policy sampled (response mask applied), what
TRL's ``completion_ids`` are (fitrl/roles/reward_sources.py puts them there)."""
STEP_KEY = "_fitrl_step"
"""In each sample's ``extra`` of a training step's rollout: that step (1-based; absent in validation)."""
"""The column ``fitrl.train`` adds to the rows it writes (``train:3``): which row a completion
answers, so ``prompts`` are the prompts as the user's dataset holds them. Never passed on."""


@dataclass
class TrainerState:
    """What a TRL reward function reads from ``trainer_state``: ``global_step``, the optimizer steps
    completed before the rollout being scored (every dynamic-sampling round of a step sees the same;
    a resumed run goes on from its checkpoint's; validation sees the last training call's), and
    ``max_steps`` (``trainer.max_steps``)."""

    global_step: int = 0
    max_steps: int = 0


@dataclass
class TrlInputs:
    """What the TRL arguments are made of, known when ``fitrl.train`` registers the functions."""

    prompts: dict[str, Any] = field(default_factory=dict)
    """:data:`ROW_KEY` value -> the row's prompt as the user's dataset holds it."""
    conversational: bool = False
    """The prompts are chat messages: completions are passed as messages too (TRL's rule)."""
    tokenizer_path: Optional[str] = None
    """The policy's checkpoint, whose tokenizer makes ``completion_ids`` for a call outside a run
    (a run hands the sampled ids in: :data:`SAMPLED_IDS_KEY`; loaded on first use)."""
    max_steps: int = 0


def is_trl_style(fn: Callable[..., Any]) -> bool:
    """TRL's signature (a TRL argument by name, or no positional parameter a value must fill)
    rather than fitrl's ``fn(response, answer)``."""
    params = _parameters(fn)
    if params is None:
        return False
    if any(n in params for n in TRL_ARGUMENTS):
        return True
    return not any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
                   for p in params.values())


def check_columns(fns: Sequence[Callable[..., Any]], columns: Sequence[str], dataset: str, answer_key: str) -> bool:
    """Every column a function needs is in ``dataset``'s ``columns``, else one line naming the
    function, the dataset and the column. Returns whether an answer column is needed (a fitrl-style
    function's ``answer``)."""
    names = _unique([getattr(f, "__name__", "reward") for f in fns])
    have = ", ".join(c for c in columns if c != ROW_KEY)
    needs_answer = False
    for fn, name in zip(fns, names):
        if not is_trl_style(fn):
            needs_answer = True
            if answer_key not in columns:
                raise ConfigError(f"reward function {name}(response, answer) needs an answer, but {dataset} has no "
                                  f"{answer_key!r} column (columns: {have}); set data.answer_key to the column that "
                                  f"holds it, or write {name}(completions, <column>, **kwargs) as TRL does")
            continue
        for p in _parameters(fn).values():
            if (p.name in TRL_ARGUMENTS or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty
                    or p.name in columns):
                continue
            raise ConfigError(f"reward function {name} takes {p.name!r}, but {dataset} has no {p.name!r} column "
                              f"(columns: {have}); rename the column or the parameter")
    return needs_answer


def register_python_rewards(fns: Sequence[Callable[..., Any]], weights: Optional[Sequence[float]] = None,
                            answer_key: str = "answer", inputs: Optional[TrlInputs] = None) -> str:
    """Register ``fns`` (weighted) as one batched reward and return the name ``reward.function`` takes.
    ``answer_key``: the answer's column name as TRL functions see it ("": the rows have none)."""
    fns = list(fns)
    if not fns or not all(callable(f) for f in fns):
        raise ConfigError("reward_funcs must be a callable or a non-empty list of callables")
    weights = [1.0] * len(fns) if weights is None else [float(w) for w in weights]
    if len(weights) != len(fns):
        raise ConfigError(f"reward_weights has {len(weights)} weights for {len(fns)} reward functions")
    inputs = inputs if inputs is not None else TrlInputs()
    state = TrainerState(max_steps=inputs.max_steps)
    names = _unique([getattr(f, "__name__", "reward") for f in fns])
    calls = [_trl_caller(f, n, answer_key, inputs, state) if is_trl_style(f) else _per_sample(f)
             for f, n in zip(fns, names)]

    def combined(responses: list[str], answers: list[Any], extras: Optional[list[dict]] = None) -> list[dict]:
        extras = extras if extras is not None else [{} for _ in responses]
        steps = {e[STEP_KEY] for e in extras if STEP_KEY in e}
        if steps:  # a training step's rollout: the steps completed before it
            state.global_step = max(steps) - 1
        parts = [call(responses, answers, extras) for call in calls]
        return [{"score": sum(w * p[i] for w, p in zip(weights, parts)), **{n: p[i] for n, p in zip(names, parts)}}
                for i in range(len(responses))]

    name = "python:" + "+".join(names)
    PYTHON_REWARDS[name] = combined
    if any(is_trl_style(f) and _takes(f, "completion_ids") for f in fns):
        WANTS_SAMPLED_IDS.add(name)
    return name


def _trl_caller(fn: Callable[..., Any], name: str, answer_key: str, inputs: TrlInputs,
                state: TrainerState) -> Callable[[list, list, list], list[float]]:
    params = _parameters(fn)
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    wanted = lambda k: accepts_any or k in params  # noqa: E731
    tokenizer: list = []  # loaded on the first call that needs completion_ids

    def trl(responses: list[str], answers: list[Any], extras: list[dict]) -> list[float]:
        kwargs: dict[str, Any] = {}
        if wanted("prompts"):
            kwargs["prompts"] = [inputs.prompts.get(e.get(ROW_KEY)) for e in extras]
        kwargs["completions"] = ([[{"role": "assistant", "content": r}] for r in responses] if inputs.conversational
                                 else list(responses))
        if wanted("completion_ids") and all(SAMPLED_IDS_KEY in e for e in extras):
            kwargs["completion_ids"] = [list(e[SAMPLED_IDS_KEY]) for e in extras]
        elif wanted("completion_ids"):  # a call outside a run: the text tokenised again
            if not tokenizer:
                tokenizer.append(_tokenizer(inputs.tokenizer_path))
            kwargs["completion_ids"] = ([tokenizer[0](r, add_special_tokens=False)["input_ids"] for r in responses]
                                        if tokenizer[0] is not None else [None] * len(responses))
        if wanted("trainer_state"):
            kwargs["trainer_state"] = state
        columns: dict[str, list] = {answer_key: list(answers)} if answer_key else {}
        for key in dict.fromkeys(k for e in extras for k in e):
            if not key.startswith("_fitrl_"):  # (fitrl's own: the row, the sampled ids, the step)
                columns.setdefault(key, [e.get(key) for e in extras])
        kwargs.update({k: v for k, v in columns.items() if wanted(k) and k not in kwargs})
        if "completions" not in params and not accepts_any:
            del kwargs["completions"]
        out = fn(**kwargs)
        if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):
            out = out.tolist()
        if out is None or len(out) != len(responses):
            raise ValueError(f"reward function {name} returned {0 if out is None else len(out)} rewards for "
                             f"{len(responses)} completions")
        return [0.0 if v is None else float(v) for v in out]
    return trl


def _per_sample(fn: Callable[..., Any]) -> Callable[[list, list, list], list[float]]:
    def per_sample(responses: list[str], answers: list[Any], extras: list[dict]) -> list[float]:
        out = []
        for r, a in zip(responses, answers):
            v = fn(r, a)
            out.append(float(v["score"]) if isinstance(v, dict) else float(v))
        return out
    return per_sample


def _tokenizer(path: Optional[str]) -> Any:
    """The policy's tokenizer at ``path``: a local directory, or a Hub id (``fitrl.train(model=
    "Qwen/...")`` registers the functions before the run resolves it), read from its snapshot in
    the Hugging Face cache (its tokenizer files downloaded first when online: fitrl/core/hub.py)."""
    if path is None:
        return None
    from transformers import AutoTokenizer

    from fitrl.core import hub

    ref = hub.parse_model_ref(path)
    if ref is not None:
        path = str(hub.snapshot(ref, f"the tokenizer of {path!r}", allow=hub.TOKENIZER_PATTERNS)[0].path)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _takes(fn: Callable[..., Any], name: str) -> bool:
    """Does ``fn`` take ``name`` (by name, or through ``**kwargs``)?"""
    params = _parameters(fn) or {}
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _parameters(fn: Callable[..., Any]) -> Optional[dict[str, inspect.Parameter]]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # some C functions have none
        return None


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}_{seen[n]}")
    return out
