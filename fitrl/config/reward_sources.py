"""``reward.sources``: the reward as a weighted sum of rule functions, reward models and LLM
judges (fitrl/rewards/mix.py adds them; fitrl/roles/model_reward.py runs the models). Field
docstrings are what ``fitrl config --doc`` prints."""

from __future__ import annotations

import difflib
import re
import string
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from fitrl.config.roles import FSDPConfig, ModelConfig
from fitrl.core.errors import ConfigError

DEFAULT_JUDGE_TEMPLATE = (
    "Grade the response to the question below from 0 to 10.\n"
    "Question: {prompt}\n"
    "Reference answer: {answer}\n"
    "Response: {response}\n"
    "Reply with one line: Score: <0-10>")
"""The judge's default grading prompt; ``{prompt}``, ``{response}`` and ``{answer}`` are filled in."""

DEFAULT_JUDGE_PATTERN = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
"""The judge's default verdict pattern: its first group is the grade."""

TEMPLATE_FIELDS = ("prompt", "response", "answer")


@dataclass
class RewardSourceConfig:
    kind: Literal["function", "model", "judge"] = "function"
    """``function``: a rule function (``function``, else ``reward.function``) in the reward worker pool; ``model``: a sequence-classification reward model scoring prompt + response through its own chat template; ``judge``: a causal LM asked to grade with ``template``, its verdict parsed by ``pattern``."""
    weight: float = 1.0
    """This source's weight in the total reward (the sum of weight x score over the sources)."""
    function: Optional[str] = None
    """``kind: function``: a registered name or ``path/to/file.py:function``; unset: ``reward.function``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """``kind: function``: keyword arguments of the function (unset with ``function`` unset: ``reward.kwargs``)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """``kind: model`` / ``judge``: the model (``model.path``: a local directory or a Hub id), its dtype and attention kernel."""
    sharding: str = "fsdp2"
    """How the source's model (``kind: model`` / ``judge``) is sharded over its ranks under the Ray backend: a registered sharding backend (``fsdp2``: FSDP2, options in ``fsdp``; docs/architecture.md, "Adding a sharding backend")."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """``kind: model`` / ``judge``: sharding and offload of the model (``offload_params``: in host memory between scoring calls)."""
    micro_batch_size: int = 16
    """``kind: model`` / ``judge``: sequences per forward (per generate call for a judge)."""
    max_length: int = 0
    """``kind: model`` / ``judge``: the longest scored (or prompted) sequence in tokens, longer ones keep their end; 0: the run's prompt plus response caps (a judge's template adds to that)."""
    normalize: Literal["none", "batch"] = "none"
    """``batch``: the source's scores standardised over each scoring call (mean 0, std 1) before weighting."""
    template: str = DEFAULT_JUDGE_TEMPLATE
    """``kind: judge``: the grading prompt, sent as the user turn through the judge's chat template; ``{prompt}``, ``{response}`` and ``{answer}`` (the row's answer, optional) are filled in (Python's ``str.format``: a literal brace is written doubled, ``{{"score": N}}``)."""
    pattern: str = DEFAULT_JUDGE_PATTERN
    """``kind: judge``: a regular expression whose first group, in the judge's reply, is the grade (its first match)."""
    max_score: float = 10.0
    """``kind: judge``: the grade is divided by this (a grade of 0-10 becomes 0-1)."""
    max_tokens: int = 32
    """``kind: judge``: tokens the judge may reply with (greedy decoding)."""
    unparsed_score: float = 0.0
    """``kind: judge``: the score of a reply the pattern does not match; counted in ``reward/<source>/unparsed``."""

    def check(self, key: str) -> None:
        if not self.weight == self.weight or abs(self.weight) == float("inf"):
            raise ConfigError(f"{key}.weight must be a finite number, got {self.weight}")
        if self.kind == "function":
            return
        if not self.model.path:
            raise ConfigError(f"{key}.model.path is empty: a {self.kind} source needs a model directory or Hub id "
                              f"(e.g. one from `fitrl make-tiny-model --head {'reward' if self.kind == 'model' else 'causal_lm'}`)")
        if self.micro_batch_size < 1:
            raise ConfigError(f"{key}.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_length < 0:
            raise ConfigError(f"{key}.max_length must be >= 0 (0: the run's caps), got {self.max_length}")
        if self.kind != "judge":
            return
        try:
            pattern = re.compile(self.pattern)
        except re.error as e:
            raise ConfigError(f"{key}.pattern {self.pattern!r} is not a regular expression: {e}") from None
        if pattern.groups < 1:
            raise ConfigError(f"{key}.pattern {self.pattern!r} has no group: put the grade in parentheses, "
                              f"e.g. 'Score: (\\d+)'")
        check_template(self.template, f"{key}.template")
        if not self.max_score > 0:
            raise ConfigError(f"{key}.max_score must be > 0, got {self.max_score}")
        if self.max_tokens < 1:
            raise ConfigError(f"{key}.max_tokens must be >= 1, got {self.max_tokens}")


def check_template(template: str, key: str) -> None:
    """Refuse a grading template that ``str.format`` would fail on while scoring, naming the
    fix: ``{prompt}``, ``{response}`` (required) and ``{answer}`` are its only fields, and a
    literal brace (JSON in the template) is written doubled, ``{{`` and ``}}``.

    >>> check_template('Reply as JSON: {{"score": <0-10>}}. Response: {response}', "t")
    >>> check_template('Reply as JSON: {"score": <0-10>}. Response: {response}', "t")
    Traceback (most recent call last):
    ...
    fitrl.core.errors.ConfigError: t has '{"score": <0-10>}', which str.format reads as a field: write a literal brace doubled, '{{"score": <0-10>}}' (its only fields are {prompt}, {response}, {answer})
    """
    fields = ", ".join("{" + f + "}" for f in TEMPLATE_FIELDS)
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:  # a lone '{' or '}'
        raise ConfigError(f"{key}: {e} (str.format fills it in): write a literal brace doubled, {{{{ or }}}} "
                          f"(its only fields are {fields})") from None
    names = set()
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        inner = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")  # as written
        if name in TEMPLATE_FIELDS:
            try:  # a format or conversion ({response:.2000}) must take text: the fields are strings
                ("{" + inner + "}").format(**{name: "text"})
            except (ValueError, TypeError, KeyError, IndexError) as e:
                raise ConfigError(f"{key} has {'{' + inner + '}'!r}, whose format does not take text ({e}); write "
                                  f"{{{name}}} (a literal brace is written doubled, {{{{ and }}}})") from None
            names.add(name)
            continue
        if re.fullmatch(r"\w+", name) and name not in TEMPLATE_FIELDS:
            near = difflib.get_close_matches(name, TEMPLATE_FIELDS, n=1)
            hint = f" (did you mean {{{near[0]}}}?)" if near else ""
            raise ConfigError(f"{key} may use only {fields}; it has {{{inner}}}{hint} (a literal brace is written "
                              f"doubled, {{{{ and }}}})")
        raise ConfigError(f"{key} has {'{' + inner + '}'!r}, which str.format reads as a field: write a literal "
                          f"brace doubled, {'{{' + inner.replace('{', '{{').replace('}', '}}') + '}}'!r} (its only "
                          f"fields are {fields})")
    if "response" not in names:
        raise ConfigError(f"{key} must contain {{response}}, the response the judge grades (its fields are "
                          f"{fields})")


def check_sources(sources: dict[str, RewardSourceConfig]) -> None:
    for name, src in sources.items():
        if not re.fullmatch(r"[A-Za-z_][\w-]*", name):
            raise ConfigError(f"reward.sources.{name}: a source's name is a metric name: letters, digits, '_' "
                              f"and '-', starting with a letter")
        src.check(f"reward.sources.{name}")
    if sources and not any(s.weight for s in sources.values()):
        raise ConfigError("reward.sources: every weight is 0, so the reward is 0 everywhere: give one source a "
                          "non-zero weight")
