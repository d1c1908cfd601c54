"""Multi-turn agents: environments, tools and the sandbox they run in (docs/agents.md). The
rollout that runs episodes on an engine is fitrl/rollout/agent.py."""

from fitrl.agents.env import Environment, Step, ToolResult, Turn
from fitrl.agents.tools import ToolCall

__all__ = ["Environment", "Step", "ToolCall", "ToolResult", "Turn"]
