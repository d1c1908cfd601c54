"""TRL's ``GRPOConfig`` names, as a TRL script passes them to ``fitrl.train(...)`` (keyword
arguments or :class:`GRPOConfig`): each one fitrl's key (docs/switching.md's TRL table), or a
one-line refusal naming what to set instead. The loader's did-you-means read it too: a TRL name
given as a config key points at fitrl's key, not at the nearest spelling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

from fitrl.core.errors import ConfigError

Items = list[tuple[str, Any]]

LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
              "dapo": "token-mean"}
"""TRL's ``loss_type`` -> ``algorithm.loss_agg_mode`` (how the token losses are averaged)."""


def _to(key: str) -> Callable[[Any], Items]:
    return lambda v: [(key, v)]


def _beta(v: Any) -> Items:
    """TRL's ``beta`` is the KL weight, 0 meaning no reference model."""
    return [("algorithm.use_kl_loss", float(v) != 0.0)] + ([("algorithm.kl_coef", float(v))] if float(v) else [])


def _loss_type(v: Any) -> Items:
    if v not in LOSS_TYPES:
        raise ConfigError(f"loss_type={v!r}: fitrl maps TRL's {', '.join(LOSS_TYPES)} to algorithm.loss_agg_mode; "
                          f"set algorithm.loss_agg_mode for any other")
    return [("algorithm.loss_agg_mode", LOSS_TYPES[v])]


TRL_KEYS: dict[str, Callable[[Any], Items]] = {
    "num_generations": _to("rollout.n"),
    "max_completion_length": _to("rollout.max_response_length"),
    "max_prompt_length": _to("data.max_prompt_length"),
    "temperature": _to("rollout.temperature"),
    "top_p": _to("rollout.top_p"),
    "top_k": _to("rollout.top_k"),
    "learning_rate": _to("actor.optim.lr"),
    "weight_decay": _to("actor.optim.weight_decay"),
    "warmup_steps": _to("actor.optim.warmup_steps"),
    "max_grad_norm": _to("actor.optim.grad_clip"),
    "per_device_train_batch_size": _to("actor.micro_batch_size"),
    "gradient_checkpointing": _to("actor.model.gradient_checkpointing"),
    "num_iterations": _to("actor.ppo_epochs"),
    "beta": _beta,
    # TRL's epsilon_high defaults to epsilon: both clip bounds, unless epsilon_high is given too
    "epsilon": lambda v: [("actor.clip_ratio_low", v), ("actor.clip_ratio_high", v)],
    "epsilon_high": _to("actor.clip_ratio_high"),
    "loss_type": _loss_type,
    "max_steps": _to("trainer.max_steps"),
    "logging_steps": _to("trainer.log_freq"),
    "save_steps": _to("checkpoint.save_freq"),
    "eval_steps": _to("trainer.val_freq"),
    "output_dir": _to("trainer.output_dir"),
    "seed": _to("trainer.seed"),
}
"""TRL name -> the fitrl ``(key, value)`` pairs its value stands for (or a ConfigError naming fitrl's
equivalent). ``num_train_epochs`` is counted in steps by ``fitrl.train`` itself (it needs the dataset)."""

REFUSED: dict[str, tuple[str, str]] = {
    "gradient_accumulation_steps": (
        "actor.mini_batch_size (prompts per optimizer step)",
        "gradient_accumulation_steps: fitrl derives accumulation from actor.mini_batch_size (prompts per optimizer "
        "step = per_device_train_batch_size x gradient_accumulation_steps x devices / num_generations) and "
        "actor.micro_batch_size; set actor.mini_batch_size"),
}
"""TRL names fitrl has no one key for: (fitrl's equivalent, the one-line refusal)."""

EPOCHS = "num_train_epochs"


def fitrl_keys(name: str) -> str:
    """The fitrl key(s) a TRL name maps to, for a did-you-mean (``""``: not a TRL name)."""
    if name == EPOCHS:
        return "trainer.max_steps (epochs x rows / data.rollout_batch_size)"
    if name in REFUSED:
        return REFUSED[name][0]
    fn = TRL_KEYS.get(name)
    return " and ".join(k for k, _ in fn("grpo" if name == "loss_type" else 1)) if fn else ""


def trl_items(values: dict[str, Any], num_rows: Optional[int], rollout_batch_size: int) -> Items:
    """TRL names and values -> fitrl's ``(key, value)`` pairs; an unknown name is one line."""
    items: Items = []
    for name, v in values.items():
        if name == EPOCHS:
            if "max_steps" in values:
                continue  # TRL: max_steps wins over num_train_epochs
            if num_rows is None:
                raise ConfigError("num_train_epochs needs the training rows in the script (train_dataset as rows or "
                                  "a datasets.Dataset); with a file, set max_steps (trainer.max_steps)")
            items.append(("trainer.max_steps", max(1, math.ceil(float(v) * num_rows / rollout_batch_size))))
            continue
        if name in REFUSED:
            raise ConfigError(REFUSED[name][1])
        if name not in TRL_KEYS:
            import difflib

            near = difflib.get_close_matches(name, [*TRL_KEYS, *REFUSED, EPOCHS], n=1)
            hint = f"; did you mean {near[0]!r} ({fitrl_keys(near[0])})?" if near else ""
            raise ConfigError(f"fitrl.train() got an unknown argument {name!r}{hint} (fitrl's own keys go in "
                              f"overrides={{'section.key': value}})")
        items += TRL_KEYS[name](v)
    if "epsilon" in values and "epsilon_high" in values:  # the explicit upper bound wins
        items = [(k, v) for k, v in items if k != "actor.clip_ratio_high"]
        items += TRL_KEYS["epsilon_high"](values["epsilon_high"])
    return items


@dataclass
class GRPOConfig:
    """The part of TRL's ``GRPOConfig`` fitrl reads, by TRL's names: ``fitrl.train(args=GRPOConfig(...))``.
    Fields left ``None`` keep fitrl's defaults; each set one becomes fitrl's key (:data:`TRL_KEYS`)."""

    output_dir: Optional[str] = None
    num_generations: Optional[int] = None
    max_prompt_length: Optional[int] = None
    max_completion_length: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    learning_rate: Optional[float] = None
    weight_decay: Optional[float] = None
    warmup_steps: Optional[int] = None
    max_grad_norm: Optional[float] = None
    per_device_train_batch_size: Optional[int] = None
    gradient_accumulation_steps: Optional[int] = None
    gradient_checkpointing: Optional[bool] = None
    num_iterations: Optional[int] = None
    beta: Optional[float] = None
    epsilon: Optional[float] = None
    epsilon_high: Optional[float] = None
    loss_type: Optional[str] = None
    num_train_epochs: Optional[float] = None
    max_steps: Optional[int] = None
    logging_steps: Optional[int] = None
    save_steps: Optional[int] = None
    eval_steps: Optional[int] = None
    seed: Optional[int] = None

    def given(self) -> dict[str, Any]:
        """The fields set (not None), by TRL name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

