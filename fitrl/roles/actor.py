"""The policy-training piece: log-probs, the micro-batched PPO-style update, the optimizer.

Gradient accumulation uses *global* denominators: every micro-batch's loss is divided by the
token count of its whole mini-batch, so the accumulated gradient equals the gradient of the
mini-batch loss whatever the micro-batch size (tested as an invariance).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch

from fitrl.algo.distill import mix_distill_loss
from fitrl.algo.kl import KL_ESTIMATORS
from fitrl.algo.losses import LOSS_AGGREGATIONS, POLICY_LOSSES, Denominators, aggregate
from fitrl.algo.mismatch import mismatch_metrics, truncated_is_weights
from fitrl.config.schema import ActorConfig, AlgorithmConfig, OptimConfig
from fitrl.core.device import autocast, low_precision_backward
from fitrl.data.batch import Batch
from fitrl.data.balance import micro_batches_by_tokens
from fitrl.distributed.collectives import all_reduce_max, all_reduce_max_float, all_reduce_sum
from fitrl.distributed.sharding import sharding_units
from fitrl.distributed.ulysses import SequenceGroup, over_pass, sum_gradients
from fitrl.ops.varlen import packed_attention
from fitrl.models.families.base import TEXT_INPUTS, ModelInputs
from fitrl.ops.logprob import response_logprobs
from fitrl.ops.packed import can_pack
from fitrl.roles.distill import DistillTerm
from fitrl.roles.moe import MoeTerms, moe_pass
from fitrl.telemetry.guard import GUARD
from fitrl.telemetry.progress import PROGRESS


FUSED_DEVICES = ("cpu", "cuda")  # where torch 2.13's fused AdamW kernel exists
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def can_fuse(params: list[torch.Tensor]) -> bool:
    """Can torch's fused AdamW take these parameters (all on one supported device type, floating)?"""
    types = {p.device.type for p in params}
    return len(types) == 1 and types <= set(FUSED_DEVICES) and all(p.dtype in FUSED_DTYPES for p in params)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # the fused kernel: one pass over each tensor instead of ~10 elementwise ops, 4x faster on CPU
    fused = {"fused": True} if cfg.fused and can_fuse(params) else {}
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                             **fused)


def apply_configured_lr(scheduler: torch.optim.lr_scheduler.LambdaLR, lr: float) -> None:
    """After a resume: the configured peak lr wins over the checkpoint's. The restored scheduler
    and optimizer state carry the lr they were saved with, so a run resumed with a changed
    ``optim.lr`` (``checkpoint.strict_config=false``) would otherwise train on the old one."""
    scheduler.base_lrs = [lr] * len(scheduler.optimizer.param_groups)
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of the peak lr for RL step ``step`` (0-based): linear warm-up, then constant or cosine."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - cfg.warmup_steps - 1)  # the last step (total_steps - 1) reaches the floor
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def aggregate_like(global_value: torch.Tensor, denom: Denominators, local: Denominators, mode: str) -> torch.Tensor:
    """Rescale a value aggregated with the mini-batch's denominators to this micro-batch's own."""
    if mode == "token-mean":
        return global_value.detach() * denom.tokens / local.tokens
    return global_value.detach() * denom.sequences / local.sequences


class WeightedMetrics:
    """Averages micro-batch metrics weighted by their token share of their mini-batch: the
    token mean within each mini-batch (not a mean of micro-batch means), averaged over the
    mini-batches (each optimizer step counts once)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)

    def add(self, metrics: dict[str, torch.Tensor | float], weight: float) -> None:
        for k, v in metrics.items():
            self.sums[k] += float(v) * weight
            self.weights[k] += weight

    def result(self) -> dict[str, float]:
        return {k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}


class Actor:
    def __init__(self, model: torch.nn.Module, actor_cfg: ActorConfig, algo_cfg: AlgorithmConfig, total_steps: int,
                 seed: int = 0, max_response_length: int = 1, inputs: ModelInputs = TEXT_INPUTS,
                 autocast_dtype: torch.dtype | None = None, after_micro_batch: Callable[[], object] | None = None,
                 sequence_group: SequenceGroup | None = None, device: torch.device | None = None):
        self.model = model
        # where the forwards compute (parameters offloaded by FSDP2 live on the host): None, the
        # parameters' device
        self.device = device if device is not None else next(model.parameters()).device
        # Ulysses: this rank and the others of its group hold the same micro-batches, each running
        # its chunk of every sequence (fitrl/distributed/ulysses.py)
        self.sequence_group = sequence_group
        # called once a micro-batch's tensors are freed (its forward, or forward and backward): a CPU
        # process trims its heap there (memory.trim_heap; fitrl/roles/workers.py, OffloadBetweenPhases)
        self.after_micro_batch = after_micro_batch or (lambda: None)
        # mixed precision in one process: each forward under autocast (one context per forward: its
        # cache of low-precision weights must not outlive an optimizer step)
        self.autocast_dtype = autocast_dtype
        self.inputs = inputs  # the family's extra forward inputs (a VL model's images)
        self.max_response_length = max_response_length  # Dr.GRPO's constant normaliser
        self.seed = seed
        self.num_updates = 0  # RL steps optimised so far (seeds the mini-batch shuffle)
        self.cfg = actor_cfg
        self.algo = algo_cfg
        self.optimizer = build_optimizer(model, actor_cfg.optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, actor_cfg.optim, total_steps))
        self.policy_loss = POLICY_LOSSES.get(algo_cfg.policy_loss)
        LOSS_AGGREGATIONS.get(algo_cfg.loss_agg_mode)  # fail at start-up on a typo
        self.kl_fn = KL_ESTIMATORS.get(algo_cfg.kl_estimator) if algo_cfg.use_kl_loss else None
        self.correction = algo_cfg.rollout_correction if algo_cfg.rollout_correction.mode != "off" else None
        # on-policy distillation (the batch carries the teacher's columns: fitrl/roles/teacher.py)
        self.distill = DistillTerm(algo_cfg, self.policy_loss) if algo_cfg.distill.enabled else None
        self.distill_weight = algo_cfg.distill.weight  # this update's (update() sets it: a decaying weight)
        self.moe = MoeTerms.for_model(model, actor_cfg)  # a mixture of experts' loss, replay, metrics; None: dense

    def state_dict(self) -> dict:
        """What a checkpoint needs besides the weights and AdamW moments (saved by DCP)."""
        return {"scheduler": self.scheduler.state_dict(), "num_updates": self.num_updates}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])  # after the optimizer's state (its lr too)
        apply_configured_lr(self.scheduler, self.cfg.optim.lr)
        self.num_updates = int(state["num_updates"])

    @torch.no_grad()
    def compute_logprob(self, batch: Batch, temperature: float, measure_routing: bool = True) -> Batch:
        """(B, R) log-probs and entropies of the responses under the current weights.
        ``measure_routing``: a MoE's routing here is the step's ``moe/*`` (fitrl/roles/moe.py)."""
        self.model.eval()
        shape = batch["responses"].shape
        logp = torch.zeros(shape, dtype=torch.float32, device=batch["responses"].device)
        entropy = torch.zeros_like(logp)
        with self.sequence_parallel():
            for ix in self.partition(batch, self.cfg.logprob_micro_batch_size):
                GUARD.check(logp.device)  # safe point (read-only phase; same count on every rank)
                PROGRESS.beat()
                micro = batch.index(ix)
                with moe_pass(self.moe, micro, measure=measure_routing):
                    logp[ix], entropy[ix] = self._forward(micro, temperature, with_entropy=True)
                self.after_micro_batch()
        return Batch({"old_logprobs": logp, "entropy": entropy})

    def partition(self, batch: Batch, size: int) -> list[list[int]]:
        """Micro-batch indices: consecutive runs of ``size``, or, with a token budget, groups of
        similar length whose padded (or, with packing, packed) size stays within it, as many on
        every rank (under FSDP2 each forward is a collective)."""
        budget = self.cfg.micro_batch_token_budget
        if not budget:
            return [list(range(i, min(i + size, len(batch)))) for i in range(0, len(batch), size)]
        lengths = batch["attention_mask"].sum(-1).tolist()
        # images ride only with a multimodal rope's (B, k, T) positions, which can_pack refuses
        # (Ulysses keeps one sequence per row: its forward holds the padded size)
        packed = self.cfg.packing and self.sequence_group is None and can_pack(self.model, batch["position_ids"], None)
        bins = micro_batches_by_tokens(lengths, budget, packed=packed)
        count = all_reduce_max(len(bins), batch["attention_mask"].device)
        return bins if count == len(bins) else micro_batches_by_tokens(lengths, budget, count, packed)

    def _forward(self, micro: Batch, temperature: float, with_entropy: bool, entropy_grad: bool = False):
        with autocast(micro["input_ids"].device, self.autocast_dtype):
            return self._logprobs(micro, temperature, with_entropy, entropy_grad)

    def _logprobs(self, micro: Batch, temperature: float, with_entropy: bool, entropy_grad: bool):
        return response_logprobs(
            self.model, micro["input_ids"], micro["attention_mask"], micro["position_ids"],
            micro["responses"].shape[1], temperature=temperature,
            chunk_size=self.cfg.logprob_chunk_size, with_entropy=with_entropy, entropy_grad=entropy_grad,
            model_kwargs=self.inputs.extra(micro, micro["input_ids"].device), share_prompts=self.cfg.share_prompts,
            pack=self.cfg.packing, sequence_group=self.sequence_group,
        )

    def denominators(self, mini: Batch) -> Denominators:
        """Token and sequence counts of the mini-batch summed over all data-parallel ranks: each
        rank's loss is then its exact share of the global loss, and summed gradients are exact."""
        device = mini["response_mask"].device
        copies = self.sequence_group.size if self.sequence_group is not None else 1  # a group's ranks hold the same
        tokens = all_reduce_sum(float(mini["response_mask"].sum()), device) / copies
        sequences = all_reduce_sum(float(len(mini)), device) / copies
        return Denominators(tokens=max(tokens, 1.0), sequences=max(sequences, 1.0),
                            max_response_length=self.max_response_length)

    def update(self, batch: Batch, *, sequences_per_mini_batch: int, temperature: float,
               old_logprobs_from: str = "batch", supervised: bool = False,
               distill_weight: float | None = None) -> dict[str, float]:
        """One RL step of optimisation over ``batch`` (needs advantages, ref_logprobs when KL is in
        the loss, rollout_logprobs with ``algorithm.rollout_correction``, and the teacher's columns
        with ``algorithm.distill``: fitrl/roles/teacher.py). ``old_logprobs_from``
        (FitrlConfig.old_logprob_source, said by the caller): ``batch``, the batch's old_logprobs
        (a pass before the update, or the engine's); ``update``, this update's own forward,
        detached: one optimizer step on fresh samples, whose weights are the behaviour policy.

        ``supervised``: a step of supervised fine-tuning instead (``fitrl sft``): the responses
        are the targets and the loss their negative log-likelihood (:meth:`_micro_nll`), with the
        same mini-batches, micro-batches, clipping, schedule and metrics.

        ``distill_weight``: this step's distillation weight (``algorithm.distill.weight_at``, said
        by the loop); unset: the configured one. At 0 the batch needs no teacher columns."""
        self.model.train()
        self.distill_weight = (0.0 if self.distill is None else
                               self.distill.weight if distill_weight is None else float(distill_weight))
        metrics = WeightedMetrics()
        grad_norms, skipped = [], 0
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.num_updates)
        # the update's own forward is the behaviour policy: it fills `folded`, (B, R)
        folded = None
        if supervised:
            pass
        elif old_logprobs_from == "update":
            if self.cfg.ppo_epochs != 1 or len(batch) > sequences_per_mini_batch:
                raise RuntimeError("the update needs old_logprobs when it takes more than one optimizer step")
            folded = torch.zeros_like(batch["responses"], dtype=torch.float32)
        elif old_logprobs_from != "batch" or "old_logprobs" not in batch:
            raise RuntimeError(f"the update was told its old_logprobs come from {old_logprobs_from!r}, and the "
                               f"batch has {'them' if 'old_logprobs' in batch else 'none'}")
        for _ in range(self.cfg.ppo_epochs):
            order = (torch.randperm(len(batch), generator=generator) if self.cfg.shuffle_mini_batches
                     else torch.arange(len(batch)))
            for mini in batch.index(order).split(sequences_per_mini_batch):
                self.optimizer.zero_grad(set_to_none=True)
                self.accumulate_gradients(mini, temperature, metrics, folded=folded, supervised=supervised)
                grad_norm = self._clip_grad()
                if math.isfinite(grad_norm):
                    self.optimizer.step()
                else:  # a non-finite gradient would poison Adam's moments for good
                    skipped += 1
                    self.optimizer.zero_grad(set_to_none=True)
                grad_norms.append(grad_norm)
        # Free the gradients (4 bytes per parameter in fp32, per rank's shard under FSDP2): the
        # next update recreates them, and rollout and log-prob phases have no use for them.
        self.optimizer.zero_grad(set_to_none=True)
        out = metrics.result()
        finite = [g for g in grad_norms if math.isfinite(g)]
        out["actor/grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
        out["actor/skipped_steps"] = float(skipped)
        out["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        if folded is not None and "rollout_logprobs" in batch:
            out.update(self.folded_mismatch(batch, folded[torch.argsort(order)]))
        # read by the driver's divergence judge (fitrl/trainer/divergence.py)
        out["actor/weights_nonfinite"] = nonfinite_weights(self.model, batch["response_mask"].device)
        if self.moe is not None:
            out.update(self.moe.metrics())
        self.scheduler.step()
        self.num_updates += 1
        return out

    def accumulate_gradients(self, mini: Batch, temperature: float, metrics: WeightedMetrics,
                             folded: torch.Tensor | None = None, supervised: bool = False) -> None:
        """Backward over ``mini`` in micro-batches; the grads equal those of the whole mini-batch
        loss. ``folded`` (rows in ``mini``'s order): receives the forward's detached log-probs,
        which serve as the behaviour log-probs when ``mini`` has none."""
        denom = self.denominators(mini)
        with self.sequence_parallel():  # (over backward too: checkpointed layers run forward again)
            for ix in self.partition(mini, self.cfg.micro_batch_size):
                PROGRESS.beat()  # a micro-batch: progress for the hang watchdog
                micro = mini.index(ix)
                # a MoE's routers over forward and backward (a checkpointed layer routes again): fitrl/roles/moe.py
                with moe_pass(self.moe, micro, measure=folded is not None, loss=not supervised):
                    if supervised:
                        loss, m, logp = self._micro_nll(micro, denom)
                    else:
                        loss, m, logp = self._micro_loss(micro, denom, temperature,
                                                         own_old_logprobs=folded is not None)
                    with low_precision_backward(micro["input_ids"].device, self.autocast_dtype):
                        loss.backward()
                if folded is not None:
                    folded[ix] = logp
                metrics.add(m, float(micro["response_mask"].sum()) / denom.tokens)
                del micro, loss
                self.after_micro_batch()

    def sequence_parallel(self):
        """What attention runs as over a pass of this actor (forwards and backwards): Ulysses's
        (fitrl/distributed/ulysses.py) with a sequence group, else with packing the varlen kernel
        where it is chosen (fitrl/ops/varlen.py), else the model's own."""
        if self.sequence_group is not None or not self.cfg.packing:
            return over_pass(self.model, self.sequence_group)
        return packed_attention(self.model, self.device)

    def folded_mismatch(self, batch: Batch, old: torch.Tensor) -> dict[str, float]:
        """The rollout engine's log-probs against the update's own (what the separate pass would
        have logged). Means are this rank's (the driver averages ranks); the max is global."""
        rc = self.correction
        m = mismatch_metrics(old, batch["rollout_logprobs"], batch["response_mask"].float(),
                             level=rc.mode if rc is not None else None, cap=rc.cap if rc is not None else 2.0)
        m["rollout/logprob_diff_max"] = all_reduce_max_float(m["rollout/logprob_diff_max"], old.device)
        return m

    def _micro_loss(self, micro: Batch, denom: Denominators, temperature: float, own_old_logprobs: bool = False):
        """(loss, metrics, detached (B, R) log-probs of the micro-batch). ``own_old_logprobs``: the
        behaviour log-probs are this forward's (:meth:`update`'s ``old_logprobs_from="update"``)."""
        mask = micro["response_mask"].float()
        mode = self.algo.loss_agg_mode
        # entropy is logged every step; it joins the graph only when it is in the loss
        entropy_grad = self.cfg.entropy_coeff != 0
        distill = self.distill if self.distill_weight > 0 else None  # (a decayed weight: RL alone)
        if distill is not None:  # (with the student's log-probs at the teacher's top-k ids, when its loss needs them)
            logp, entropy, student_topk = distill.forward(self, micro, temperature, entropy_grad)
        else:
            logp, entropy = self._forward(micro, temperature, with_entropy=True, entropy_grad=entropy_grad)
        # the behaviour policy: recomputed before the update, or (one on-policy step) these very
        # weights, so ratio = exp(logp - sg(logp)) = 1 with the gradient of logp
        old_logprobs = logp.detach() if own_old_logprobs else micro["old_logprobs"]
        advantages = micro["advantages"]  # (B, R)
        if self.correction is not None:
            # TIS. Every per-token policy loss here is positively homogeneous in its A: PPO-clip's
            # max(-A r, -A clip(r)) keeps the same winner when both terms scale by w > 0 (and the
            # dual-clip cap -A c scales with them, A's sign unchanged), GSPO's is the same surrogate,
            # CISPO's -sg(r) A logp is linear. So A_t * w_t gives loss_t * w_t, veRL's pg_losses * w,
            # before any aggregation (w = 0, an underflow, gives 0 either way). The weights come
            # from this micro-batch's own columns (a sequence's from its row): micro-batch invariant.
            advantages = advantages * truncated_is_weights(old_logprobs, micro["rollout_logprobs"], mask,
                                                           self.correction.mode, self.correction.cap)
        clip = dict(clip_ratio_low=self.cfg.clip_ratio_low, clip_ratio_high=self.cfg.clip_ratio_high,
                    clip_ratio_c=self.cfg.clip_ratio_c)
        pg_loss, m = self.policy_loss(logp, old_logprobs, advantages, mask, agg_mode=mode, denom=denom, **clip)
        m = {k: v for k, v in m.items()}
        loss = pg_loss
        # Loss terms are globally scaled pieces of the mini-batch loss; the logged values are
        # rescaled to this micro-batch's own token mean so WeightedMetrics can average them.
        local = Denominators(tokens=float(mask.sum().clamp(min=1)), sequences=float(len(micro)),
                             max_response_length=denom.max_response_length)
        if distill is not None:  # (1 - w) * policy loss + w * distillation loss (w = 1: rewards only logged)
            d = distill
            distill_loss, dm = d.loss(micro, logp, old_logprobs, student_topk, mask, denom,
                                      on_policy=own_old_logprobs, **clip)
            loss = mix_distill_loss(pg_loss, distill_loss, self.distill_weight)
            m.update(dm)
            m["distill/loss"] = aggregate_like(distill_loss, denom, local, d.agg_mode)
        with torch.no_grad():
            m["actor/pg_loss"] = aggregate_like(pg_loss, denom, local, mode)
            m["actor/entropy"] = aggregate(entropy.detach(), mask, "token-mean", local)
        if self.cfg.entropy_coeff:
            loss = loss - self.cfg.entropy_coeff * aggregate(entropy, mask, mode, denom)
        if self.kl_fn is not None:
            kl = self.kl_fn(logp, micro["ref_logprobs"])
            loss = loss + self.algo.kl_coef * aggregate(kl, mask, mode, denom)
            m["actor/kl_loss"] = aggregate(kl.detach(), mask, "token-mean", local)
        if self.moe is not None:  # the router's load-balancing loss, this micro-batch's token share of it
            loss = loss + self.moe.aux_term(m, local.tokens / denom.tokens)
        return loss, m, logp.detach()

    def _micro_nll(self, micro: Batch, denom: Denominators):
        """Supervised fine-tuning's (loss, metrics, detached log-probs): the targets' negative
        log-likelihood at temperature 1, aggregated as ``algorithm.loss_agg_mode`` says (its
        ``token-mean`` default weighs every target token alike, over the whole mini-batch)."""
        mask = micro["response_mask"].float()
        logp, entropy = self._forward(micro, 1.0, with_entropy=True)
        loss = aggregate(-logp, mask, self.algo.loss_agg_mode, denom)
        local = Denominators(tokens=float(mask.sum().clamp(min=1)), sequences=float(len(micro)),
                             max_response_length=denom.max_response_length)
        with torch.no_grad():
            m = {"sft/nll": aggregate(-logp.detach(), mask, "token-mean", local),
                 "actor/entropy": aggregate(entropy.detach(), mask, "token-mean", local)}
        return loss, m, logp.detach()

    def _clip_grad(self) -> float:
        if self.sequence_group is not None and not sharding_units(self.model):
            sum_gradients(self.model, self.sequence_group.group)  # a sharded model's backend sums them
        return clip_gradients(self.model, self.cfg.optim.grad_clip)


def nonfinite_weights(model: torch.nn.Module, device: torch.device) -> float:
    """How many trained parameter tensors hold a NaN or an infinity, summed over ranks (a
    collective under a process group: every rank calls it). One max-|w| reduction per tensor, no
    copy; under FSDP2 each rank reads only its own shards. Skipping non-finite gradient steps keeps
    NaN out of Adam, but an update of finite size can still overflow a weight to infinity."""
    peaks = []
    for p in model.parameters():
        if p.requires_grad:  # a frozen base cannot change; its load was checked
            local = p.to_local() if hasattr(p, "to_local") else p  # DTensor: this rank's shard
            if local.numel():
                peaks.append(torch.linalg.vector_norm(local.detach(), ord=float("inf")).float().to(device))
    count = float((~torch.isfinite(torch.stack(peaks))).sum()) if peaks else 0.0
    return all_reduce_sum(count, device)


def clip_gradients(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (0 disables clipping); returns the norm before clipping.
    With FSDP2 the gradients are DTensor shards and the norm comes back as a DTensor."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
