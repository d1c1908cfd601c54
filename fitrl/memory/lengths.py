"""The sequence lengths a plan is made for: the caps, and the lengths a typical step has.

The caps (``data.max_prompt_length``, ``rollout.max_response_length``) bound every sequence; real
runs are mostly far shorter (GSM8K prompts ~100-250 tokens under 1,024-token caps), so a plan at
the caps alone refuses runs that work. :func:`expected_lengths` resolves ``plan.expected_prompt_length``
and ``plan.expected_response_length`` into :class:`Lengths`, and :func:`fitrl.planner.plan.plan_config`
plans the run a second time at them (docs/architecture.md, "Memory model": the verdict rule).

``plan.expected_prompt_length=auto`` reads the prompts of ``data.train_files``: the first
:data:`SAMPLE_ROWS` rows (split over the files), built and tokenised by the run's own code
(:meth:`fitrl.data.dataset.PromptDataset.from_config`: template, system prompt, chat template,
image tokens) with the run's tokenizer. The statistic is the longest prompt of the sample, not a
mean or a median: fitrl left-pads a batch's prompts to its longest (fitrl/core/padding.py), and a
micro-batch keeps the columns its longest prompt needs; with hundreds of prompts per step, a
step's longest is near the data's longest (the max of 1,000 is about the 99.9th percentile). The
first rows, not a random draw: reading stops after them whatever the file's size (measured
0.25-0.5 s for 1,000 GSM8K-sized prompts of a 50,000-row jsonl on 2 busy cores, once transformers
is imported, which planning does anyway), and the same file gives the same number. A file sorted by length misleads
it: set the number then. Whatever cannot be read here (no file: a config planned on another
machine; no tokenizer: a model directory holding only config.json), and a Hub dataset, which the
plan does not read (:func:`hub_dataset`), leave the cap, and a note.

The sample is read before the plan cache's key is made (fitrl/trainer/preflight.py passes the
result into :func:`fitrl.memory.cache.plan_key`): a changed dataset changes the number, and with
it the key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from fitrl.config import FitrlConfig

log = logging.getLogger(__name__)

SAMPLE_ROWS = 1000
"""Rows read for ``plan.expected_prompt_length=auto`` (the first of each file, split evenly)."""
VISION_SAMPLE_ROWS = 100
"""The same for a vision-language policy, whose rows' images are decoded to count their tokens."""


@dataclass(frozen=True)
class Lengths:
    """Tokens per prompt and per response a plan is made for, and where each number came from:
    ``cap`` (the config's maximum), ``config`` (``plan.expected_*``) or ``dataset`` (a sample)."""
    prompt: int
    response: int
    prompt_source: str = "cap"
    response_source: str = "cap"
    note: str = ""     # what ``auto`` read, or why it fell back to the cap

    @classmethod
    def caps(cls, cfg: FitrlConfig) -> "Lengths":
        return cls(cfg.data.max_prompt_length, cfg.rollout.max_response_length)

    def at_caps(self, cfg: FitrlConfig) -> bool:
        return (self.prompt, self.response) == (cfg.data.max_prompt_length, cfg.rollout.max_response_length)

    def within(self, cfg: FitrlConfig) -> "Lengths":
        """These lengths under ``cfg``'s caps (a recommendation may lower a cap)."""
        return replace(self, prompt=min(self.prompt, cfg.data.max_prompt_length),
                       response=min(self.response, cfg.rollout.max_response_length))

    def describe(self) -> str:
        """``prompt 180 tokens (dataset: ...), response 400 (plan.expected_response_length)``."""
        def one(n: int, source: str, key: str) -> str:
            where = {"cap": "the cap", "config": f"plan.{key}"}.get(source, self.note or "dataset")
            return f"{n:,} ({where})"
        return (f"prompt {one(self.prompt, self.prompt_source, 'expected_prompt_length')}, response "
                f"{one(self.response, self.response_source, 'expected_response_length')} tokens")


def expected_lengths(cfg: FitrlConfig) -> Lengths:
    """The lengths ``plan.expected_*`` asks for (a dataset sample for ``auto``), within the caps."""
    p = cfg.plan
    caps = Lengths.caps(cfg)
    response, response_source = (caps.response, "cap") if p.expected_response_length is None else (
        p.expected_response_length, "config")
    prompt, prompt_source, note = caps.prompt, "cap", ""
    if isinstance(p.expected_prompt_length, int):
        prompt, prompt_source = p.expected_prompt_length, "config"
    elif p.expected_prompt_length == "auto" and (remote := hub_dataset(cfg.data.train_files)):
        note = (f"plan.expected_prompt_length=auto sampled no prompt lengths: data.train_files names a Hub dataset "
                f"({remote}), which the plan does not read")
    elif p.expected_prompt_length == "auto":
        try:
            prompt, sampled = sample_prompt_length(cfg)
            files = cfg.data.train_files
            prompt_source, note = "dataset", (f"the longest of {sampled:,} prompts read from "
                                              f"{files[0] if len(files) == 1 else f'{len(files)} files'}")
        except Exception as e:  # no file here, no tokenizer, a bad row: the run says so itself; the plan keeps the cap
            log.debug("plan.expected_prompt_length=auto: data not read", exc_info=True)
            first = (str(e).strip().splitlines() or [""])[0][:160]
            note = f"plan.expected_prompt_length=auto could not read data.train_files ({type(e).__name__}: {first})"
    return Lengths(prompt, response, prompt_source, response_source, note).within(cfg)


def hub_dataset(files: list[str]) -> str:
    """The first entry of ``files`` that names a Hub dataset (fitrl/data/hub.py), else ``""``: the
    plan does not read one (online, ``datasets`` would download it; offline it would build its
    whole split into Arrow tables to read 1,000 rows), so it is planned at the prompt cap."""
    from fitrl.data.hub import parse_dataset_ref  # (standard library only, like fitrl/core/hub.py)

    return next((f for f in files if parse_dataset_ref(f) is not None), "")


def sample_prompt_length(cfg: FitrlConfig) -> tuple[int, int]:
    """(the longest prompt in tokens, prompts read) of the first rows of ``data.train_files`` as
    the run builds them (prompts over ``data.max_prompt_length`` are dropped by the run, and here)."""
    # lazy: fitrl.data imports torch, transformers the tokenizer: neither for `fitrl --help`
    from fitrl.agents.tools import tool_schemas
    from fitrl.data.dataset import PromptDataset
    from fitrl.models.families import media_spec_of
    from fitrl.models.check import load_local_tokenizer

    d, model = cfg.data, cfg.actor.model
    if not d.train_files:
        raise ValueError("data.train_files is empty")
    missing = [f for f in d.train_files if not Path(f).exists()]
    if missing:  # before the tokenizer: the plan of a reported run (a model's config.json only) says this first
        raise FileNotFoundError(f"not on this machine: {missing[0]}")
    vision = media_spec_of(model.path)
    rows = VISION_SAMPLE_ROWS if vision is not None else SAMPLE_ROWS
    tokenizer = load_local_tokenizer(model.tokenizer_path or model.path)
    agent = cfg.rollout.agent
    tools = tool_schemas(agent.tools) if agent.enabled else None  # rendered into every prompt (and counted)
    ds = PromptDataset.from_config(d.train_files, tokenizer, d, name="train", vision=vision,
                                   max_rows=-(-rows // len(d.train_files)), tools=tools)
    longest = max(len(ds[i]["prompt_ids"]) for i in range(len(ds)))
    if longest < 1:  # e.g. a planned model's directory holding config.json alone: no real tokenizer
        raise ValueError(f"the tokenizer of {model.tokenizer_path or model.path} encodes every prompt as 0 tokens")
    return longest, len(ds)
