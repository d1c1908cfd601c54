"""The value model for PPO with GAE: a token-classification head (one output) on the policy
architecture, trained with the clipped value loss.

Values are read at the same positions as the actor's log-probs: the value of the state
*before* response token t is the output at the position that predicts token t.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fitrl.algo.losses import Denominators, value_loss
from fitrl.config.schema import CriticConfig
from fitrl.data.batch import Batch
from fitrl.distributed.collectives import all_reduce_sum
from fitrl.core.packing import pack_layout
from fitrl.core.padding import model_positions, trim_padding
from fitrl.ops.packed import can_pack, packed_forward
from fitrl.models.families.base import TEXT_INPUTS, ModelInputs
from fitrl.telemetry.guard import GUARD
from fitrl.telemetry.progress import PROGRESS
from fitrl.roles.actor import WeightedMetrics, apply_configured_lr, build_optimizer, clip_gradients, lr_factor


def response_values(model: torch.nn.Module, micro: Batch, inputs: ModelInputs = TEXT_INPUTS,
                    pack: bool = False) -> torch.Tensor:
    """(B, R) values at the positions that predict each response token; ``pack``: from a
    padding-free forward (fitrl/ops/packed.py) where it runs fewer positions."""
    R = micro["responses"].shape[1]
    ids, mask, pos, keep = trim_padding(micro["input_ids"], micro["attention_mask"], micro["position_ids"], R)
    extra = inputs.extra(micro, ids.device)
    head = value_head(model)
    if pack and head is not None and can_pack(model, pos, extra):
        layout = pack_layout(mask)
        if layout.shape[0] * layout.shape[1] < ids.numel():
            linear = type(head).forward  # the head's own forward, while the instance's is shadowed
            values = packed_forward(model, head, lambda hidden, _: linear(head, hidden), ids, pos, keep, layout,
                                    causal_lm=False)[..., 0].float()  # (B, R')
            return torch.nn.functional.pad(values, (0, R - keep))
    out = model(input_ids=ids, attention_mask=mask, position_ids=model_positions(pos), use_cache=False, **extra)
    values = out.logits[:, -keep - 1:-1, 0].float()  # (B, R')
    return torch.nn.functional.pad(values, (0, R - keep))


def value_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """A token-classification model's output layer (``score`` in the Llama/Qwen families)."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
    return None


class Critic:
    def __init__(self, model: torch.nn.Module, cfg: CriticConfig, total_steps: int, max_response_length: int,
                 inputs: ModelInputs = TEXT_INPUTS, after_micro_batch: Callable[[], object] | None = None):
        self.model, self.cfg = model, cfg
        self.after_micro_batch = after_micro_batch or (lambda: None)  # as the actor's
        self.inputs = inputs  # the family's extra forward inputs (a VL model's images)
        self.max_response_length = max_response_length
        self.optimizer = build_optimizer(model, cfg.optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.optim, total_steps))

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])  # after the optimizer's state (its lr too)
        apply_configured_lr(self.scheduler, self.cfg.optim.lr)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        self.model.eval()
        values = []
        for m in batch.split(self.cfg.values_micro_batch_size):
            GUARD.check(m["response_mask"].device)  # safe point (read-only phase)
            PROGRESS.beat()
            values.append(response_values(self.model, m, self.inputs, self.cfg.packing) * m["response_mask"])
            self.after_micro_batch()
        return Batch({"values": torch.cat(values)})

    def update(self, batch: Batch, *, sequences_per_mini_batch: int) -> dict[str, float]:
        """Clipped value regression of ``values`` towards ``returns`` (needs values, returns)."""
        self.model.train()
        metrics = WeightedMetrics()
        grad_norms = []
        for _ in range(self.cfg.ppo_epochs):
            for mini in batch.split(sequences_per_mini_batch):
                device = mini["response_mask"].device
                denom = Denominators(tokens=max(all_reduce_sum(float(mini["response_mask"].sum()), device), 1.0),
                                     sequences=all_reduce_sum(float(len(mini)), device),
                                     max_response_length=self.max_response_length)
                self.optimizer.zero_grad(set_to_none=True)
                for micro in mini.split(self.cfg.micro_batch_size):
                    PROGRESS.beat()
                    m_mask = micro["response_mask"].float()
                    loss, m = value_loss(response_values(self.model, micro, self.inputs, self.cfg.packing), micro["values"], micro["returns"],
                                         m_mask, cliprange_value=self.cfg.cliprange_value,
                                         agg_mode=self.cfg.loss_agg_mode, denom=denom)
                    loss.backward()
                    m = dict(m)
                    m["critic/vf_loss"] = loss.detach() * denom.tokens / m_mask.sum().clamp(min=1)
                    metrics.add(m, float(m_mask.sum()) / denom.tokens)
                    del loss
                    self.after_micro_batch()
                norm = clip_gradients(self.model, self.cfg.optim.grad_clip)
                if math.isfinite(norm):
                    self.optimizer.step()
                    grad_norms.append(norm)
        self.optimizer.zero_grad(set_to_none=True)  # as the actor: no gradients held between updates
        self.scheduler.step()
        out = metrics.result()
        out["critic/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        out["critic/lr"] = self.optimizer.param_groups[0]["lr"]
        return out
