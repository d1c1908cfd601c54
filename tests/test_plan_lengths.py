"""The plan at expected lengths beside the plan at the caps (fitrl/memory/lengths.py, plan.py) and
the verdict rule that reads both (fitrl/memory/model.py, ``Plan``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fitrl.config import ConfigError, load_config
from fitrl.planner import Hardware, plan_config
from fitrl.memory import calibration as C
from fitrl.memory.lengths import SAMPLE_ROWS, Lengths, expected_lengths
from fitrl.memory.run import Run
from helpers import EXAMPLE as ARITH


def _cfg(model_dir, *overrides: str):
    # caps 512 + 512, a micro-batch of 4 sequences, 8 of them per rank
    return load_config(ARITH, [f"actor.model.path={model_dir}", "data.rollout_batch_size=8", "actor.mini_batch_size=8",
                               "actor.micro_batch_size=4", "actor.logprob_micro_batch_size=4",
                               "data.max_prompt_length=512", "rollout.max_response_length=512", *overrides])


def _gpu(plan, phase: str) -> dict[str, int]:
    return plan.process("trainer").phases[phase].gpu


def test_expected_plan_follows_the_lengths_and_keeps_the_preallocated_kv_at_the_cap(tiny_model_dir):
    cfg = _cfg(tiny_model_dir)
    hw = Hardware(nodes=1, gpus_per_node=1)
    half = plan_config(cfg, hw, lengths=Lengths(256, 256, "config", "config"))
    caps, exp = _gpu(half, "update"), _gpu(half.expected, "update")
    # the batch's token tensors are a closed form in the tokens: half the lengths, half the bytes
    assert exp["batch"] * 2 == caps["batch"]
    # activations: linear in the tokens plus attention's (T, T) scores: at most half, at least a quarter
    assert caps["activations"] / 4 <= exp["activations"] <= caps["activations"] / 2
    # the expected plan is the plan of a config whose caps are the expected lengths, term for term,
    # but for generate's StaticCache: allocated for max_response_length tokens, whatever is generated
    short = plan_config(_cfg(tiny_model_dir, "data.max_prompt_length=256", "rollout.max_response_length=256"), hw,
                        lengths=Lengths(256, 256))
    assert short.expected is None
    assert _gpu(short, "update") == exp
    kv = _gpu(half, "rollout")["kv cache"]  # rollout.micro_batch_size x (512 + 512) tokens
    assert _gpu(half.expected, "rollout")["kv cache"] * 1024 == kv * (256 + 512)
    assert _gpu(short, "rollout")["kv cache"] * 1024 == kv * (256 + 256)
    # a shorter response alone: the cache is unchanged
    resp = plan_config(cfg, hw, lengths=Lengths(512, 128, "cap", "config"))
    assert _gpu(resp.expected, "rollout")["kv cache"] == _gpu(resp, "rollout")["kv cache"]


def test_token_budget_holds_more_sequences_at_expected_lengths(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, "actor.micro_batch_token_budget=2048")
    plan = plan_config(cfg, Hardware(nodes=1, gpus_per_node=1), lengths=Lengths(128, 128, "config", "config"))
    caps = Run(cfg, plan.hardware, plan.shape, None, plan.spec)
    exp = Run(cfg, plan.hardware, plan.shape, None, plan.spec, Lengths(128, 128))
    assert caps.seqs_per_rank == 64             # 8 prompts x rollout.n=8 on one rank
    assert caps.micro(4) == 2048 // 1024 == 2   # two sequences of 512 + 512
    assert exp.micro(4) == 2048 // 256 == 8     # eight of 128 + 128
    assert _gpu(plan.expected, "update")["batch"] * 4 == _gpu(plan, "update")["batch"]


@pytest.mark.parametrize("budget,prompt,response", [(3000, 512, 512), (24000, 250, 400), (2048, 512, 512)])
def test_token_budget_plans_the_actors_split_and_bounds_it_at_the_caps(tiny_model_dir, budget, prompt, response):
    """The actor keeps each micro-batch's padded size within the budget, as few as allows,
    balanced. At expected lengths the planner takes that split of equal sequences: 64 of 1,024
    tokens under 3,000 go 2 to a micro-batch, 64 of 650 under 24,000 go 32 and 32 (not 36 and 28).
    At the caps it takes the budget's worth, rounded up (3 of 1,024, 37 of 650): lengths up to the
    caps that pack otherwise (many short ones with a long one) never pad to more tokens than that."""
    import random

    from fitrl.data.balance import micro_batches_by_tokens

    full = prompt + response
    for caps in (False, True):
        extra = [f"data.max_prompt_length={prompt}", f"rollout.max_response_length={response}"] if caps else []
        cfg = _cfg(tiny_model_dir, f"actor.micro_batch_token_budget={budget}", *extra)
        lengths = None if caps else Lengths(prompt, response)
        plan = plan_config(cfg, Hardware(nodes=1, gpus_per_node=1),
                           lengths=Lengths(prompt, response, "config", "config"))
        run = Run(cfg, plan.hardware, plan.shape, None, plan.spec, lengths)
        assert run.seq_len == full and run.seqs_per_rank == run.mini_seqs_per_rank == 64
        want = {(3000, 512): (2, 3), (24000, 250): (32, 37), (2048, 512): (2, 2)}[budget, prompt][caps]
        assert run.micro(4, update=True) == run.micro(4) == want
    rng = random.Random(0)
    for lengths in ([full] * 64, [full] + [prompt + 1] * 63, [rng.randint(prompt + 1, full) for _ in range(64)]):
        split = micro_batches_by_tokens(lengths, budget)
        assert sorted(i for b in split for i in b) == list(range(64))
        assert max(len(b) * max(lengths[i] for i in b) for b in split) <= min(budget, 64 * full) or len(split) == 64
        assert max(len(b) * max(lengths[i] for i in b) for b in split) <= run.micro(4) * full  # the caps' plan


def test_verdict_rule_three_outcomes(tiny_model_dir):
    # long caps and large micro-batches: activations, not the CUDA context, make the device's peak
    cfg = _cfg(tiny_model_dir, "actor.micro_batch_size=16", "actor.logprob_micro_batch_size=16",
               "data.max_prompt_length=4096", "rollout.max_response_length=4096")
    lengths = Lengths(64, 64, "config", "config")

    def plan_on(gpu: float):
        return plan_config(cfg, Hardware(nodes=1, gpus_per_node=1, gpu_memory=int(gpu)), lengths=lengths)

    probe = plan_on(80 * C.GIB)
    at_caps = max(g for g, _ in probe.peaks().values())
    expected = max(g for g, _ in probe.expected.peaks().values())
    band = probe.band("gpu")[0]
    assert band == C.GPU_PLAN_BAND  # one device, the HF engine, text: the measured band
    usable = cfg.memory.guard_gpu_max_fraction  # the limit: the guard's ceiling of each device
    assert expected * (1 + band) < at_caps * (1 - band)  # room for every outcome

    def device(peak: float, edge: int, nudge: int) -> float:
        """The device whose limit meets ``peak`` at the top (+1) or bottom (-1) of its band, nudged."""
        return peak * (1 + edge * band) / usable + nudge * C.MIB

    roomy = plan_on(device(at_caps, +1, +1))  # even the caps' top of band within the limit
    assert roomy.verdict == "fits" and roomy.fits and not roomy.problems()

    capped = plan_on(device(at_caps, -1, -1))  # the caps over even at the band's low end, the expected lengths within
    assert capped.verdict == "tight" and capped.fits
    assert {(p.at, p.call) for p in capped.problems()} == {("caps", "tight")}  # a step at the caps: rare, guarded

    near = plan_on(device(expected, 0, 0))  # the expected peak at the limit: inside its band
    assert near.verdict == "tight" and ("expected", "tight") in {(p.at, p.call) for p in near.problems()}

    short = plan_on(device(expected, -1, -1))  # the expected peak over even at the band's low end
    assert short.verdict == "does not fit" and not short.fits
    assert ("gpu", "expected", "does not fit") in {(p.resource, p.at, p.call) for p in short.problems()}
    assert all(p.limit == short.gpu_limit for p in short.problems())

    # the same need without an expected plan (lengths at the caps): the caps decide
    caps_only = plan_config(cfg, capped.hardware, lengths=Lengths.caps(cfg))
    assert caps_only.expected is None and caps_only.verdict == "does not fit"


def _write_data(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p, "answer": 1}) + "\n" for p in prompts))


def _prompt_tokens(tokenizer, text: str) -> int:
    # as the run builds a prompt (fitrl/data/dataset.py): the chat template, then its ids
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def test_auto_reads_the_longest_prompt_of_the_first_rows(tiny_model_dir, tmp_path):
    from fitrl.models.check import load_local_tokenizer

    tok = load_local_tokenizer(str(tiny_model_dir))
    prompts = [f"What is {i} + {i}?" + " Think" * (i % 7) for i in range(SAMPLE_ROWS)]
    path = tmp_path / "train.jsonl"
    _write_data(path, prompts + ["a very long prompt " * 20])  # row 1,001: beyond the sample
    cfg = _cfg(tiny_model_dir, f"data.train_files=[{path}]")
    lengths = expected_lengths(cfg)
    assert lengths.prompt == max(_prompt_tokens(tok, p) for p in prompts)
    assert lengths.prompt < _prompt_tokens(tok, "a very long prompt " * 20)
    assert (lengths.prompt_source, lengths.response, lengths.response_source) == ("dataset", 512, "cap")
    assert f"{SAMPLE_ROWS:,} prompts read from" in lengths.note

    # parquet, as the run reads it; a changed file gives another number (and so another cache key)
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    table = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": prompts[:10] + ["Think " * 30], "answer": [1] * 11}), table)
    longer = expected_lengths(_cfg(tiny_model_dir, f"data.train_files=[{table}]"))
    assert longer.prompt == _prompt_tokens(tok, "Think " * 30) > lengths.prompt


def test_auto_keeps_the_cap_with_a_note_when_the_data_is_not_here(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, f"data.train_files=[{tmp_path / 'absent.parquet'}]")
    lengths = expected_lengths(cfg)
    assert (lengths.prompt, lengths.prompt_source) == (512, "cap") and "could not read" in lengths.note
    assert "not on this machine: " in lengths.note and "absent.parquet" in lengths.note  # the cause, not a side effect
    plan = plan_config(cfg, Hardware(nodes=1, gpus_per_node=1))
    assert plan.expected is None and any("could not read data.train_files" in n for n in plan.notes)


def test_auto_keeps_the_cap_when_a_config_only_directory_encodes_nothing():
    """A reported run's directory (config.json alone) has no real tokenizer: without a chat
    template its prompts encoded to 0 tokens, and a 0-token prompt crashed the traces."""
    from helpers import ROOT

    model = ROOT / "examples" / "failure_stories" / "models" / "qwen2.5-7b-instruct"
    cfg = load_config(ARITH, [f"actor.model.path={model}", "data.apply_chat_template=false"])
    lengths = expected_lengths(cfg)
    assert lengths.prompt_source == "cap" and "encodes every prompt as 0 tokens" in lengths.note


def test_config_values_and_where_they_come_from(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, "plan.expected_prompt_length=100", "plan.expected_response_length=200")
    assert expected_lengths(cfg) == Lengths(100, 200, "config", "config")
    cfg = _cfg(tiny_model_dir, "plan.expected_prompt_length=null")
    assert expected_lengths(cfg) == Lengths(512, 512)
    assert dataclasses.replace(Lengths(400, 500), prompt=600).within(cfg) == Lengths(512, 500)


@pytest.mark.parametrize("override, key", [
    ("plan.expected_prompt_length=0", "plan.expected_prompt_length"),
    ("plan.expected_prompt_length=-3", "plan.expected_prompt_length"),
    ("plan.expected_prompt_length=mean", "plan.expected_prompt_length"),
    ("plan.expected_prompt_length=513", "plan.expected_prompt_length=513 is longer than data.max_prompt_length=512"),
    ("plan.expected_response_length=0", "plan.expected_response_length"),
    ("plan.expected_response_length=600", "plan.expected_response_length=600 is longer than rollout.max_response"),
])
def test_bad_values_are_config_errors(tiny_model_dir, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        _cfg(tiny_model_dir, override)
    assert "\n" not in str(e.value)
