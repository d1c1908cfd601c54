"""rollout.decode=loop: the shared sampling step on hand-made logits, and the loop against HF
``generate`` and the trainer's log-probs on the tiny model."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

from fitrl.config.schema import FSDPConfig, ModelConfig, RolloutConfig, SamplingConfig
from fitrl.core.errors import Diverged
from fitrl.core.padding import left_pad
from fitrl.data.batch import Batch
from fitrl.models.families.base import ModelInputs
from fitrl.models.loading import build_model, load_tokenizer
from fitrl.ops.logprob import response_logprobs
from fitrl.rollout.decode import decode_loop, draw, loop_unsupported, sample_step
from fitrl.rollout.hf import HFRollout
from vllm_helpers import ks_two_sample

NEG = float("-inf")
LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


# ----------------------------------------------------------------------------- the step on hand-made logits


def test_logprobs_are_the_tempered_distribution_before_any_truncation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    scores, logp, bad = sample_step(logits, SamplingConfig(temperature=0.5, top_k=2, top_p=0.9), eos_ids=[0])
    assert torch.allclose(logp, torch.log_softmax(logits / 0.5, -1))
    assert not bool(bad)
    # top-k 2 keeps [4, 2] (tempered), whose softmax is [0.88, 0.12]: top-p 0.9 keeps both
    assert torch.equal(torch.isinf(scores), torch.tensor([[False, False, True, True]]))
    assert torch.allclose(scores[0, :2], torch.tensor([4.0, 2.0]))


def test_top_k_and_top_p_restrict_the_support():
    k2, _, _ = sample_step(LOGITS, SamplingConfig(top_k=2))
    assert torch.isinf(k2[0, 2:]).all() and torch.isfinite(k2[0, :2]).all()
    p, _, _ = sample_step(LOGITS, SamplingConfig(top_p=0.7))  # 0.5 + 0.3 reaches 0.7: the rest goes
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()
    p, _, _ = sample_step(LOGITS, SamplingConfig(top_p=0.5))  # the first alone reaches 0.5
    assert torch.isfinite(p[0, 0]) and torch.isinf(p[0, 1:]).all()
    p, _, _ = sample_step(LOGITS, SamplingConfig(top_p=0.81))  # 0.8 before the third: it stays
    assert torch.isfinite(p[0, :3]).all() and torch.isinf(p[0, 3])


def test_ignore_eos_and_never_ids_are_masked_after_the_record():
    s = SamplingConfig(ignore_eos=True)
    scores, logp, _ = sample_step(LOGITS, s, eos_ids=[0], never_ids=[2])
    assert scores[0].tolist()[0] == NEG and scores[0, 2] == NEG and torch.isfinite(scores[0, [1, 3]]).all()
    assert torch.allclose(logp, torch.log_softmax(LOGITS, -1))  # the full distribution's
    scores, _, _ = sample_step(LOGITS, SamplingConfig(), eos_ids=[0])  # EOS stays samplable without ignore_eos
    assert torch.isfinite(scores).all()


def test_greedy_ignores_temperature_and_truncation():
    s = SamplingConfig(temperature=0.0, top_k=1, top_p=0.1)
    scores, logp, _ = sample_step(LOGITS, s, never_ids=[0])
    assert torch.allclose(logp, torch.log_softmax(LOGITS, -1))
    assert torch.isfinite(scores[0, 1:]).all() and draw(scores, greedy=True).item() == 1


def test_nonfinite_logits_are_flagged_and_replaced():
    logits = torch.zeros(2, 8)
    logits[0, 3], logits[1, 5] = math.nan, math.inf
    scores, logp, bad = sample_step(logits, SamplingConfig())
    assert bool(bad) and torch.isfinite(scores).all() and torch.isfinite(logp).all()
    assert not bool(sample_step(torch.zeros(2, 8), SamplingConfig())[2])


def test_draw_follows_the_softmax_and_never_draws_masked_tokens():
    torch.manual_seed(0)
    scores = torch.log(torch.tensor([0.5, 0.3, 0.0, 0.15, 0.05])).expand(20000, 5).contiguous()
    tokens = draw(scores, greedy=False)
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    assert freq[2] == 0
    # 20,000 draws: the standard error of a frequency is at most 0.0036
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.0, 0.15, 0.05]), atol=0.015)
    assert torch.equal(draw(torch.tensor([[NEG, 0.0, NEG]]).expand(100, 3), greedy=False), torch.ones(100).long())


# ----------------------------------------------------------------------------- the loop on the tiny model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matmuls are too small to split: on a busy 2-core machine two threads made
    these tests 10x slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    model = build_model("causal_lm", cfg, FSDPConfig(), torch.device("cpu"))
    return model.eval(), tok


def chat(tok, texts):
    return [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                        tokenize=False), add_special_tokens=False)["input_ids"] for t in texts]


TEXTS = ["What is 1 + 2?", "Hi", "A much longer prompt than the others, to be left-padded less", "What is 7 + 5?",
         "x", "Compute 3 - 1 please."]


def engines(model, tok, stop_ids, **kwargs):
    """HF ``generate`` and the loop on ``model``, both stopping at ``stop_ids`` (plus the real EOS)."""
    model.generation_config = GenerationConfig(eos_token_id=[*stop_ids, tok.eos_token_id])
    return (HFRollout(model, tok, decode="generate", **kwargs), HFRollout(model, tok, decode="loop", **kwargs))


@pytest.fixture(scope="module")
def sharp(policy):
    """The tiny policy with its matrices redrawn at std 0.4: its greedy responses vary (the
    initialisation's std 0.02 answers one token over and over) and their argmax is clear."""
    model, tok = policy
    sharp = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in sharp.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.4, generator=g)
    return sharp, tok


def staggered_stops(model, tok, ids, max_tokens):
    """Stop ids at which the greedy rows end at different steps: row i's token at step 2i+1."""
    gen, _ = engines(model, tok, [])
    rows = gen.generate(Batch(fields={"prompt_ids": ids}), SamplingConfig(temperature=0.0, max_tokens=max_tokens))
    return sorted({row[min(2 * i + 1, max_tokens - 1)] for i, row in enumerate(rows["responses"].tolist())})


def test_greedy_equals_hf_generate_token_for_token(sharp):
    model, tok = sharp
    ids = chat(tok, TEXTS)
    gen, loop = engines(model, tok, staggered_stops(model, tok, ids, 12), micro_batch_size=4)
    s = SamplingConfig(temperature=0.0, max_tokens=12)
    a = gen.generate(Batch(fields={"prompt_ids": ids}), s)
    b = loop.generate(Batch(fields={"prompt_ids": ids}), s)
    lengths = a["response_mask"].sum(1)
    assert len(set(lengths.tolist())) > 2, lengths  # the rows stop at different steps
    for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "finished"):
        assert torch.equal(a[k], b[k]), k
    assert torch.allclose(a["rollout_logprobs"], b["rollout_logprobs"], atol=1e-5)
    assert a["response_text"] == b["response_text"]


def test_finished_rows_leave_the_batch(sharp):
    model, tok = sharp
    ids = chat(tok, TEXTS)
    stops = staggered_stops(model, tok, ids, 12)
    pid, pmask = left_pad(ids, tok.pad_token_id, max(map(len, ids)))
    rows = []
    hook = model.register_forward_pre_hook(lambda m, args, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        every_step, _ = decode_loop(model, pid, pmask, SamplingConfig(temperature=0.0, max_tokens=12),
                                    eos_ids=stops, pad_id=tok.pad_token_id)
        looks = len(rows)
        every_third, _ = decode_loop(model, pid, pmask, SamplingConfig(temperature=0.0, max_tokens=12),
                                     eos_ids=stops, pad_id=tok.pad_token_id, check_every=3)
    finally:
        hook.remove()
    assert rows[0] == len(ids) and rows[looks - 1] < len(ids)  # prefill: all rows; the last steps: fewer
    assert rows[:looks] == sorted(rows[:looks], reverse=True)
    assert torch.equal(every_step, every_third)  # finished rows that decode until a look change nothing


def test_each_prompt_is_prefilled_once(sharp):
    """n = 3 samples of 3 prompts: the prefill runs 3 rows, and the 9 greedy responses are
    generate's, token for token (a group's rows start from one prompt's keys and values)."""
    model, tok = sharp
    ids = chat(tok, TEXTS[:3])
    gen, loop = engines(model, tok, staggered_stops(model, tok, ids, 8))
    s = SamplingConfig(temperature=0.0, max_tokens=8, n=3)
    rows = []
    hook = model.register_forward_pre_hook(lambda m, args, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        b = loop.generate(Batch(fields={"prompt_ids": ids}), s)
    finally:
        hook.remove()
    a = gen.generate(Batch(fields={"prompt_ids": ids}), s)
    assert rows[0] == 3 and rows[1] > 3, rows
    for k in ("input_ids", "attention_mask", "responses", "response_mask"):
        assert torch.equal(a[k], b[k]), k
    assert torch.allclose(a["rollout_logprobs"], b["rollout_logprobs"], atol=1e-5)


def test_sampled_logprobs_equal_the_trainers_recompute(policy):
    model, tok = policy
    gen, loop = engines(model, tok, list(range(40, 72)))  # 32 stop ids: ~6% per step, lengths vary
    torch.manual_seed(3)
    out = loop.generate(Batch(fields={"prompt_ids": chat(tok, TEXTS)}),
                        SamplingConfig(temperature=0.7, top_k=100, top_p=0.9, n=4, max_tokens=16))
    assert out["response_mask"].sum(1).unique().numel() > 1
    lp, _ = response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"],
                              out["responses"].shape[1], temperature=0.7)
    mask = out["response_mask"].bool()
    assert torch.allclose(lp[mask], out["rollout_logprobs"][mask], atol=1e-5)
    assert torch.all(out["rollout_logprobs"][~mask] == 0)


def test_response_lengths_are_distributed_as_with_generate(policy):
    model, tok = policy
    gen, loop = engines(model, tok, list(range(40, 72)), micro_batch_size=128)
    prompts = Batch(fields={"prompt_ids": chat(tok, TEXTS[:4] * 8)})  # 32 prompts x 8 = 256 sequences each
    s = SamplingConfig(temperature=1.0, top_k=200, n=8, max_tokens=24)
    torch.manual_seed(0)
    a = gen.generate(prompts, s)["response_mask"].sum(1).tolist()
    torch.manual_seed(0)
    b = loop.generate(prompts, s)["response_mask"].sum(1).tolist()
    assert 4 < sum(a) / len(a) < 20 and 4 < sum(b) / len(b) < 20  # most stop early: lengths carry signal
    d, p = ks_two_sample(a, b)
    assert p > 0.01, (d, p)


def test_ignore_eos_makes_max_tokens(policy):
    model, tok = policy
    _, loop = engines(model, tok, list(range(40, 72)))
    out = loop.generate(Batch(fields={"prompt_ids": chat(tok, TEXTS)}),
                        SamplingConfig(temperature=1.0, n=2, max_tokens=20, ignore_eos=True))
    assert out["responses"].shape[1] == 20 and torch.all(out["response_mask"] == 1)
    assert not torch.isin(out["responses"], torch.tensor(loop.eos_ids)).any()


def test_nonfinite_logits_raise_diverged(policy):
    model, tok = policy
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.norm.weight[0] = math.nan
    rollout = HFRollout(broken, tok, decode="loop")
    with pytest.raises(Diverged, match="logits hold NaN or infinity"):
        rollout.generate(Batch(fields={"prompt_ids": chat(tok, TEXTS[:2])}), SamplingConfig(max_tokens=4))


def test_config_picks_the_path_and_vision_language_models_fall_back(policy):
    model, tok = policy
    cfg = RolloutConfig()
    assert cfg.decode == "loop" and HFRollout.from_config(model, tok, cfg).decode == "loop"
    images = HFRollout(model, tok, decode="loop", inputs=ModelInputs())  # a family's own inputs: images
    assert images.decode == "generate" and "images" in images.loop_unsupported
    vl = SimpleNamespace(config=SimpleNamespace(vision_config=object()))
    assert loop_unsupported(vl) == "a vision-language model"
    with pytest.raises(ValueError, match="'loop' or 'generate'"):
        HFRollout(model, tok, decode="sample")


def test_greedy_under_bf16_autocast_equals_hf_generate(sharp):
    """Mixed precision in one process decodes with the loop too: its static cache takes the
    dtypes of the first keys and values (bf16 values, fp32 keys after the fp32 rotary)."""
    from fitrl.core.device import autocast

    model, tok = sharp
    ids = chat(tok, TEXTS)
    gen, loop = engines(model, tok, staggered_stops(model, tok, ids, 12), micro_batch_size=4)
    s = SamplingConfig(temperature=0.0, max_tokens=12)
    with autocast(torch.device("cpu"), torch.bfloat16):
        a = gen.generate(Batch(fields={"prompt_ids": ids}), s)
        b = loop.generate(Batch(fields={"prompt_ids": ids}), s)
    for k in ("responses", "response_mask", "finished"):
        assert torch.equal(a[k], b[k]), k
    # bf16 rounds the attention over the two caches (a static one with masked empty slots, a
    # growing one) differently: log-probs of logits of size ~10 agree to bf16's few digits
    diff = (a["rollout_logprobs"] - b["rollout_logprobs"]).abs()[a["response_mask"].bool()]
    assert diff.max() < 0.1 and diff.mean() < 0.01, (diff.max(), diff.mean())


@pytest.mark.parametrize("mixed", [False, True])
def test_the_kv_cache_is_freed_when_the_loop_returns(sharp, mixed):
    """The static cache goes with its last reference, not at Python's next full collection: its
    layers form no reference cycle (they did: one whole cache per rollout outlived the loop into
    the update). The cyclic collector is off here, so a cycle would leave the layers behind."""
    import gc

    from transformers.cache_utils import StaticLayer

    from fitrl.core.device import autocast

    model, tok = sharp
    ids = chat(tok, TEXTS)
    pid, pmask = left_pad(ids, tok.pad_token_id, max(map(len, ids)))
    gc.collect()
    gc.disable()
    try:
        with autocast(torch.device("cpu"), torch.bfloat16 if mixed else None):
            responses, _ = decode_loop(model, pid, pmask, SamplingConfig(temperature=0.0, max_tokens=6),
                                       eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
        alive = [o for o in gc.get_objects() if isinstance(o, StaticLayer)]
    finally:
        gc.enable()
    assert responses.shape[0] == len(ids)
    assert not alive, f"{len(alive)} KV cache layers outlived the loop"
