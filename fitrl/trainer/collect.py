"""Turning prompts into a scored rollout batch: generation, reward, DAPO dynamic sampling,
overlong shaping and the ReMax greedy baseline.

Dynamic sampling draws prompts round after round, keeping only groups whose samples did not
all score the same (their GRPO advantages would be zero), until the batch holds
``data.rollout_batch_size`` groups or ``max_num_gen_batches`` rounds are spent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from fitrl.algo.filtering import group_is_informative
from fitrl.algo.shaping import overlong_penalty
from fitrl.config.schema import FitrlConfig, SamplingConfig
from fitrl.core.errors import RunStopped
from fitrl.data.batch import Batch
from fitrl.data.dataset import PromptDataset, PromptSampler
from fitrl.roles.reward import REWARD_COMPONENTS, Scored
from fitrl.roles.reward_sources import RewardSources
from fitrl.rollout.agent import agent_metrics
from fitrl.rollout.layout import concat_rollouts
from fitrl.telemetry.timer import PhaseTimer
from fitrl.trainer.perf import Lengths, sequence_lengths

log = logging.getLogger("fitrl.trainer")

def group_index(uids: list[str]) -> torch.Tensor:
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(u, len(ids)) for u in uids], dtype=torch.long)


@dataclass
class CollectStats:
    rounds: int = 0
    groups_seen: int = 0
    groups_dropped: int = 0
    groups_kept: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    generated: dict[str, list[Lengths]] = field(default_factory=dict)
    """Phase (``rollout``, ``baseline_rollout``) -> (prompt, response) lengths of each generate call: throughput and FLOPs."""
    rows: list[int] = field(default_factory=list)
    """The dataset rows drawn, every round's (``prompts.jsonl``)."""


@dataclass
class FirstRound:
    """A first round generated ahead (fitrl/trainer/pipeline.py): its prompts, their rows, the rollout."""
    prompts: Batch
    rows: list[int]
    rollout: Batch


class RolloutCollector:
    def __init__(self, cfg: FitrlConfig, generate: Callable[[Batch, SamplingConfig], Batch], reward: RewardSources,
                 data: PromptDataset, sampler: PromptSampler, sampling: SamplingConfig, needs_baseline: bool,
                 pad_id: int):
        """``generate``: the policy's (``policy.generate``) or the rollout workers' with the newest
        weights (fitrl/trainer/pipeline.py)."""
        self.cfg, self.generate, self.reward = cfg, generate, reward
        self.data, self.sampler, self.sampling = data, sampler, sampling
        self.needs_baseline, self.pad_id = needs_baseline, pad_id

    def collect(self, step: int, timer: PhaseTimer, first: Optional[FirstRound] = None) -> tuple[Batch, CollectStats]:
        """The step's scored rollout; ``first``: its first round, already generated."""
        fg = self.cfg.algorithm.filter_groups
        target = self.cfg.data.rollout_batch_size
        n = self.sampling.n
        kept: list[Batch] = []
        stats = CollectStats()
        while True:
            stats.rounds += 1
            scored = self._one_round(step, stats.rounds, timer, stats, first if stats.rounds == 1 else None)
            stats.groups_seen += target
            if not fg.enable:
                stats.groups_kept = target
                return scored, stats
            values = scored["scores"] if fg.metric == "score" else self._component(scored, fg.metric)
            keep = group_is_informative(values, group_index(scored["uid"]))
            stats.groups_dropped += int((~keep).sum()) // n
            if keep.any():
                kept.append(scored.index(keep.nonzero().squeeze(-1)))
            have = sum(len(b) for b in kept) // n
            stats.groups_kept = min(have, target)
            if have >= target:
                return concat_rollouts(kept, self.pad_id).index(slice(0, target * n)), stats
            if fg.max_num_gen_batches and stats.rounds >= fg.max_num_gen_batches:
                why = (f"dynamic sampling kept {have} of {target} groups after {stats.rounds} rounds "
                       f"(algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}): "
                       f"{stats.groups_dropped} groups scored all the same on '{fg.metric}'")
                if fg.on_exhausted == "stop":
                    raise RunStopped(why + ". Raise max_num_gen_batches, make the task's difficulty varied, or "
                                           "set algorithm.filter_groups.on_exhausted=continue")
                if have == 0:
                    # Nothing informative: train on the last round as it is. Its group-relative
                    # advantages are all zero, so the policy-gradient term is a no-op this step.
                    log.warning("%s; no informative group, this step's policy gradient is zero", why)
                    return scored, stats
                log.warning("%s; continuing with a partial batch", why)
                return concat_rollouts(kept, self.pad_id), stats

    @staticmethod
    def _add_reward_health(stats: CollectStats, scored: Scored, prefix: str = "") -> None:
        """Timeouts, errors and degenerate answers, summed over the step's scoring calls."""
        for k, v in scored.health.items():
            key = k.replace("reward/", f"reward/{prefix}", 1)
            stats.metrics[key] = stats.metrics.get(key, 0.0) + v

    def _one_round(self, step: int, round_: int, timer: PhaseTimer, stats: CollectStats,
                   first: Optional[FirstRound] = None) -> Batch:
        if first is not None:
            prompts, batch = first.prompts, first.rollout
            stats.rows.extend(first.rows)
        else:
            with timer.phase("data"):
                rows = self.sampler.next_indices()
                prompts = self.data.batch(rows, f"{step}.{round_}")
                stats.rows.extend(rows)
            with timer.phase("rollout"):
                batch = self.generate(prompts, self.sampling)  # (B*n, P+R)
        stats.generated.setdefault("rollout", []).append(sequence_lengths(batch))
        for k, v in agent_metrics(batch).items():  # multi-turn episodes: turns, tools, cuts (per round: the last)
            stats.metrics[k] = v
        with timer.phase("reward"):
            batch.meta["step"] = step  # (a TRL reward function's trainer_state.global_step is step - 1)
            scored = self.reward.score_batch(batch)
            self._add_reward_health(stats, scored)
            batch.update(scores=self._shape(batch, scored.scores))
            batch.put_named(REWARD_COMPONENTS, scored.components)
        if self.needs_baseline:
            with timer.phase("baseline_rollout"):
                greedy = self.generate(prompts, SamplingConfig(temperature=0.0, n=1,
                                                                      max_tokens=self.sampling.max_tokens))
                stats.generated.setdefault("baseline_rollout", []).append(sequence_lengths(greedy))
                base = self.reward.score_batch(greedy)
                self._add_reward_health(stats, base, prefix="baseline_")
                base = self._shape(greedy, base.scores)
                batch.update(baseline_scores=base.repeat_interleave(self.sampling.n))
        return batch

    def _shape(self, batch: Batch, scores: torch.Tensor) -> torch.Tensor:
        o = self.cfg.algorithm.overlong
        if not o.enable:
            return scores
        lengths = batch["response_mask"].sum(-1).float()
        return scores + overlong_penalty(lengths, max_response_length=self.cfg.rollout.max_response_length,
                                         buffer_length=o.buffer_length, penalty_factor=o.penalty_factor)

    @staticmethod
    def _component(batch: Batch, name: str) -> torch.Tensor:
        comps = batch.named(REWARD_COMPONENTS)
        if name not in comps:
            raise RunStopped(f"algorithm.filter_groups.metric={name!r} is not a component of the reward "
                             f"(components: score, {', '.join(comps)})")
        return comps[name]
