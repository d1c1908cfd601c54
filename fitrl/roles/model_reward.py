"""Rewards from models: the ranks of ``reward.sources``' reward models and LLM judges.

``RewardModelWorker`` holds every ``kind: model`` source's sequence-classification model and
scores prompt + response, rendered through that model's own chat template (its tokenizer, not
the policy's: a reward model reads the conversation as it was trained to), one score per
sequence: the score head's output at the sequence's last token. ``JudgeWorker`` holds every
``kind: judge`` source's causal LM and asks it, through its chat template, the source's grading
``template``; it returns the replies, which the driver parses (fitrl/rewards/mix.py,
``parse_grade``) so that an unparsed reply is counted where the reward is assembled.

Both are roles like the reference: registered in ``ROLES`` (fitrl/roles/workers.py) with their
memory planners (fitrl/memory/roles.py), one rank per policy rank, colocated rank by rank under
Ray and FSDP2-sharded there, weights in host memory between calls with ``fsdp.offload_params``.
Their phase is the step's ``reward`` phase. Sequences are right-padded: positions count real
tokens as in an unpadded forward, and no real token attends to padding (causal attention).
"""

from __future__ import annotations

from typing import Any

import torch

from fitrl.config import ConfigError
from fitrl.config.reward_sources import RewardSourceConfig
from fitrl.config.schema import FitrlConfig
from fitrl.core.device import resolve_device
from fitrl.core.padding import left_pad, right_pad
from fitrl.data.batch import Batch
from fitrl.distributed.sharding import gathered_for_generation
from fitrl.models.check import check_weights, read_model_config
from fitrl.models.description import ModelDescription, RunModels
from fitrl.models.loading import build_model, described, load_tokenizer
from fitrl.ops.score import last_token_scores
from fitrl.roles.offload import OffloadBetweenPhases
from fitrl.telemetry.guard import GUARD
from fitrl.telemetry.progress import PROGRESS
from fitrl.workers.group import dispatch

__all__ = ["JudgeWorker", "RewardModelWorker", "check_reward_sources", "judge_prompt", "sources_of"]


def sources_of(cfg: FitrlConfig, kind: str) -> dict[str, RewardSourceConfig]:
    """The run's ``reward.sources`` of ``kind`` (``function``, ``model``, ``judge``), by name."""
    return {name: s for name, s in cfg.reward.sources.items() if s.kind == kind}


def length_cap(cfg: FitrlConfig, src: RewardSourceConfig) -> int:
    """Tokens a scored (reward model) or prompted (judge, before its template's own) sequence keeps."""
    return src.max_length or cfg.data.max_prompt_length + cfg.rollout.max_response_length


def check_reward_sources(cfg: FitrlConfig, models: RunModels | None = None) -> None:
    """Before any model loads: each model source's directory, what its config says it is, and a
    chat template in its tokenizer (one line each, naming the key and the fix). ``models``: the
    run's descriptions (fitrl/models/description.py), whose configs are not read again."""
    for name, src in cfg.reward.sources.items():
        if src.kind == "function":
            continue
        key = f"reward.sources.{name}.model.path"
        known = models.get(f"reward.sources.{name}.model") if models is not None else None
        config = known.config if known is not None else read_model_config(src.model.path, key)
        check_weights(src.model.path, config, key)
        archs = config.get("architectures") or []
        classifier = any(a.endswith("ForSequenceClassification") for a in archs)
        if src.kind == "model" and not classifier:
            raise ConfigError(f"{key}={src.model.path} is a {', '.join(archs) or 'model without architectures'}, not a "
                              f"reward model (…ForSequenceClassification with one label, e.g. from `fitrl "
                              f"make-tiny-model --head reward`); a causal LM grades as kind: judge")
        if src.kind == "judge" and classifier:
            raise ConfigError(f"{key}={src.model.path} is a reward model ({archs[0]}), which cannot reply: use it "
                              f"as kind: model")
        tokenizer = load_tokenizer(src.model, key=f"reward.sources.{name}.model")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{key}={src.model.path}: its tokenizer has no chat template, which renders the "
                              f"{'prompt and response' if src.kind == 'model' else 'grading prompt'} for it; add "
                              f"'chat_template' to its tokenizer_config.json (or point tokenizer_path at a tokenizer "
                              f"that has one)")


def _flat_prompt(messages: list[dict]) -> str:
    """The prompt as a judge reads it: the conversation's non-system turns, one per paragraph."""
    return "\n\n".join(m["content"] for m in messages if m["role"] != "system")


def judge_prompt(src: RewardSourceConfig, messages: list[dict], response: str, answer: Any) -> str:
    """The user turn a judge is sent: the source's template, filled in."""
    return src.template.format(prompt=_flat_prompt(messages), response=response,
                               answer="" if answer is None else str(answer))


class _ModelSource:
    """One source's model, tokenizer and offload on this rank."""

    def __init__(self, cfg: FitrlConfig, name: str, src: RewardSourceConfig, head: str, device: torch.device,
                 description: ModelDescription):
        self.name, self.src, self.device = name, src, device
        self.tokenizer = load_tokenizer(src.model, key=f"reward.sources.{name}.model")
        self.model = build_model(head, src.model, src, device, what=f"reward.sources.{name}.model.path",
                                 nnodes=cfg.trainer.nnodes, description=description)
        self.model.eval().requires_grad_(False)
        self.offload = OffloadBetweenPhases(self.model, src.fsdp, device, trim=cfg.memory.trim_heap)
        self.cap = length_cap(cfg, src)
        end = self.tokenizer.eos_token_id
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (end or 0)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (the chat template wrote its special tokens), the last ``cap`` kept."""
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [seq[-self.cap:] for seq in ids]


class _SourcesWorker:
    """The models of every ``reward.sources`` entry of ``kind`` on one rank, built as ``head``."""
    kind, head = "", ""

    def __init__(self, cfg: FitrlConfig, *, rank: int, world_size: int, models: RunModels | None = None):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = resolve_device(cfg.trainer.device)
        GUARD.configure(cfg.memory)
        self.sources = [_ModelSource(cfg, name, src, self.head, self.device,
                                     described(models, f"reward.sources.{name}.model", src.model))
                        for name, src in sources_of(cfg, self.kind).items()]


class RewardModelWorker(_SourcesWorker):
    """The reward models of ``reward.sources`` (``kind: model``) on one rank."""
    kind, head = "model", "reward"

    def render(self, source: _ModelSource, messages: list[dict], response: str) -> str:
        return source.tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}],
                                                    tokenize=False)

    @dispatch("dp")
    @torch.no_grad()
    def score(self, batch: Batch) -> Batch:
        """``batch``: ``prompt_messages`` and ``response_text`` per sequence; returns each source's
        (B,) scores under its name."""
        out = {}
        for s in self.sources:
            texts = [self.render(s, m, r) for m, r in zip(batch["prompt_messages"], batch["response_text"])]
            seqs = s.encode(texts)
            scores = []
            with s.offload.phase():
                for i in range(0, len(seqs), s.src.micro_batch_size):
                    GUARD.check(self.device)  # safe point (read-only phase)
                    micro = seqs[i:i + s.src.micro_batch_size]
                    ids, mask = right_pad(micro, s.pad, max(map(len, micro)))
                    scores.append(last_token_scores(s.model, ids.to(self.device), mask.to(self.device)).cpu())
                    PROGRESS.beat()  # a micro-batch: progress for the hang watchdog
                    s.offload.micro_batch_done()
            out[s.name] = torch.cat(scores) if scores else torch.zeros(0)
        return Batch(out)


class JudgeWorker(_SourcesWorker):
    """The LLM judges of ``reward.sources`` (``kind: judge``) on one rank: greedy replies."""
    kind, head = "judge", "causal_lm"

    def __init__(self, cfg: FitrlConfig, *, rank: int, world_size: int, models: RunModels | None = None):
        super().__init__(cfg, rank=rank, world_size=world_size, models=models)
        for s in self.sources:  # a prompted sequence holds the template's own tokens besides the run's caps
            s.cap += _template_tokens(s)

    @dispatch("dp")
    @torch.no_grad()
    def judge(self, batch: Batch) -> Batch:
        """``batch``: ``prompt_messages``, ``response_text`` and ``answer`` per sequence; returns
        each source's replies (text) under its name."""
        out: dict[str, list[str]] = {}
        for s in self.sources:
            turns = [s.tokenizer.apply_chat_template(
                        [{"role": "user", "content": judge_prompt(s.src, m, r, a)}], add_generation_prompt=True,
                        tokenize=False)
                     for m, r, a in zip(batch["prompt_messages"], batch["response_text"], batch["answer"])]
            seqs = s.encode(turns)
            replies: list[str] = []
            # FSDP2: the full weights once for the call (ranks decode different numbers of tokens,
            # which per-layer all-gathers in every step would have to match)
            with s.offload.phase(), gathered_for_generation(s.model):
                for i in range(0, len(seqs), s.src.micro_batch_size):
                    GUARD.check(self.device)
                    micro = seqs[i:i + s.src.micro_batch_size]
                    ids, mask = left_pad(micro, s.pad, max(map(len, micro)))
                    new = s.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                           max_new_tokens=s.src.max_tokens, do_sample=False, pad_token_id=s.pad)
                    replies += s.tokenizer.batch_decode(new[:, ids.shape[1]:].cpu(), skip_special_tokens=True)
                    PROGRESS.beat()
                    s.offload.micro_batch_done()
            out[s.name] = replies
        return Batch(fields=out)


def _template_tokens(s: _ModelSource) -> int:
    """The grading template's own tokens (in the judge's chat template): what a prompted sequence
    may hold beyond the run's caps."""
    empty = judge_prompt(s.src, [], "", "")
    text = s.tokenizer.apply_chat_template([{"role": "user", "content": empty}], add_generation_prompt=True,
                                           tokenize=False)
    return len(s.tokenizer(text, add_special_tokens=False)["input_ids"])
