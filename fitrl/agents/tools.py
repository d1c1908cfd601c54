"""Tools an agent may call: a Python function with a JSON schema, and the parsing of the calls a
model writes.

A tool is named in ``rollout.agent.tools`` by a built-in name (``calculator``, ``python``:
fitrl/agents/builtin_tools.py) or as ``path/to/file.py:function`` / ``package.module:function``.
Its schema comes from its signature and Google-style docstring (transformers'
``get_json_schema``, what ``apply_chat_template(tools=...)`` takes), so the chat template
renders it exactly as it renders any tool for that model.

Calls are parsed in the Hermes format Qwen2.5/Qwen3 are trained on: each call a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``. A call that
does not parse or names no tool becomes a :class:`ToolCall` with ``error`` set: the model is
shown that error as the tool's reply, and it is counted (``agent/tool_errors``).

No torch here: the sandbox's worker processes import this module.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from fitrl.agents.builtin_tools import BUILTIN_TOOLS
from fitrl.core.errors import ConfigError
from fitrl.core.user_code import resolve_named

CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    """One call the model wrote: what it names and passes, or why it cannot be run."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    """Why the call cannot be run (unparsable JSON, an unknown tool, arguments not an object):
    shown to the model as the tool's reply. Empty: the call runs."""

    def as_message(self) -> dict:
        """The call in the assistant message's ``tool_calls`` (the form chat templates take)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def resolve_tool(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names (:class:`ConfigError` naming ``rollout.agent.tools``)."""
    return resolve_named(spec, BUILTIN_TOOLS, "rollout.agent.tools", lambda spec: (
        f"rollout.agent.tools: unknown tool {spec!r} (built-in: {', '.join(BUILTIN_TOOLS)}; "
        "or 'path/to/file.py:function' / 'package.module:function')"))


def tool_schema(fn: Callable[..., Any], spec: str) -> dict:
    """The JSON schema chat templates render (``{"type": "function", "function": {...}}``)."""
    from transformers.utils import get_json_schema  # (the policy worker's import; not the sandbox's)

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 -- transformers raises several kinds; each is the user's docstring
        raise ConfigError(f"rollout.agent.tools: {spec}: no JSON schema can be made from its signature and "
                          f"docstring ({e}); give it type hints and a Google-style docstring with an 'Args:' "
                          "section describing every parameter") from None


def tool_schemas(specs: list[str]) -> list[dict]:
    """The schemas of the tools ``specs`` names, checked for distinct names."""
    schemas = [tool_schema(resolve_tool(s), s) for s in specs]
    names = [s["function"]["name"] for s in schemas]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"rollout.agent.tools: two tools are named {twice[0]!r}; tool names must be distinct")
    return schemas


def parse_tool_calls(text: str, tool_names: list[str]) -> list[ToolCall]:
    """The calls in one model turn, in order (none: the turn answers)."""
    calls = []
    for k, m in enumerate(CALL.finditer(text), start=1):
        body, closed = m.group(1).strip(), bool(m.group(2))
        calls.append(_one_call(body, closed, k, tool_names))
    return calls


def _one_call(body: str, closed: bool, k: int, tool_names: list[str]) -> ToolCall:
    if not closed:
        return ToolCall(error=f"tool call {k} has no closing </tool_call>")
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(error=f"tool call {k} is not valid JSON ({e.msg} at character {e.pos}): {body[:200]!r}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(error=f"tool call {k} must be a JSON object with a string \"name\" and an \"arguments\" "
                              f"object, got {body[:200]!r}")
    name, args = obj["name"], obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if name not in tool_names:
        return ToolCall(name=name, error=f"tool call {k} names no tool: {name!r} (tools: {', '.join(tool_names)})")
    if not isinstance(args, dict):
        return ToolCall(name=name, error=f"tool call {k} to {name}: \"arguments\" must be an object, got {args!r}")
    return ToolCall(name=name, arguments=args)


def reply_text(value: Any, limit: int) -> str:
    """A tool's return value as the text the model reads, cut to ``limit`` characters (a tool's
    output is unbounded; the trajectory is not), every code point encodable."""
    text = printable(value if isinstance(value, str) else json.dumps(value, default=str))
    if len(text) > limit:
        text = text[:limit] + f"... [{len(text) - limit} more characters cut]"
    return text


def printable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a lone surrogate, as ``print('\\udcff')`` or a
    file name of undecodable bytes gives) written as its escape: the tokenizer, the chat template
    and generations.jsonl all need valid UTF-8.

    >>> printable("ok \\udcff")
    'ok \\\\udcff'
    """
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def added_strings(tokenizer: Any) -> list[str]:
    """The strings the tokenizer turns into one added token wherever they occur in a text: its
    control tokens (``<|im_end|>``, ``<|im_start|>``) and the other added ones (Qwen's
    ``<tool_call>``), which ``split_special_tokens`` leaves whole."""
    return [s for s in getattr(tokenizer, "get_added_vocab", dict)() if len(s) > 1]


def plain_ids(tokenizer: Any, text: str, added: list[str]) -> list[int]:
    """``text``'s token ids as plain text: no string of ``added`` becomes its token, so a tool that
    prints ``<|im_end|>`` cannot end its turn in the trajectory. Text holding none is tokenized as
    it always is; else it is tokenized in pieces cut one character into each occurrence."""
    cuts = sorted({i + 1 for s in added for i in _occurrences(text, s)})
    if not cuts:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    bounds = [0] + cuts + [len(text)]
    return [t for a, b in zip(bounds, bounds[1:]) if b > a
            for t in tokenizer(text[a:b], add_special_tokens=False)["input_ids"]]


def _occurrences(text: str, s: str) -> list[int]:
    found, i = [], text.find(s)
    while i >= 0:
        found.append(i)
        i = text.find(s, i + 1)
    return found


def cut_to_tokens(tokenizer: Any, text: str, limit: int, added: list[str]) -> str:
    """``text`` cut to ``limit`` tokens as plain text (:func:`plain_ids`), saying how many were cut."""
    ids = plain_ids(tokenizer, text, added)
    if len(ids) <= limit:
        return text
    return printable(tokenizer.decode(ids[:limit])) + f"... [{len(ids) - limit} more tokens cut]"


def rendered_tools_missing(tokenizer: Any, schemas: list[dict]) -> Optional[str]:
    """The first tool the chat template does not render when given ``tools=`` (None: all are
    rendered): a template without tool support drops them silently, and the model would be
    asked to call tools it was never shown."""
    if not schemas:
        return None
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=schemas, tokenize=False,
                                         add_generation_prompt=True)
    for s in schemas:
        if s["function"]["name"] not in text:
            return s["function"]["name"]
    return None
