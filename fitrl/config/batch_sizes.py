"""The batch sizes of a run, derived once (docs/architecture.md, "Batch sizes").

A config names four numbers (``data.rollout_batch_size``, ``rollout.n`` and a role's
``mini_batch_size`` / ``micro_batch_size``); everything else (sequences per step, per rank, per
optimizer step, the gradient accumulation) follows from them and the world size. The workers, the
memory planner and the start-up printout all read it from :class:`BatchSizes`, so none of them can
derive it differently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BatchSizes:
    prompts_per_step: int
    """``data.rollout_batch_size``."""
    samples_per_prompt: int
    """``rollout.n``."""
    mini_batch_prompts: int
    """The role's ``mini_batch_size``: prompts per optimizer step."""
    micro_batch: int
    """The role's ``micro_batch_size``: sequences per forward/backward on a rank."""
    ppo_epochs: int
    world_size: int = 1

    @classmethod
    def of(cls, cfg: Any, world_size: int = 1, role: str = "actor") -> "BatchSizes":
        """The sizes of ``role`` (``actor`` or ``critic``) in ``cfg`` over ``world_size`` data-parallel ranks."""
        r = getattr(cfg, role)
        return cls(cfg.data.rollout_batch_size, cfg.rollout.n, r.mini_batch_size, r.micro_batch_size,
                   r.ppo_epochs, world_size)

    @classmethod
    def supervised(cls, cfg: Any, world_size: int = 1) -> "BatchSizes":
        """Supervised fine-tuning's (``fitrl sft``): one target sequence per prompt, one pass."""
        a = cfg.actor
        return cls(cfg.data.rollout_batch_size, 1, a.mini_batch_size, a.micro_batch_size, 1, world_size)

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def sequences_per_rank(self) -> int:
        """A rank's share of the step's sequences (rounded down when the world does not divide them)."""
        return self.sequences_per_step // self.world_size

    @property
    def sequences_per_mini_batch(self) -> int:
        """Sequences of one optimizer step, over all ranks."""
        return self.mini_batch_prompts * self.samples_per_prompt

    @property
    def mini_batch_per_rank(self) -> int:
        """A rank's sequences of one optimizer step (what ``Actor.update`` splits into micro-batches)."""
        return self.sequences_per_mini_batch // self.world_size

    @property
    def optimizer_steps_per_rl_step(self) -> int:
        return self.prompts_per_step // self.mini_batch_prompts * self.ppo_epochs

    @property
    def grad_accumulation_steps(self) -> int:
        """Forward/backward passes per optimizer step on a rank (a micro-batch larger than the
        mini-batch is the whole mini-batch: one)."""
        return max(1, -(-self.mini_batch_per_rank // self.micro_batch))

    def printout(self) -> dict[str, int]:
        """The numbers printed at start-up so nobody has to derive them by hand."""
        return {
            "prompts_per_step": self.prompts_per_step,
            "sequences_per_step": self.sequences_per_step,
            "sequences_per_mini_batch": self.sequences_per_mini_batch,
            "optimizer_steps_per_rl_step": self.optimizer_steps_per_rl_step,
            "grad_accumulation_steps": self.grad_accumulation_steps,
            "world_size": self.world_size,
        }
