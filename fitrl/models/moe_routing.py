"""A mixture of experts' routers: what a generation chose, the same choice in a training forward
(routing replay), their disagreement, the experts' load, and the router's load-balancing loss.

transformers' Qwen3-MoE computes each sparse layer's routing in its router module, ``mlp.gate``
(``Qwen3MoeTopKRouter``): logits ``(N, E)`` over the layer's N tokens, softmax, top-k, the top-k
probabilities renormalised with ``norm_topk_prob``; it returns ``(logits, weights, indices)`` and
the experts run what it returns (``Qwen3MoeSparseMoeBlock.forward``). A forward hook on each
router therefore reads the choice and may replace it. Which position each of the N tokens is
comes from :data:`fitrl.ops.token_origin.ORIGINS`, fed by every forward that runs under a hook.

- :class:`RoutingRecorder`: during a generation (fitrl/rollout/hf.py), each sampled token's
  experts, recorded when the token is fed back in (a response's last token never is: its slot
  stays -1, and it predicts nothing the trainer scores). ``(B, R, layers, k)`` int16 on the batch,
  ``routed_experts`` (fitrl/rollout/layout.py), layers being the sparse ones.
- :class:`RouterPass`: one micro-batch's training forward (and its backward, where activation
  checkpointing runs it again): with ``replay`` the recorded experts of the response tokens
  replace the router's own choice, their weights recomputed from the current logits as the
  router computes them (so gradients still reach the router); measured, the router's own choice
  against the recorded one (:class:`RoutingCounts`) and the experts' load; captured, the logits
  for the load-balancing loss (transformers' ``load_balancing_loss_func``: what
  ``output_router_logits=True`` returns, taken here by the hook whatever the forward's layout).

Prompt tokens are not recorded: their routing comes from a prefill, which in the HF engine runs
the trainer's own kernels on the same weights.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from fitrl.core.model_types import MODEL_TYPES
from fitrl.ops.token_origin import ORIGINS

ROUTED_EXPERTS = "routed_experts"
"""The rollout batch's (B, R, sparse layers, k) int16 column of each sampled token's experts (-1: none recorded)."""



def pad_routed(routed: torch.Tensor, width: int) -> torch.Tensor:
    """(B, r, layers, k) -> (B, width, layers, k), the new response slots -1 (none recorded)."""
    return torch.nn.functional.pad(routed, (0, 0, 0, 0, 0, width - routed.shape[1]), value=-1)


_ROUTER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate(?:\.base_layer)*$")  # PEFT's wrapper keeps it as base_layer


@dataclass(frozen=True)
class Routers:
    """Each sparse layer's router module (in layer order) and what routing they share."""

    modules: tuple[nn.Module, ...]
    layers: tuple[int, ...]  # their decoder layers' indices
    experts: int
    top_k: int

    @classmethod
    def of(cls, model: nn.Module) -> Optional["Routers"]:
        """The routers of a mixture-of-experts model (its row's kind: fitrl/core/model_types.py);
        None for a dense one."""
        row = MODEL_TYPES.get(getattr(model.config, "model_type", ""))
        if row is None or row.kind != "moe":
            return None
        found: dict[int, nn.Module] = {}
        for name, module in model.named_modules():  # a wrapper's base_layer comes after it: the router wins
            match = _ROUTER_NAME.search(name)
            if match and hasattr(module, "top_k") and hasattr(module, "num_experts"):
                found[int(match[1])] = module
        if not found:
            raise ValueError(f"{type(model).__name__} is a mixture of experts ({row.name}) with no router at "
                             f"model.layers.<i>.mlp.gate: transformers has changed its module names")
        layers = tuple(sorted(found))
        first = found[layers[0]]
        return cls(tuple(found[i] for i in layers), layers, int(first.num_experts), int(first.top_k))

    def hooks(self, hook) -> list:
        """``hook(j, module, output)`` on every router ``j``'s output, as forward hooks (their handles)."""
        return [m.register_forward_hook(lambda module, _inputs, output, j=j: hook(j, module, output))
                for j, m in enumerate(self.modules)]


def replay_scores(logits: torch.Tensor, indices: torch.Tensor, norm_topk_prob: bool, dtype: torch.dtype) -> torch.Tensor:
    """The routing weights of ``indices`` (N, k) as the router computes its own top-k's from
    ``logits`` (N, E): fp32 softmax probabilities, renormalised over the k when ``norm_topk_prob``,
    cast to the logits' dtype. For the router's own indices these are its values bit for bit."""
    top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(dtype)


class _CallOrigins:
    """The origin of each router call: the :data:`ORIGINS` fed for it. Each layer counts its calls
    since the last feed; a layer run again (activation checkpointing's recompute in backward, after
    a single-call forward) takes the last call's."""

    def __init__(self, layers: int) -> None:
        self.seen = [(-1, 0)] * layers

    def __call__(self, j: int, tokens: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(N,) origins of router ``j``'s call (None: none fed) and (N,) copies (None: one each)."""
        version, count = self.seen[j]
        count = count + 1 if version == ORIGINS.version else 1
        self.seen[j] = (ORIGINS.version, count)
        if not ORIGINS.calls:
            return None, None
        call = min(count, len(ORIGINS.calls)) - 1
        origin, copies = ORIGINS.calls[call].reshape(-1), ORIGINS.copies[call]
        if origin.numel() != tokens:
            raise ValueError(f"a router ran {tokens} tokens where its forward said {origin.numel()}: routing replay "
                             "and the MoE metrics need every token of a sequence on one rank (actor.ulysses_size=1)")
        return origin, copies.reshape(-1) if copies is not None else None


class _Hooked:
    """``self._hook`` on every router of ``self.routers`` while the ``with`` block lasts, the
    token origins of the forwards listened to (fitrl/ops/token_origin.py)."""

    routers: Routers

    def _hook(self, j: int, module: nn.Module, output) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._listen = ORIGINS.listen()
        self._listen.__enter__()
        self._handles = self.routers.hooks(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._listen.__exit__(*exc)


class RoutingRecorder(_Hooked):
    """Records the experts of each sampled token of one generate call of ``rows`` sequences of
    at most ``width`` tokens (the decode paths feed a slot ``row * width + t`` for the call that
    runs response token t, nothing for the prompt's prefill). Kept per call, as int16 on the
    device, until :meth:`result`: memory for the tokens generated, not for ``width`` of them."""

    def __init__(self, routers: Routers, rows: int, width: int, device: torch.device) -> None:
        self.routers, self.rows, self.width, self.device = routers, rows, width, device
        self.calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in routers.modules]
        self.origins = _CallOrigins(len(routers.modules))

    def _hook(self, j: int, _module: nn.Module, output) -> None:
        indices = output[2]
        origin, _ = self.origins(j, indices.shape[0])
        if origin is not None:
            self.calls[j].append((origin, indices.to(torch.int16)))


    def result(self, length: int) -> torch.Tensor:
        """(rows, length, layers, k): the first ``length`` response slots of every row, -1 where
        nothing was recorded."""
        out = torch.full((self.rows, length, len(self.calls), self.routers.top_k), -1, dtype=torch.int16,
                         device=self.device)
        for j, calls in enumerate(self.calls):
            if calls:
                origin = torch.cat([o for o, _ in calls]).to(self.device)
                indices = torch.cat([i for _, i in calls]).to(self.device)
                row, t = origin // self.width, origin % self.width
                keep = (origin >= 0) & (t < length)
                out[row[keep], t[keep], j] = indices[keep]
        return out


@dataclass
class RoutingCounts:
    """Summed over measured forwards: per sparse layer, the response tokens whose recorded experts
    were compared with the router's own choice and those whose sets differed, and each expert's
    share of the response tokens' top-k slots (tensors on the forward's device: no sync per layer)."""

    layers: tuple[int, ...]
    experts: int
    compared: Optional[torch.Tensor] = None    # (L,); None until a measured forward
    mismatched: Optional[torch.Tensor] = None  # (L,)
    load: Optional[torch.Tensor] = None        # (L, E)

    def _start(self, device: torch.device) -> None:
        if self.compared is None:
            L = len(self.layers)
            self.compared = torch.zeros(L, dtype=torch.long, device=device)
            self.mismatched = torch.zeros(L, dtype=torch.long, device=device)
            self.load = torch.zeros(L, self.experts, dtype=torch.long, device=device)

    def metrics(self) -> dict[str, float]:
        """``moe/expert_load_entropy``: each layer's load entropy over log E (1: every expert takes
        as many tokens), averaged over the layers; ``moe/max_expert_share``: the largest share of a
        layer's top-k slots one expert took (1/E when balanced); ``moe/routing_mismatch``: of the
        compared (token, layer) pairs, the fraction whose expert sets differ, and per layer
        ``moe/routing_mismatch/layer{i}`` (i: the decoder layer). Empty before any measured forward."""
        if self.compared is None:
            return {}
        out: dict[str, float] = {}
        load = self.load.double()
        total = load.sum(-1, keepdim=True)
        if bool((total > 0).all()):
            p = load / total
            entropy = -(p * p.clamp(min=1e-30).log()).sum(-1) / math.log(self.experts)
            out["moe/expert_load_entropy"] = float(entropy.mean())
            out["moe/max_expert_share"] = float(p.max())
        compared, mismatched = self.compared.tolist(), self.mismatched.tolist()
        if sum(compared):
            out["moe/routing_mismatch"] = sum(mismatched) / sum(compared)
            for i, c, m in zip(self.layers, compared, mismatched):
                if c:
                    out[f"moe/routing_mismatch/layer{i}"] = m / c
        return out


class RouterPass(_Hooked):
    """One micro-batch's training forward through the routers (the module docstring).

    ``attention_mask`` (B, T) and ``response_mask`` (B, R) are the micro-batch's, ``recorded``
    (B, R, L, k) its ``routed_experts`` or None. ``replay``: the response tokens run
    their recorded experts; ``counts``: the forward's routing is measured into it; ``capture``:
    the router logits are kept for :meth:`aux_loss`. Used as a context manager around the forward
    (and its backward)."""

    def __init__(self, routers: Routers, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                 recorded: Optional[torch.Tensor], *, replay: bool = False, counts: Optional[RoutingCounts] = None,
                 capture: bool = False) -> None:
        B, T = attention_mask.shape
        R = response_mask.shape[1]
        L, k = len(routers.modules), routers.top_k
        if recorded is not None and tuple(recorded.shape[2:]) != (L, k):
            raise ValueError(f"the batch's routed_experts are {tuple(recorded.shape[2:])} (layers, k) per token and "
                             f"{type(routers.modules[0]).__name__} routes {L} layers to {k} experts: not this model's")
        if replay and recorded is None:
            raise RuntimeError("actor.routing_replay=true and the batch carries no routed_experts: its sequences "
                               "came from a path that records none (the HF engine records them; agent episodes and "
                               "`fitrl sft`'s targets do not): set actor.routing_replay=false")
        self.routers, self.replay, self.counts, self.capture = routers, replay, counts, capture
        self.real = attention_mask.bool().reshape(-1)  # (B*T,)
        counted = torch.zeros(B, T, dtype=torch.bool, device=attention_mask.device)
        counted[:, T - R:] = response_mask.bool()
        self.counted = counted.reshape(-1)
        # looked up per call, never spread over the (B, T) grid: a long (B*T, L, k) copy would be
        # 200 MB for 8 x 8192 tokens of Qwen3-30B-A3B's 48 layers x 8 experts
        self.recorded = recorded.to(attention_mask.device) if recorded is not None else None
        self.width, self.prompt = T, T - R
        self.origins = _CallOrigins(L)
        self.armed = True  # measuring and capturing: the forward only, not a recompute in backward
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(L)]
        self.masks: list[torch.Tensor] = []

    def _hook(self, j: int, module: nn.Module, output):
        logits, scores, indices = output
        origin, copies = self.origins(j, indices.shape[0])
        if origin is None:
            raise RuntimeError("a forward ran the routers without saying where its tokens come from "
                               "(fitrl/ops/token_origin.py): every training forward of a MoE must feed ORIGINS")
        valid = origin >= 0
        at = origin.clamp(min=0)
        counted = valid & self.counted[at]
        used = indices
        if self.recorded is not None:
            slot = at % self.width - self.prompt  # (N,) the response token, < 0 on the prompt
            recorded = self.recorded[at // self.width, slot.clamp(min=0), j].long()  # (N, k)
            has = valid & (slot >= 0) & (recorded >= 0).all(-1)
            if self.armed and self.counts is not None:
                compare = has & counted
                differ = (recorded.sort(-1).values != indices.sort(-1).values).any(-1) & compare
                self.counts._start(indices.device)
                self.counts.compared[j] += compare.sum()
                self.counts.mismatched[j] += differ.sum()
            if self.replay:
                used = torch.where(has[:, None], recorded, indices)
                scores = replay_scores(logits, used, bool(getattr(module, "norm_topk_prob", False)), scores.dtype)
        if self.armed and self.counts is not None:
            self.counts._start(indices.device)
            picked = used[counted].reshape(-1)  # (a scatter, not bincount: no host sync on a GPU)
            self.counts.load[j].scatter_add_(0, picked, torch.ones_like(picked))
        if self.armed and self.capture:
            self.logits[j].append(logits)
            if j == 0:  # every layer runs the same tokens; a shared prompt's stand for their group's rows
                real = (valid & self.real[at]).float()
                self.masks.append(real * copies if copies is not None else real)
        return (logits, scores, used) if used is not indices else None

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of this forward's real tokens (prompt and response, as the model's
        own ``output_router_logits`` pass counts its attention mask), over every sparse layer, each
        token weighed by the positions it stands for (whatever the layout: the padded forward's
        value); ends the forward's measuring and capturing."""
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        self.armed = False
        logits = tuple(torch.cat(calls).float() for calls in self.logits)
        mask = torch.cat(self.masks)
        self.logits, self.masks = [[] for _ in self.logits], []
        return load_balancing_loss_func(logits, self.routers.experts, self.routers.top_k, mask)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.logits, self.masks = [], []
