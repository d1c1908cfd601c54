"""The teacher of on-policy distillation (``algorithm.distill``, docs/algorithms.md): a frozen
model scoring the student's own rollouts token by token.

Built and placed as the reference is (fitrl/roles/workers.py, ``ReferenceWorker``): its own model
through the same loading code (fitrl/models/loading.py, sharded by ``teacher.sharding`` under
Ray), its own worker group colocated rank by rank on the policy's bundles, or in one process
beside the policy. Its pass is the reference's log-prob pass over the rollout
(``teacher_logprob``, fitrl/trainer/loop.py): the teacher's log-prob of each sampled token, and
with ``algorithm.distill.top_k`` its k likeliest tokens' log-probs and ids per position
(fitrl/roles/topk_heads.py). The actor's loss reads them (fitrl/roles/distill.py); its memory
is planned by ``TeacherPlanner`` (fitrl/memory/roles.py).
"""

from __future__ import annotations

import contextlib

import torch

from fitrl.config.schema import FitrlConfig
from fitrl.core.device import autocast, resolve_device
from fitrl.data.batch import Batch
from fitrl.models.description import RunModels
from fitrl.models.loading import build_model, described
from fitrl.ops.logprob import response_logprobs
from fitrl.ops.varlen import packed_attention
from fitrl.roles.offload import OffloadBetweenPhases, low_precision
from fitrl.roles.topk_heads import teacher_token_stats
from fitrl.telemetry.guard import GUARD
from fitrl.telemetry.progress import PROGRESS
from fitrl.workers.group import dispatch


class TeacherWorker:
    """One rank of the teacher: ``compute_teacher_logprob`` over its share of a rollout."""

    def __init__(self, cfg: FitrlConfig, *, rank: int, world_size: int, models: RunModels | None = None):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = resolve_device(cfg.trainer.device)
        GUARD.configure(cfg.memory)
        model_cfg = cfg.teacher.model
        description = described(models, "teacher.model", model_cfg)
        self.model = build_model("causal_lm", model_cfg, cfg.teacher, self.device, what="teacher.model.path",
                                 nnodes=cfg.trainer.nnodes, description=description)
        self.model.eval().requires_grad_(False)
        self.inputs = description.family.inputs_for(self.model)
        self.offload = OffloadBetweenPhases(self.model, cfg.teacher.fsdp, self.device, trim=cfg.memory.trim_heap)
        self.top_k = cfg.algorithm.distill.top_k
        # the top-k ids index the student's vocabulary too: a teacher's padded embedding may have
        # more rows than the student's (the ids past it are never tokens of the shared tokenizer)
        student = described(models, "actor.model", cfg.actor.model).vocab_size
        self.vocab = min(self.model.get_output_embeddings().weight.shape[0], student)

    def _attention(self):
        """As the policy's passes without sequence parallelism (the teacher's ranks each run
        whole sequences: fitrl/roles/actor.py, ``Actor.sequence_parallel``)."""
        return packed_attention(self.model, self.device) if self.cfg.actor.packing else contextlib.nullcontext()

    @dispatch("dp")
    @torch.no_grad()
    def compute_teacher_logprob(self, batch: Batch) -> Batch:
        """``teacher_logprobs`` (B, R) fp32 at the rollout's temperature (the distribution the
        student sampled from is scored against the teacher's at the same temperature), and with
        ``top_k`` ``teacher_topk_logprobs`` (B, R, k) fp32 and ``teacher_topk_ids`` (B, R, k) long."""
        batch = batch.to(self.device)
        a, t = self.cfg.actor, self.cfg.rollout.temperature
        logps, topk, ids = [], [], []
        with self.offload.phase(), autocast(self.device, low_precision(self.cfg.autocast_dtype("teacher"))), \
                self._attention():
            for micro in batch.split(self.cfg.teacher.logprob_micro_batch_size):
                GUARD.check(self.device)  # safe point (read-only phase)
                PROGRESS.beat()
                extra = self.inputs.extra(micro, self.device)
                if self.top_k:
                    lp, values, at = teacher_token_stats(
                        self.model, micro, top_k=self.top_k, vocab=self.vocab, temperature=t,
                        chunk_size=a.logprob_chunk_size, model_kwargs=extra, share_prompts=a.share_prompts,
                        pack=a.packing)
                    topk.append(values)
                    ids.append(at)
                else:  # the reference's pass, on the teacher's model
                    lp, _ = response_logprobs(
                        self.model, micro["input_ids"], micro["attention_mask"], micro["position_ids"],
                        micro["responses"].shape[1], temperature=t, chunk_size=a.logprob_chunk_size,
                        model_kwargs=extra, share_prompts=a.share_prompts, pack=a.packing)
                logps.append(lp)
                self.offload.micro_batch_done()
        out = {"teacher_logprobs": torch.cat(logps)}
        if self.top_k:
            out.update(teacher_topk_logprobs=torch.cat(topk), teacher_topk_ids=torch.cat(ids))
        return Batch(out).to("cpu")

    @dispatch("all")
    def num_parameters(self) -> int:
        # under FSDP2 parameters are DTensors whose numel() is the full (unsharded) size
        return sum(p.numel() for p in self.model.parameters())
