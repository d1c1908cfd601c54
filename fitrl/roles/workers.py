"""Workers: what one rank of a role holds, composed from pieces.

``PolicyWorker`` = a policy model + an :class:`Actor` (training) + an :class:`HFRollout`
(generation) sharing the same module, so generation always sees the latest weights without a
copy. ``ReferenceWorker`` = a frozen model computing log-probs. No role flags.
"""

from __future__ import annotations

import torch

from fitrl.config.schema import FitrlConfig
from fitrl.data.batch import Batch
from fitrl.models.loading import load_causal_lm, load_tokenizer
from fitrl.ops.logprob import response_logprobs
from fitrl.roles.actor import Actor
from fitrl.rollout.hf import HFRollout, Sampling
from fitrl.workers.group import dispatch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from fitrl.config.schema import ConfigError

        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    return torch.device(name)


class PolicyWorker:
    def __init__(self, cfg: FitrlConfig, *, rank: int, world_size: int):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = resolve_device(cfg.trainer.device)
        torch.manual_seed(cfg.trainer.seed + rank)
        self.tokenizer = load_tokenizer(cfg.actor.model)
        self.model = load_causal_lm(cfg.actor.model, self.device)
        self.actor = Actor(self.model, cfg.actor, cfg.algorithm, total_steps=cfg.trainer.max_steps,
                           seed=cfg.trainer.seed, max_response_length=cfg.rollout.max_response_length)
        self.rollout = HFRollout(self.model, self.tokenizer, micro_batch_size=cfg.rollout.micro_batch_size)

    @dispatch("dp")
    def generate(self, prompts: Batch, sampling: Sampling) -> Batch:
        return self.rollout.generate(prompts, sampling).to("cpu")

    @dispatch("dp")
    def compute_logprob(self, batch: Batch) -> Batch:
        return self.actor.compute_logprob(batch.to(self.device), self.cfg.rollout.temperature).to("cpu")

    @dispatch("dp")
    def update(self, batch: Batch) -> dict[str, float]:
        seqs = self.cfg.actor.mini_batch_size * self.cfg.rollout.n // self.world_size
        return self.actor.update(batch.to(self.device), sequences_per_mini_batch=seqs,
                                 temperature=self.cfg.rollout.temperature)

    @dispatch("all")
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


class ReferenceWorker:
    def __init__(self, cfg: FitrlConfig, *, rank: int, world_size: int):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = resolve_device(cfg.trainer.device)
        model_cfg = cfg.ref.model or cfg.actor.model
        self.model = load_causal_lm(model_cfg, self.device, what="ref.model.path")
        self.model.eval().requires_grad_(False)

    @dispatch("dp")
    @torch.no_grad()
    def compute_ref_logprob(self, batch: Batch) -> Batch:
        batch = batch.to(self.device)
        out = []
        for micro in batch.split(self.cfg.ref.logprob_micro_batch_size):
            lp, _ = response_logprobs(
                self.model, micro["input_ids"], micro["attention_mask"], micro["position_ids"],
                micro["responses"].shape[1], temperature=self.cfg.rollout.temperature,
                chunk_size=self.cfg.actor.logprob_chunk_size)
            out.append(lp)
        return Batch({"ref_logprobs": torch.cat(out).cpu()})


class CriticWorker:
    def __init__(self, cfg: FitrlConfig, *, rank: int, world_size: int):
        from fitrl.roles.critic import Critic, load_value_model

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = resolve_device(cfg.trainer.device)
        torch.manual_seed(cfg.trainer.seed + 7919 + rank)  # the value head's init
        self.model = load_value_model(cfg.critic.model or cfg.actor.model, self.device)
        self.critic = Critic(self.model, cfg.critic, total_steps=cfg.trainer.max_steps,
                             max_response_length=cfg.rollout.max_response_length)

    @dispatch("dp")
    def compute_values(self, batch: Batch) -> Batch:
        return self.critic.compute_values(batch.to(self.device)).to("cpu")

    @dispatch("dp")
    def update(self, batch: Batch) -> dict[str, float]:
        seqs = self.cfg.critic.mini_batch_size * self.cfg.rollout.n // self.world_size
        return self.critic.update(batch.to(self.device), sequences_per_mini_batch=seqs)
