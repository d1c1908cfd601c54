"""A run's reward: ``reward.function`` alone, or ``reward.sources`` mixed with weights.

Rule functions score in their worker pools (:class:`~fitrl.roles.reward.RewardScorer`, one per
``kind: function`` source), reward models and judges in their roles' ranks
(fitrl/roles/model_reward.py, reached through :class:`~fitrl.workers.group.RoleHandle`); the
total is fitrl/rewards/mix.py's weighted sum. Every source's raw score is a component
(``reward/<source>``), beside the rule functions' own components; a judge reply its pattern does
not match scores the source's ``unparsed_score`` and is counted (``reward/<source>/unparsed``),
the first such reply logged.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Optional

import torch

from fitrl.config.algorithm import RewardConfig
from fitrl.config.reward_sources import RewardSourceConfig
from fitrl.data.batch import Batch
from fitrl.rewards.mix import parse_grade, weighted_total
from fitrl.rewards.python import SAMPLED_IDS_KEY, STEP_KEY, WANTS_SAMPLED_IDS
from fitrl.roles.reward import RewardScorer, Scored
from fitrl.workers.group import RoleHandle

logger = logging.getLogger("fitrl.rewards")

MODEL_INPUTS = ("prompt_messages", "response_text", "answer")
"""The rollout batch's fields a reward model or judge reads."""


def function_config(reward: RewardConfig, src: RewardSourceConfig) -> RewardConfig:
    """A ``kind: function`` source as the reward section its scorer runs: its own function and
    kwargs, else ``reward.function`` and ``reward.kwargs``; the pool settings are the section's."""
    if src.function:
        return dataclasses.replace(reward, function=src.function, kwargs=dict(src.kwargs), sources={})
    return dataclasses.replace(reward, kwargs=dict(src.kwargs or reward.kwargs), sources={})


class RewardSources:
    """Scores a rollout batch (``score_batch``); ``attach`` gives it the model roles' handles once
    their groups exist (the rule functions are checked first, before any model loads)."""

    def __init__(self, cfg: RewardConfig, agent_reward: str = ""):
        """``agent_reward``: ``rollout.agent.reward`` of a multi-turn run (``function``,
        ``environment`` or ``sum``: fitrl/config/agent.py); empty for single-turn runs."""
        self.cfg = cfg
        self.agent_reward = agent_reward
        self.mixed = bool(cfg.sources)
        if not self.mixed:
            self.functions = {"": RewardScorer(cfg)}
        else:
            self.functions = {name: RewardScorer(function_config(cfg, src)) for name, src in cfg.sources.items()
                              if src.kind == "function"}
        self.reward_models: Optional[RoleHandle] = None
        self.judges: Optional[RoleHandle] = None
        self._warned_unparsed: set[str] = set()

    def attach(self, reward_models: Optional[RoleHandle], judges: Optional[RoleHandle]) -> None:
        """The model roles' groups, built as the run's layout lists them (fitrl/config/layout.py)."""
        self.reward_models, self.judges = reward_models, judges

    def groups(self) -> dict[str, RoleHandle]:
        """The model roles' worker groups by role name (their memory is recorded like every role's)."""
        return {name: h for name, h in (("reward_model", self.reward_models), ("judge", self.judges)) if h is not None}

    def score_batch(self, batch: Batch) -> Scored:
        """Totals, components and health for the batch's responses (an episode's: its last model
        turn's text), with a multi-turn run's environment rewards (component ``env``) as
        ``rollout.agent.reward`` says."""
        if "env_reward" not in batch.fields:
            return self._score(batch)
        env = torch.tensor(batch["env_reward"], dtype=torch.float32)
        if self.agent_reward == "environment":
            return Scored(env, {"env": env})
        scored = self._score(batch)
        scored.components["env"] = env
        if self.agent_reward == "sum":
            scored.scores = scored.scores + env
        return scored

    def _score(self, batch: Batch) -> Scored:
        if not self.mixed:
            return self._function("", batch)
        parts: dict[str, torch.Tensor] = {}
        components: dict[str, torch.Tensor] = {}
        health: dict[str, float] = {}
        for name in self.functions:
            scored = self._function(name, batch)
            parts[name] = scored.scores
            components.update(scored.components)
            for k, v in scored.health.items():
                health[k] = health.get(k, 0.0) + v
        inputs = Batch(fields={k: list(batch[k]) for k in MODEL_INPUTS})
        if self.reward_models is not None:
            out = self.reward_models.score(inputs)
            parts.update({name: out[name].float() for name, s in self.cfg.sources.items() if s.kind == "model"})
        if self.judges is not None:
            out = self.judges.judge(inputs)
            for name, s in self.cfg.sources.items():
                if s.kind == "judge":
                    parts[name], health[f"reward/{name}/unparsed"] = self._grades(name, s, out[name], batch)
        order = list(self.cfg.sources)  # (the components in the config's order)
        parts = {name: parts[name] for name in order}
        total = weighted_total(parts, {n: self.cfg.sources[n].weight for n in order},
                               {n: self.cfg.sources[n].normalize for n in order})
        components.update(parts)
        return Scored(total, components, health)

    def _function(self, name: str, batch: Batch) -> Scored:
        return self.functions[name].score(batch["response_text"], batch["answer"], batch["source"],
                                          extras=_with_sampled(batch, self.functions[name].name in WANTS_SAMPLED_IDS))

    def _grades(self, name: str, src: RewardSourceConfig, replies: list[str],
                batch: Batch) -> tuple[torch.Tensor, float]:
        pattern = re.compile(src.pattern)
        grades = [parse_grade(r, pattern, src.max_score) for r in replies]
        missed = [i for i, g in enumerate(grades) if g is None]
        if missed and name not in self._warned_unparsed:
            self._warned_unparsed.add(name)
            i = missed[0]
            logger.warning("judge %s: %d of %d replies do not match reward.sources.%s.pattern %r and score "
                           "unparsed_score=%g (counted in reward/%s/unparsed), e.g. %r for the response %r",
                           name, len(missed), len(replies), name, src.pattern, src.unparsed_score, name,
                           replies[i][:200], batch["response_text"][i][:200])
        values = [src.unparsed_score if g is None else g for g in grades]
        return torch.tensor(values, dtype=torch.float32), float(len(missed))

    def close(self) -> None:
        for scorer in self.functions.values():
            scorer.close()

    def __enter__(self) -> "RewardSources":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _with_sampled(batch: Batch, with_ids: bool) -> list[dict]:
    """Each sample's ``extra`` with what a reward function may read of its sampling: in a training
    step's rollout, the step (``batch.meta["step"]``, set by fitrl/trainer/collect.py); with
    ``with_ids`` (a function that reads them), the token ids the policy sampled (the response
    mask applied: TRL's ``completion_ids``)."""
    step = batch.meta.get("step")
    ids = ([row[mask.bool()].tolist() for row, mask in zip(batch["responses"], batch["response_mask"])]
           if with_ids and "responses" in batch and "response_mask" in batch else None)
    out = []
    for i, extra in enumerate(batch["extra"]):
        extra = dict(extra)
        if ids is not None:
            extra[SAMPLED_IDS_KEY] = ids[i]
        if step is not None:
            extra[STEP_KEY] = step
        out.append(extra)
    return out
