"""The environment an agent's episode runs in (docs/agents.md).

One :class:`Environment` per episode, built from its dataset row. ``reset()`` returns the first
messages; after each model turn, ``step(turn)`` gets the turn's text, its parsed tool calls and
their results (run in the sandbox by the rollout, concurrently for the whole batch) and returns
the messages the model reads next, a reward (or None) and whether the episode is done.

The base class is the built-in ``tools`` environment: the row's prompt, every tool result as a
``tool`` message, done at the first turn without a tool call. A task subclasses it and overrides
``step`` (to reply, to end, to reward) or ``reset``.

No torch here: this module is imported by the config checks.
"""

from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from fitrl.agents.builtin_tools import BUILTIN_TOOLS
from fitrl.agents.tools import ToolCall
from fitrl.core.errors import ConfigError, UserError
from fitrl.core.user_code import resolve_named


class EnvironmentError_(UserError, RuntimeError):
    """An environment returned something unusable, or failed on too many episodes of a batch: the
    user's class to fix (one line, exit 2)."""

    kind = "environment error"


@dataclass
class ToolResult:
    """What one tool call gave: its reply (or error) as the model reads it."""

    name: str
    content: str
    status: str = "ok"
    """``ok``, ``error`` (the call raised, or could not be parsed), ``timeout`` or ``crash`` (the worker died)."""
    seconds: float = 0.0


@dataclass
class Turn:
    """One model turn, as the environment sees it."""

    text: str
    """The turn's text (special tokens and the end-of-turn token removed)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_results: list[ToolResult] = field(default_factory=list)
    """One per call, in order (a call that did not parse has its error here)."""
    index: int = 0
    """0 for the first model turn."""


@dataclass
class Step:
    """What the environment answers to a turn."""

    messages: list[dict] = field(default_factory=list)
    """Messages the model reads before its next turn (``tool`` or ``user`` roles), rendered by its chat template."""
    reward: Optional[float] = None
    """This turn's reward; the episode's environment reward is the sum of those given."""
    done: bool = False


class Environment:
    """The built-in ``tools`` environment, and the base of every environment."""

    def __init__(self, row: dict, **kwargs: Any):
        """``row``: the episode's dataset row: ``prompt_messages``, ``answer``, ``source``,
        ``extra`` (the row's other columns). ``kwargs``: ``rollout.agent.env_kwargs``."""
        self.row = row
        self.kwargs = kwargs

    def reset(self) -> list[dict]:
        """The first messages of the episode (the row's prompt, by default)."""
        return [dict(m) for m in self.row["prompt_messages"]]

    def step(self, turn: Turn) -> Step:
        """Tool results as ``tool`` messages; done at a turn without tool calls."""
        if not turn.tool_calls:
            return Step(done=True)
        return Step(messages=[{"role": "tool", "name": r.name, "content": r.content} for r in turn.tool_results])


BUILTIN_ENVIRONMENTS: dict[str, type] = {"tools": Environment}


def check_agent_spec(env: str, tools: list[str]) -> None:
    """The cheap checks of ``rollout.agent.env`` and ``.tools`` at config load (no user code runs)."""
    if env and env not in BUILTIN_ENVIRONMENTS:
        _check_spec(env, "rollout.agent.env", BUILTIN_ENVIRONMENTS, "Class")
    for t in tools:
        if t not in BUILTIN_TOOLS:
            _check_spec(t, "rollout.agent.tools", BUILTIN_TOOLS, "function")


def _check_spec(spec: str, key: str, builtin: dict, noun: str) -> None:
    if ":" not in spec:
        raise ConfigError(_unknown(spec, key, builtin, noun))
    where = spec.rsplit(":", 1)[0]
    if where.endswith(".py") and not Path(where).is_file():
        raise ConfigError(f"{key}: file not found: {where}")


def _unknown(spec: str, key: str, builtin: dict, noun: str) -> str:
    near = difflib.get_close_matches(spec, list(builtin), n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return (f"{key}: unknown name {spec!r}{hint} (built-in: {', '.join(builtin)}; or "
            f"'path/to/file.py:{noun}' / 'package.module:{noun}')")


def load_environment(spec: str) -> type:
    """The environment class ``spec`` names, checked to be an :class:`Environment`."""
    cls = resolve_named(spec, BUILTIN_ENVIRONMENTS, "rollout.agent.env",
                        lambda spec: _unknown(spec, "rollout.agent.env", BUILTIN_ENVIRONMENTS, "Class"), noun="class")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"rollout.agent.env: {spec} is not a subclass of fitrl.agents.Environment "
                          "(subclass it and override reset() and/or step())")
    return cls


def checked_messages(value: Any, where: str) -> list[dict]:
    """``value`` if it is a list of ``{"role": str, "content": str, ...}`` messages, else
    :class:`EnvironmentError_` naming ``where`` (the environment's method and row)."""
    if not isinstance(value, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content", ""), str)
            for m in value):
        raise EnvironmentError_(f"{where} must return a list of {{'role': str, 'content': str}} messages, "
                                f"got {_short(value)}")
    return value


def checked_step(value: Any, where: str) -> Step:
    """``value`` if it is a :class:`Step` with messages, a finite reward (or None) and a bool done."""
    if not isinstance(value, Step):
        raise EnvironmentError_(f"{where} must return a fitrl.agents.Step, got {_short(value)}")
    checked_messages(value.messages, where + " (Step.messages)")
    r = value.reward
    if r is not None and (isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(float(r))):
        raise EnvironmentError_(f"{where} returned Step.reward={r!r}: it must be a finite number or None")
    if not isinstance(value.done, bool):
        raise EnvironmentError_(f"{where} returned Step.done={value.done!r}: it must be True or False")
    if not value.done and not value.messages:
        raise EnvironmentError_(f"{where} returned a Step that is not done and has no messages: the model "
                                "would be asked to answer its own turn again; return messages or done=True")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:120]}{'...' if len(text) > 120 else ''}"
