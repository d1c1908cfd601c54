"""A mixture of experts' share of the policy's passes (fitrl/roles/actor.py) and the reference's
(fitrl/roles/workers.py): the router's load-balancing loss in the update, routing replay in the
forwards, and the routing metrics of the old-log-prob pass. The router hooks are
fitrl/models/moe_routing.py's; a dense model has none of this (``MoeTerms.for_model`` is None).

- ``actor.router_aux_loss_coef`` (unset: the model's ``router_aux_loss_coef``) times
  transformers' load-balancing loss of each update micro-batch, weighted by the micro-batch's
  share of its mini-batch's response tokens (over every rank), so that the shares of an
  optimizer step sum to 1: the token-weighted mean of the micro-batches' losses. The loss is
  not linear in its tokens (a product of two means per expert), so, as in transformers, it is
  each micro-batch's own and moves a little with the micro-batch size. Logged as
  ``actor/router_aux_loss``, the coefficient left out.
- ``actor.routing_replay``: every training forward (old log-probs, reference, update) runs the
  response tokens on the experts the engine chose for them (the batch's ``routed_experts``).
- ``moe/*`` (:meth:`fitrl.models.moe_routing.RoutingCounts.metrics`): measured in the forward
  that gives the update its old log-probs, the pass before it or, folded
  (``algorithm.fold_old_logprob``), the update's own; under replay, the router's own choice is
  what is compared with the engine's. With the engine's log-probs as the old ones
  (``algorithm.recompute_old_logprob=false``) no forward runs those weights: none are logged.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from fitrl.config.schema import ActorConfig
from fitrl.core.errors import ConfigError
from fitrl.data.batch import Batch
from fitrl.models.moe_routing import ROUTED_EXPERTS, RouterPass, Routers, RoutingCounts


class MoeTerms:
    def __init__(self, routers: Routers, aux_coef: float, replay: bool) -> None:
        self.routers, self.aux_coef, self.replay = routers, aux_coef, replay
        self.counts = RoutingCounts(routers.layers, routers.experts)
        self.current: Optional[RouterPass] = None  # the micro-batch's pass in progress

    @classmethod
    def for_model(cls, model: nn.Module, cfg: ActorConfig) -> Optional["MoeTerms"]:
        routers = Routers.of(model)
        if routers is None:
            if cfg.routing_replay:
                raise ConfigError(f"actor.routing_replay=true replays a mixture of experts' routing, and the policy "
                                  f"({getattr(model.config, 'model_type', '?')}) routes nothing: set "
                                  f"actor.routing_replay=false")
            return None
        coef = cfg.router_aux_loss_coef
        if coef is None:
            coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
        return cls(routers, coef, cfg.routing_replay)

    @contextlib.contextmanager
    def micro(self, micro: Batch, *, measure: bool = False, loss: bool = False) -> Iterator[RouterPass]:
        """Around one micro-batch's forward (and backward): replay as configured; ``measure``: its
        routing counts toward the step's ``moe/*``; ``loss``: its logits kept for :meth:`aux_term`."""
        p = RouterPass(self.routers, micro["attention_mask"], micro["response_mask"],
                       micro.tensors.get(ROUTED_EXPERTS), replay=self.replay,
                       counts=self.counts if measure else None, capture=loss)
        self.current = p
        try:
            with p:
                yield p
        finally:
            self.current = None

    def aux_term(self, metrics: dict, share: float) -> torch.Tensor:
        """The update loss's term of the micro-batch in progress: coefficient x its load-balancing
        loss x ``share`` (its response tokens over the mini-batch's); logs the loss itself."""
        aux = self.current.aux_loss()
        metrics["actor/router_aux_loss"] = aux.detach()
        return (self.aux_coef * share) * aux

    def metrics(self) -> dict[str, float]:
        """The step's ``moe/*`` metrics (this rank's), and a fresh count for the next step."""
        out = self.counts.metrics()
        self.counts = RoutingCounts(self.routers.layers, self.routers.experts)
        return out


def moe_pass(moe: Optional[MoeTerms], micro: Batch, **kwargs):
    """:meth:`MoeTerms.micro`, or nothing for a dense model."""
    return moe.micro(micro, **kwargs) if moe is not None else contextlib.nullcontext()


def replay_routers(model: nn.Module, cfg: ActorConfig) -> Optional[Routers]:
    """The routers a frozen model's forwards replay through (the reference's), or None: a dense
    model, or ``actor.routing_replay`` off."""
    return Routers.of(model) if cfg.routing_replay else None


def replaying(routers: Optional[Routers], micro: Batch):
    """Around one micro-batch's forward of a frozen model: its response tokens on the recorded experts."""
    if routers is None:
        return contextlib.nullcontext()
    return RouterPass(routers, micro["attention_mask"], micro["response_mask"], micro.tensors.get(ROUTED_EXPERTS),
                      replay=True)
