"""The ``rollout.agent`` section: multi-turn episodes with an environment and tools
(docs/agents.md). Unset ``env``: single-turn rollouts, as before."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from fitrl.config.plan import parse_bytes
from fitrl.core.errors import ConfigError


@dataclass
class AgentConfig:
    env: str = ""
    """The environment each episode runs in: a registered name (``tools``: the row's prompt, the
    configured tools, done at the first turn without a tool call) or ``path/to/file.py:Class`` /
    ``package.module:Class`` (a subclass of ``fitrl.agents.Environment``). Empty: single-turn
    rollouts."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (after the row)."""
    tools: list[str] = field(default_factory=list)
    """Tools offered to the model, rendered by its chat template (``tools=``): built-in ``calculator``
    and ``python`` (a code interpreter), or ``path/to/file.py:function`` with type hints and a
    Google-style docstring. Every call runs in the sandbox's worker processes."""
    max_turns: int = 4
    """Model turns per episode at most; an episode still calling tools after them is cut (``agent/cut/turns``)."""
    max_tokens_per_turn: Optional[int] = None
    """New tokens per model turn at most; unset: ``rollout.max_response_length``. The whole episode
    after the prompt (model turns and the environment's replies) is bounded by
    ``rollout.max_response_length``: what the memory plan sizes."""
    reward: Literal["function", "environment", "sum"] = "function"
    """The episode's reward: ``function`` (``reward.function`` / ``reward.sources`` on the last model
    turn's text), ``environment`` (the sum of the rewards the environment returned), or ``sum`` (both
    added). The environment's rewards are logged as the component ``env`` in every mode."""
    tool_timeout: float = 10.0
    """Wall-clock seconds one tool call may take; past it its worker is killed and replaced, and the model reads a timeout error."""
    tool_memory: str = "2GiB"
    """Address space of each tool worker (``RLIMIT_AS``): an allocation past it fails inside the call."""
    tool_workers: int = 2
    """Sandbox worker processes per policy rank (~60 MB of host memory each, plus what a call allocates up to ``tool_memory``)."""
    tool_network: bool = False
    """Let tools open network connections (a search tool); off, every socket is refused."""
    allow_unconfined_tools: bool = False
    """Run tools that run code (the built-in ``python`` and every tool of your own) on a machine whose
    kernel refuses the sandbox's namespaces. There nothing confines a program a tool starts to the
    sandbox: only rlimits, a process group and Python's audit hook bound it, and the run warns once.
    False: such a run is refused at start (docs/agents.md, "The sandbox")."""
    overlap: bool = True
    """Episodes whose tool calls are back take their next turn while other episodes' tools still
    run (a slow tool holds up only its own episode). False: rounds, every live episode's turn and
    then every tool call of the round; the batches the engine samples then do not depend on how
    long tools take, so a seed reproduces a run exactly."""
    max_tool_output_chars: int = 2000
    """A tool's reply is cut to this many characters in its worker, before it is sent back (what a
    tool may print is unbounded); ``max_tool_output_tokens`` bounds what enters the trajectory."""
    max_tool_output_tokens: int = 512
    """A tool's reply (or error) is cut to this many tokens of the policy's tokenizer before it enters
    the trajectory; 200 emoji are 200 characters and ~800 tokens."""

    @property
    def enabled(self) -> bool:
        return bool(self.env)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"rollout.agent.max_turns must be >= 1, got {self.max_turns}")
        if self.max_tokens_per_turn is not None and self.max_tokens_per_turn < 1:
            raise ConfigError(f"rollout.agent.max_tokens_per_turn must be >= 1 (or unset), got {self.max_tokens_per_turn}")
        if not self.tool_timeout > 0:
            raise ConfigError(f"rollout.agent.tool_timeout must be > 0 seconds, got {self.tool_timeout}")
        if self.tool_workers < 1:
            raise ConfigError(f"rollout.agent.tool_workers must be >= 1, got {self.tool_workers}")
        if self.max_tool_output_chars < 1:
            raise ConfigError(f"rollout.agent.max_tool_output_chars must be >= 1, got {self.max_tool_output_chars}")
        if self.max_tool_output_tokens < 1:
            raise ConfigError(f"rollout.agent.max_tool_output_tokens must be >= 1, got {self.max_tool_output_tokens}")
        if parse_bytes(self.tool_memory, "rollout.agent.tool_memory") < (256 << 20):
            raise ConfigError("rollout.agent.tool_memory must be at least 256MiB (the interpreter itself needs ~100MiB)")
        if self.tools and not self.env:
            raise ConfigError("rollout.agent.tools is set but rollout.agent.env is empty: set rollout.agent.env=tools "
                              "(or your environment) to run multi-turn episodes")

    def memory_bytes(self) -> int:
        return parse_bytes(self.tool_memory, "rollout.agent.tool_memory")
