"""Which metric keys go on which chart, matched by pattern so that keys this module has never
heard of (a new loss term, a reward component, a data source, a throughput metric) still land
on the right chart, and whatever matches no chart is drawn under "other metrics".

Pure functions on lists of key names; the names follow what the trainer logs
(``fitrl/trainer/loop.py``, ``fitrl/trainer/memory_watch.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from fitrl.rewards import CORRECT_COMPONENTS

REWARD_STATS = {"mean", "std", "max", "min"}
REWARD_HEALTH = {"timeouts", "errors", "degenerate", "degenerate_positive", "worker_restarts"}
"""``reward/<name>`` counters of the scorer (fitrl/roles/reward.py), not reward components."""
SOURCE_WORDS = {"by_source", "source", "sources"}
MEMORY_PREFIX = "mem/"
TIME_PREFIX = "time/"
PERF_PREFIX = "perf/"
MOE_PREFIX = "moe/"
DISTILL_PREFIX = "distill/"


@dataclass
class ChartKeys:
    """One chart's keys: ``keys`` on the left axis, ``secondary`` on a right one."""
    title: str
    keys: list[str]
    secondary: list[str] = field(default_factory=list)
    y_title: str = ""
    secondary_title: str = ""

    def __bool__(self) -> bool:
        return bool(self.keys or self.secondary)


def _segments(key: str) -> list[str]:
    return key.split("/")


def by_source(keys: list[str], prefix: str) -> dict[str, str]:
    """``{source: key}`` of per-source mean rewards under ``prefix`` (``""`` or ``"val/"``):
    ``val/by_source/gsm8k/reward/mean``, ``val/gsm8k/reward/mean``, ``val/reward/mean/gsm8k``
    and the like. Keys with ``@`` (``mean@4``) are the @n metrics, not sources."""
    out = {}
    for key in keys:
        if not key.startswith(prefix) or (prefix == "" and key.startswith("val/")) or "@" in key:
            continue
        parts = _segments(key[len(prefix):])
        if "reward" not in parts or "mean" not in parts:
            continue
        rest = [p for p in parts if p not in {"reward", "mean"} | SOURCE_WORDS]
        if rest:
            out["/".join(rest)] = key
    return out


def at_n(keys: list[str]) -> list[str]:
    """Validation @n metrics (``val/reward/mean@4``, ``val/acc/best@4``, ``val/<src>/maj@4`` ...)."""
    return [k for k in keys if k.startswith("val/") and re.search(r"@\d+", k)]


def validation_accuracy(val_keys: list[str]) -> str | None:
    """The validation key that is the policy's accuracy (``val/reward/accuracy`` or ``.../exact``)."""
    return next((f"val/reward/{c}" for c in CORRECT_COMPONENTS if f"val/reward/{c}" in val_keys), None)


def reward_components(keys: list[str], prefix: str) -> list[str]:
    """``reward/<component>`` means (the reward function's dict entries), not stats or health."""
    out = []
    for key in keys:
        if not key.startswith(prefix + "reward/") or (prefix == "" and key.startswith("val/")):
            continue
        parts = _segments(key[len(prefix):])
        if len(parts) == 2 and parts[1] not in REWARD_STATS | REWARD_HEALTH and "@" not in parts[1]:
            out.append(key)
    return out


def matching(keys: list[str], test: Callable[[str], bool]) -> list[str]:
    return [k for k in keys if not k.startswith(("val/", MEMORY_PREFIX, TIME_PREFIX, PERF_PREFIX)) and test(k)]


def training_charts(step_keys: list[str], val_keys: list[str]) -> list[ChartKeys]:
    """The training charts after the reward: each one's keys, in a fixed order; empty ones are dropped."""
    last = lambda k: _segments(k)[-1]  # noqa: E731
    charts = [
        ChartKeys("Response length and clip ratio",
                  [k for k in ("response/length_mean", "response/length_max", "val/response/length_mean",
                              "val/response/length_max")
                   if k in step_keys or k in val_keys],
                  [k for k in ("response/clip_ratio", "val/response/clip_ratio") if k in step_keys or k in val_keys],
                  y_title="tokens", secondary_title="truncated fraction"),
        ChartKeys("Entropy", matching(step_keys, lambda k: "entropy" in last(k) and not k.startswith(MOE_PREFIX)),
                  y_title="nats/token"),
        ChartKeys("KL", matching(step_keys, lambda k: any(re.search(r"(^|_)kl($|_)", p) for p in _segments(k))
                                 and not k.startswith(DISTILL_PREFIX))),  # (the reference's; the teacher's below)
        ChartKeys("Clip fractions", matching(step_keys, lambda k: "clip_frac" in last(k))),
        ChartKeys("Gradient norm", matching(step_keys, lambda k: last(k) == "grad_norm")),
        ChartKeys("Learning rate", matching(step_keys, lambda k: last(k) in ("lr", "learning_rate"))),
        # a mixture of experts (fitrl/models/moe_routing.py, RoutingCounts.metrics; fitrl/roles/moe.py)
        ChartKeys("Expert load", matching(step_keys, lambda k: k.startswith(MOE_PREFIX + "expert_load")
                                          or k.startswith(MOE_PREFIX + "max_expert")),
                  matching(step_keys, lambda k: "router_aux_loss" in last(k)),
                  y_title="entropy / log E, busiest expert's share", secondary_title="load-balancing loss"),
        ChartKeys("Routing mismatch (engine vs trainer)",
                  matching(step_keys, lambda k: k.startswith(MOE_PREFIX + "routing_mismatch")),
                  y_title="fraction of response tokens"),
        # on-policy distillation (fitrl/algo/distill.py, fitrl/roles/distill.py; the teacher's own: loop.py)
        ChartKeys("Distillation: loss and KL to the teacher", distill_loss_keys(step_keys), y_title="nats/token"),
        ChartKeys("Teacher agreement", [k for k in distill_teacher_keys(step_keys) if "logprob" not in last(k)],
                  [k for k in distill_teacher_keys(step_keys) if "logprob" in last(k)],
                  y_title="fraction of response tokens (top-k: of the mass)",
                  secondary_title="teacher's log-prob of the sampled tokens"),
    ]
    return [c for c in charts if c]


def distill_loss_keys(step_keys: list[str]) -> list[str]:
    """``distill/*`` losses and KLs (``distill/loss``, ``reverse_kl``, ``forward_kl_topk``, ...)."""
    return [k for k in step_keys if k.startswith(DISTILL_PREFIX)
            and (_segments(k)[-1] == "loss" or re.search(r"(^|_)kl($|_)", _segments(k)[-1]))]


def distill_teacher_keys(step_keys: list[str]) -> list[str]:
    """The other ``distill/*`` keys: the teacher on the step's samples (its agreement with them,
    its log-prob of them) and the top-k masses."""
    losses = set(distill_loss_keys(step_keys))
    return [k for k in step_keys if k.startswith(DISTILL_PREFIX) and k not in losses]


def perf_charts(step_keys: list[str]) -> list[ChartKeys]:
    """``perf/*`` (throughput and MFU) grouped by unit: tokens or samples per second, MFU, the rest."""
    perf = [k for k in step_keys if k.startswith(PERF_PREFIX)]
    mfu = [k for k in perf if "mfu" in k.lower()]
    rate = [k for k in perf if k not in mfu and re.search(r"per_s|/s$|_s$|throughput|tps", k.lower())]
    rest = [k for k in perf if k not in mfu and k not in rate]
    charts = [ChartKeys("Throughput", rate, y_title="per second"), ChartKeys("MFU", mfu),
              ChartKeys("Other perf/* metrics", rest)]
    return [c for c in charts if c]


def phase_times(step_keys: list[str]) -> list[str]:
    """``time/<phase>`` in the order the phases ran (first seen), without the step total."""
    return [k for k in step_keys if k.startswith(TIME_PREFIX) and k != "time/step"]


def memory_processes(step_keys: list[str]) -> dict[str, dict[str, set[str]]]:
    """``{process: {phase: {field, ...}}}`` from ``mem/<process>/<phase>/<field>``, in first-seen order."""
    out: dict[str, dict[str, set[str]]] = {}
    for key in step_keys:
        parts = _segments(key)
        if parts[0] + "/" == MEMORY_PREFIX and len(parts) == 4:
            out.setdefault(parts[1], {}).setdefault(parts[2], set()).add(parts[3])
    return out


def other_groups(step_keys: list[str], val_keys: list[str], shown: set[str]) -> dict[str, list[str]]:
    """Every key no chart shows, grouped by its first segment (``advantage``, ``sampling``, ...)."""
    groups: dict[str, list[str]] = {}
    for key in [*step_keys, *val_keys]:
        if key in shown or (key.startswith(MEMORY_PREFIX) and key.count("/") == 3):
            continue
        parts = _segments(key)
        marker = next((i for i, p in enumerate(parts[:-2]) if p in SOURCE_WORDS), None)
        if marker is not None:  # val/by_source/<source>/...: one chart per source
            name = "/".join(parts[:marker + 2])
        else:
            rest = parts[1:] if parts[0] == "val" else parts
            name = ("val/" if parts[0] == "val" else "") + (rest[0] if len(rest) > 1 else "misc")
        groups.setdefault(name, []).append(key)
    return groups
