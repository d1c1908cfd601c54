"""What a key-by-key map of :mod:`fitrl.config.import_maps` is made of: a :class:`Rule` per source
key, and the rules whose translation depends on the source's meaning rather than on a name (KL
estimators, policy losses, where the KL goes, the reward function, multi-turn agents).

Each builder here encodes one fact about veRL or EasyR1 (the file and function it comes from are
named beside it), so that the maps stay a table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from fitrl.core.errors import ConfigError
from fitrl.core.nested import flatten

TRANSLATED, APPROXIMATED, NOT_TRANSLATED = "translated", "approximated", "not translated"

Convert = Callable[[Any, dict], list[tuple[str, Any]]]
"""(the value, every source key) -> the fitrl keys and values it sets."""


@dataclass(frozen=True)
class Rule:
    set: Optional[Convert]   # None: nothing is set
    status: str = TRANSLATED
    why: str = ""
    choose: Optional[Callable[[Any], "Rule"]] = None
    """A rule that depends on the value (a key whose translation depends on what it is set to)."""


def to(key: str, convert: Callable[[Any], Any] = lambda v: v, status: str = TRANSLATED, why: str = "") -> Rule:
    """The value (its interpolations resolved, then converted) goes to one fitrl key; one that
    resolves to null sets nothing, as a null in the source does."""
    def setter(v: Any, src: dict) -> list[tuple[str, Any]]:
        v = resolve(v, src)
        return [] if v is None else [(key, convert(v))]
    return Rule(setter, status, why)


INTERPOLATION = re.compile(r"\$\{(oc\.select:)?([\w.]+)(?:,([^{}]*))?\}")


def resolve(value: Any, src: dict, depth: int = 0) -> Any:
    """OmegaConf's ``${key}`` and ``${oc.select:key,default}`` in a value, read from the source's
    other keys: veRL's defaults tie the critic's batches to the actor's this way, and a Hydra base
    config does the same. A whole-value interpolation keeps the referenced value's type; a relative
    ``${.key}`` or a key the source lacks (without a default) stays as written."""
    if not isinstance(value, str) or "${" not in value or depth > 8:
        return value
    def lookup(m: re.Match) -> Any:
        key, select, default = m.group(2), m.group(1), m.group(3)
        if key.startswith("."):
            return m
        if key in src:
            return resolve(src[key], src, depth + 1)
        if select and default is not None:
            return yaml.safe_load(default) if default.strip() else None
        return m
    whole = INTERPOLATION.fullmatch(value)
    if whole:
        found = lookup(whole)
        return value if found is whole else found
    def text(m: re.Match) -> str:
        found = lookup(m)
        return m.group(0) if isinstance(found, re.Match) else str(found)
    return INTERPOLATION.sub(text, value)


def drop(why: str) -> Rule:
    """Nothing in fitrl corresponds, or nothing needs to (``why`` says which)."""
    return Rule(None, NOT_TRANSLATED, why)


def expand_dict_values(flat: dict[str, Any]) -> dict[str, Any]:
    """A dict-valued key (``val_override_config='{"n":16,"top_p":0.7}'`` on a command line) as the
    dotted keys below it, merged over the config's own (Hydra's and OmegaConf's override merges a
    mapping into the section: the keys it names change, the others stay). A relative interpolation
    (``${.key}``, ``${oc.select:.key,null}``) is made absolute here, where its section is known, for
    :func:`resolve` to read."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if isinstance(value, dict) and value:
            out.update({f"{key}.{k}": v for k, v in flatten(value).items()})
        elif isinstance(value, str) and "${" in value:
            section = key.rsplit(".", 1)[0] + "." if "." in key else ""
            out[key] = RELATIVE.sub(lambda m: "${" + (m.group(1) or "") + section, value)
        else:
            out[key] = value
    return out


RELATIVE = re.compile(r"\$\{(oc\.select:)?\.(?!\.)")


# ---------------------------------------------------------------------------------------- KL

KL_NAMES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "mse", "k2": "k2", "low_var_kl": "low_var_kl", "k3": "k3"}
"""veRL's (``core_algos.kl_penalty_forward``) and EasyR1's (``core_algos.compute_kl``) estimator names
-> fitrl's (fitrl/algo/kl.py registers ``mse`` and ``low_var_kl`` as k2 and k3): the same formulas."""


def kl_estimator(in_loss: bool, source_key: str) -> Callable[[Any], tuple[str, str, str]]:
    """A source's KL name -> (fitrl's estimator, status, why), for a KL in the loss or in the reward.

    veRL's ``+`` (``k3+``) keeps the named estimator's value with k2's gradient (a straight-through
    term, unbiased for the KL's gradient): in a loss fitrl's k2 has that gradient; in a reward, which
    carries no gradient, only the value counts."""
    def convert(v: Any) -> tuple[str, str, str]:
        name = str(v).strip().lower()
        plus = name.endswith("+")
        base = KL_NAMES.get(name.rstrip("+"))
        if base is None:
            extra = ("the KL over the whole vocabulary: fitrl's estimators are per sampled token"
                     if name.rstrip("+") == "full" else "not a KL estimator veRL or EasyR1 names")
            raise ConfigError(f"{source_key}={v}: {extra}; set kl (k1), mse (k2), low_var_kl (k3) or abs")
        if not plus or base in ("k2", "mse"):
            return base, TRANSLATED, ""
        if in_loss:
            return "k2", APPROXIMATED, (f"{name} is {base}'s value with k2's gradient: fitrl's k2 gives the same "
                                        f"gradient (the KL it logs is k2's value)")
        return base, TRANSLATED, "the + (k2's gradient) changes nothing in a reward, which has no gradient"
    return convert


def kl_name(key: str, in_loss: bool, source_key: str) -> Rule:
    """``key`` (fitrl's estimator key) from the KL name ``source_key`` holds."""
    def choose(v: Any) -> Rule:
        name, status, why = kl_estimator(in_loss, source_key)(v)
        return to(key, lambda _: name, status, why)
    return Rule(None, choose=choose)


def is_true(v: Any) -> bool:
    """A source's boolean as Hydra and YAML write it (``True``, ``true``, ``1``)."""
    return v is True or str(v).lower() in ("true", "1")


# ------------------------------------------------------------------------------ policy losses

def policy_loss(names: dict[str, tuple[str, str, str]], source_key: str) -> Rule:
    """A source's policy-loss name -> ``algorithm.policy_loss`` (``names``: name -> (fitrl's loss,
    status, why)); a name fitrl has no loss like is dropped, naming the loss the run trains with."""
    def choose(v: Any) -> Rule:
        found = names.get(str(v))
        if found is None:
            return drop(f"fitrl has no {v} loss (it has ppo_clip, gspo, cispo): the run trains "
                        f"algorithm.policy_loss=ppo_clip unless you set another")
        loss, status, why = found
        return to("algorithm.policy_loss", lambda _: loss, status, why)
    return Rule(None, choose=choose)


GSPO = "the sequence-level ratio, clipped (Zheng et al. 2025)"
EASYR1_LOSSES = {  # verl/trainer/core_algos.py compute_policy_loss(loss_type=...)
    "default": ("ppo_clip", TRANSLATED, ""),
    "gspo": ("gspo", TRANSLATED, GSPO),
    "gspo_token": ("gspo", TRANSLATED, GSPO + ", written as EasyR1's gspo_token (sg(s) x pi / sg(pi))"),
    "cispo": ("cispo", APPROXIMATED, "fitrl's CISPO caps the weight above at 1 + clip_ratio_high; EasyR1 also "
                                     "floors it at 1 - clip_ratio_low"),
}
VERL_LOSSES = {  # verl/trainer/ppo/core_algos.py POLICY_LOSS_REGISTRY
    "vanilla": ("ppo_clip", TRANSLATED, ""),
    "gspo": ("gspo", TRANSLATED, GSPO),
    "cispo": ("cispo", TRANSLATED, ""),
}


# ------------------------------------------------------------------------------------- reward

REWARD_FILES = {"math.py": "math", "r1v.py": "r1v", "dapo.py": "math"}
"""EasyR1's example reward files and the fitrl built-in that scores the same answers."""

REWARD_NAMES = {"math": "math", "r1v": "r1v"}
"""Older EasyR1's built-in scorers (``worker.reward.compute_score``, verl/utils/reward_score/) and fitrl's."""

COMPONENTS = {"math": ("accuracy", "format"), "r1v": ("accuracy", "format")}
"""What fitrl's built-ins log beside ``score`` (fitrl/rewards/rules.py)."""


def easyr1_builtin(src: dict) -> Optional[str]:
    """The fitrl built-in an EasyR1 job's reward becomes (None: the user's own function)."""
    spec = src.get("worker.reward.reward_function") or src.get("worker.reward.score_function")
    if spec:
        return REWARD_FILES.get(Path(str(spec).split(":")[0]).name)
    return REWARD_NAMES.get(str(src.get("worker.reward.compute_score")))


def reward_name() -> Rule:
    """Older EasyR1's ``compute_score: math | r1v``: a built-in scorer by name."""
    def choose(v: Any) -> Rule:
        builtin = REWARD_NAMES.get(str(v))
        if builtin is None:
            return drop(f"EasyR1's {v} scorer has no fitrl built-in: write fn(response, answer) and set "
                        f"reward.function=path.py:fn (left unset, fitrl would score with its arith default)")
        return to("reward.function", lambda _: builtin, APPROXIMATED,
                  f"fitrl's built-in {builtin} scores the same answers (its own extraction and weights)")
    return Rule(None, choose=choose)


def reward_file() -> Rule:
    """Older EasyR1's ``score_function: path.py:fn`` (today's ``reward_function``)."""
    def choose(v: Any) -> Rule:
        builtin = REWARD_FILES.get(Path(str(v).split(":")[0]).name)
        if builtin is None:
            return drop("EasyR1's functions take a batch of dicts: write fn(response, answer) and set "
                        "reward.function=path.py:fn (left unset, fitrl would score with its arith default)")
        return to("reward.function", lambda _: builtin, APPROXIMATED,
                  f"fitrl's built-in {builtin} scores the same answers (EasyR1's function takes a batch of dicts)")
    return Rule(None, choose=choose)


def format_weight() -> Rule:
    """EasyR1's math.py/r1v.py ``format_weight`` w: ``(1 - w) * accuracy + w * format``, as fitrl's
    ``accuracy_weight`` and ``format_weight``."""
    def setter(v: Any, src: dict) -> list[tuple[str, Any]]:
        w = float(v)
        pairs = [("reward.kwargs.format_weight", w)]
        return pairs + ([("reward.kwargs.accuracy_weight", round(1.0 - w, 6))] if easyr1_builtin(src) == "math" else [])
    return Rule(setter, TRANSLATED)


def overlong(key: str, convert: Callable[[Any], Any]) -> Rule:
    """DAPO's soft overlong punishment (EasyR1's dapo.py kwargs): fitrl's ``algorithm.overlong``, the
    same ramp (0 down to -penalty_factor over the buffer before the limit)."""
    return Rule(lambda v, src: [("algorithm.overlong.enable", True), (key, convert(v))], TRANSLATED,
                "fitrl applies it as reward shaping (algorithm.overlong), not inside the reward function")


OVERLONG_LIMIT = drop("dapo.py's own limit: fitrl's overlong ramp ends at rollout.max_response_length "
                      "(data.max_response_length), which EasyR1's example sets to the same number")


def easyr1_filter_key() -> Rule:
    """``algorithm.filter_key``: the reward metric whose group mean EasyR1 filters on
    (``ray_trainer.py``, groups with a mean strictly inside ``filter_low``..``filter_high``) -> a
    value fitrl's reward logs: ``score``, or a component of the built-in the import chose."""
    def choose(v: Any) -> Rule:
        name = {"overall": "score", "accuracy_normalized": "accuracy"}.get(str(v), str(v))
        if name == "score":
            return to("algorithm.filter_groups.metric", lambda _: "score", TRANSLATED, "EasyR1's overall is the total")
        def setter(value: Any, src: dict) -> list[tuple[str, Any]]:
            return [("algorithm.filter_groups.metric", name)] if name in COMPONENTS.get(easyr1_builtin(src), ()) else []
        rescaled = " (dapo.py's accuracy rescaled to [0, 1]: the same groups vary)" if name != str(v) else ""
        return Rule(setter, APPROXIMATED, f"{name} when fitrl's built-in reward logs it (math and r1v log accuracy "
                                          f"and format){rescaled}; else nothing is set and fitrl filters on the "
                                          f"total score (your own function would have to return {name})")
    return Rule(None, choose=choose)


# ------------------------------------------------------------------------- batches and warm-up

def warmup_ratio(steps_key: str, total_key: str, target: str = "actor.optim.warmup_steps") -> Rule:
    """A warm-up as a ratio of the run's steps (``int(ratio * steps)`` in veRL and EasyR1), used only
    when the warm-up steps are not given: known when the source sets its total steps."""
    def setter(v: Any, src: dict) -> list[tuple[str, Any]]:
        steps = src.get(steps_key)
        if steps is not None and int(steps) >= 0:
            return []  # the steps win
        if not v:
            return [(target, 0)]
        total = src.get(total_key)
        return [(target, int(float(v) * int(total)))] if total and int(total) > 0 else []
    return Rule(setter, APPROXIMATED, f"int(ratio x {total_key}) when the source sets it (epochs need the data's "
                                      f"size: else set {target}); {steps_key} wins when set")


def warmup_steps(v: Any, src: dict, target: str = "actor.optim.warmup_steps") -> list[tuple[str, Any]]:
    """veRL writes -1, EasyR1 null, for "from the ratio"."""
    return [(target, int(v))] if v is not None and int(v) >= 0 else []


VERL_TOKEN_LEN = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
VERL_TOKEN_LEN_DEFAULT = 16384  # veRL's, tests/data/foreign/defaults/verl/_generated_ppo_trainer.yaml


def verl_dynamic_bsz(v: Any) -> Rule:
    """veRL's ``use_dynamic_bsz``: micro-batches by ``ppo_max_token_len_per_gpu`` tokens (16,384 when unset)."""
    if not is_true(v):
        return Rule(None, TRANSLATED, "micro-batches by count (actor.micro_batch_size), as fitrl by default")
    return Rule(lambda v, src: [] if src.get(VERL_TOKEN_LEN) is not None else
                [("actor.micro_batch_token_budget", VERL_TOKEN_LEN_DEFAULT)], APPROXIMATED,
                f"by tokens: {VERL_TOKEN_LEN} (veRL's default {VERL_TOKEN_LEN_DEFAULT} when unset); fitrl's budget "
                f"bounds the padded tokens of a micro-batch")


def easyr1_dynamic_batching(v: Any) -> Rule:
    """EasyR1's ``dynamic_batching`` (``dp_actor.py``): an update micro-batch holds up to
    ``micro_batch_size_per_device_for_update`` x (prompt + response length) tokens."""
    if not is_true(v):
        return Rule(None, TRANSLATED, "micro-batches by count (actor.micro_batch_size), as fitrl by default")
    def setter(v: Any, src: dict) -> list[tuple[str, Any]]:
        per = int(src.get("worker.actor.micro_batch_size_per_device_for_update", 4))
        length = int(src.get("data.max_prompt_length", 512)) + int(src.get("data.max_response_length", 512))
        return [("actor.micro_batch_token_budget", per * length)]
    return Rule(setter, APPROXIMATED, "by tokens: micro_batch_size_per_device_for_update x (prompt + response "
                                      "length), as EasyR1 counts; fitrl's budget bounds the padded tokens of a "
                                      "micro-batch, the log-prob passes' too")


def verl_filter_metric(v: Any) -> Rule:
    """veRL's ``filter_groups.metric`` (DAPO's recipe): ``acc`` (what its math rewards return), the
    sequence's score or final reward -> a value fitrl's reward logs."""
    name = str(v)
    if name in ("score", "seq_reward"):
        return to("algorithm.filter_groups.metric", lambda _: "score", TRANSLATED, "the total")
    if name == "seq_final_reward":
        return to("algorithm.filter_groups.metric", lambda _: "score", APPROXIMATED,
                  "the total before any KL in the reward (veRL's final reward is after it)")
    def setter(value: Any, src: dict) -> list[tuple[str, Any]]:
        if src.get("custom_reward_function.path"):
            return [("algorithm.filter_groups.metric", name)]  # the user's function returns it, as in veRL
        return [("algorithm.filter_groups.metric", "accuracy")] if name == "acc" else []
    return Rule(setter, APPROXIMATED, f"fitrl's built-in rewards (by_source) log accuracy and format; your own "
                                      f"function must return {name} as a component; else nothing is set and "
                                      f"fitrl filters on the total score")


def reward_kwargs(prefix: str) -> dict[str, Rule]:
    """The keyword arguments of EasyR1's example reward functions (``reward_function_kwargs``, older
    ``score_function_kwargs``): dapo.py's overlong buffer, math.py's and r1v.py's format weight."""
    return {
        f"{prefix}overlong_buffer_length": overlong("algorithm.overlong.buffer_length", int),
        f"{prefix}overlong_penalty_factor": overlong("algorithm.overlong.penalty_factor", float),
        f"{prefix}max_response_length": OVERLONG_LIMIT,
        f"{prefix}format_weight": format_weight(),
    }


# ------------------------------------------------------------------------------- multi-turn

AGENTS = "fitrl's multi-turn agents are rollout.agent (docs/agents.md)"


def multi_turn_enable() -> Rule:
    """veRL's ``rollout.multi_turn.enable``: episodes with tool calls; fitrl's ``tools`` environment."""
    def choose(v: Any) -> Rule:
        if not is_true(v):
            return Rule(None, TRANSLATED, "single-turn, as fitrl by default")
        return to("rollout.agent.env", lambda _: "tools", APPROXIMATED,
                  f"{AGENTS}: the tools environment (a tool call answered, done at the first turn without one); "
                  f"list the tools in rollout.agent.tools as fitrl functions")
    return Rule(None, choose=choose)


def when_multi_turn(key: str, convert: Callable[[Any], Any] = int, why: str = "") -> Rule:
    """A multi-turn limit, set only when the source turns multi-turn on (veRL reads it only then)."""
    def setter(v: Any, src: dict) -> list[tuple[str, Any]]:
        on = is_true(src.get("actor_rollout_ref.rollout.multi_turn.enable", False))
        return [(key, convert(v))] if on and v is not None else []
    return Rule(setter, TRANSLATED, why)


def engine_name(v: Any) -> str:
    """fitrl's ``rollout.engine`` for a source's rollout name: vLLM's and SGLang's servers run as
    fitrl's vllm engine, the rest as hf."""
    return "vllm" if str(v) in ("vllm", "sglang", "async") else "hf"


ROLLOUT_MODE_ASYNC = ("veRL's async mode serves generation from an AsyncLLM server (agent loops); training stays "
                      "on-policy, as fitrl's rollout.mode=sync (fitrl's one_step_off and async overlap generation "
                      "with the update: docs/async.md)")


BF16 = ("bf16", "bfloat16", "torch.bfloat16")
FP16 = ("fp16", "float16", "half", "torch.float16")
FP32 = ("fp32", "float32", "float", "torch.float32")


def precision(key: str, weights: bool = False) -> Rule:
    """A source's compute (or, ``weights``, its weights') dtype to ``key``, a role's
    ``fsdp.mixed_precision``: fitrl keeps fp32 master weights and computes in bf16 or fp32."""
    def choose(v: Any) -> Rule:
        name = str(v).lower()
        if name in BF16:
            held = ("fitrl holds the reference's weights in fp32 (bf16 with ref.model.dtype=bfloat16 and "
                    "ref.model.path) and computes in bf16" if key.startswith("ref.") else
                    "fitrl keeps fp32 weights (masters) and computes in bf16")
            return to(key, lambda v: True, APPROXIMATED if weights else TRANSLATED, held if weights else "")
        if name in FP16:
            return to(key, lambda v: True, APPROXIMATED, "fitrl's low precision is bf16 (no fp16 loss scaling)")
        if name in FP32:
            return to(key, lambda v: False) if not weights else Rule(None, TRANSLATED, "fitrl's weights are fp32 already")
        return drop(f"unknown dtype {v!r}")
    return Rule(None, choose=choose)


def engine_precision(actor_keys: tuple[str, ...]) -> Rule:
    """The engine's dtype: fitrl's engine computes in the trainer's (bf16 under
    ``actor.fsdp.mixed_precision``), so it sets the actor's unless the source sets that itself."""
    def choose(v: Any) -> Rule:
        rule = precision("actor.fsdp.mixed_precision").choose(v)
        if rule.set is None:
            return rule
        why = "fitrl's engine computes in the trainer's dtype: set with actor.fsdp.mixed_precision"
        return Rule(lambda v, src: [] if any(k in src for k in actor_keys) else rule.set(v, src), APPROXIMATED, why)
    return Rule(None, choose=choose)
