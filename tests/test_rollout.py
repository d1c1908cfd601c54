"""HF rollout: layout, EOS masking, and rollout log-probs equal to the trainer's recompute."""

import pytest
import torch

from fitrl.config.schema import FSDPConfig, ModelConfig
from fitrl.data.batch import Batch
from fitrl.models.loading import build_model, load_tokenizer
from fitrl.ops.logprob import response_logprobs, token_logprobs
from fitrl.config.schema import SamplingConfig
from fitrl.core.padding import first_eos_mask
from fitrl.rollout.hf import HFRollout, SampleAndRecord


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    model = build_model("causal_lm", cfg, FSDPConfig(), torch.device("cpu"))
    return HFRollout(model, tok, micro_batch_size=5), tok


def prompts(tok, texts):
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"] for t in texts]
    return Batch(fields={"prompt_ids": ids, "answer": list(range(len(texts)))})


def test_first_eos_mask():
    r = torch.tensor([[5, 9, 7, 9], [9, 1, 1, 1], [1, 2, 3, 4]])
    assert first_eos_mask(r, [9]).tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_layout_and_fields(engine):
    rollout, tok = engine
    out = rollout.generate(prompts(tok, ["What is 1 + 2?", "Hi", "Compute 3 - 1 please."]),
                           SamplingConfig(temperature=1.0, n=4, max_tokens=6))
    assert len(out) == 12 and out["answer"][:5] == [0, 0, 0, 0, 1]
    B, L = out["input_ids"].shape
    R = out["responses"].shape[1]
    assert R <= 6 and torch.equal(out["input_ids"][:, -R:], out["responses"])
    assert torch.equal(out["attention_mask"][:, -R:], out["response_mask"])
    # prompts are left-padded: the column before the response is a real token everywhere
    assert torch.all(out["attention_mask"][:, L - R - 1] == 1)
    assert len(out["response_text"]) == 12
    assert torch.all(out["rollout_logprobs"] <= 0)


def test_rollout_logprobs_equal_recompute(engine):
    rollout, tok = engine
    torch.manual_seed(3)
    out = rollout.generate(prompts(tok, ["What is 4 + 4?", "A longer prompt than the other one", "x"]),
                           SamplingConfig(temperature=0.7, n=3, max_tokens=8))
    lp, _ = response_logprobs(rollout.model, out["input_ids"], out["attention_mask"], out["position_ids"],
                              out["responses"].shape[1], temperature=0.7)
    mask = out["response_mask"].bool()
    assert torch.allclose(lp[mask], out["rollout_logprobs"][mask], atol=1e-4)


def test_greedy_is_deterministic(engine):
    rollout, tok = engine
    p = prompts(tok, ["What is 2 + 2?", "Hello there"])
    a = rollout.generate(p, SamplingConfig(temperature=0.0, max_tokens=5))
    b = rollout.generate(p, SamplingConfig(temperature=0.0, max_tokens=5))
    assert torch.equal(a["responses"], b["responses"])


def test_top_k_and_top_p_restrict_the_support():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    ids = torch.zeros(1, 1, dtype=torch.long)
    k2 = SampleAndRecord(SamplingConfig(top_k=2))(ids, scores.clone())
    assert torch.isinf(k2[0, 2:]).all() and torch.isfinite(k2[0, :2]).all()
    p = SampleAndRecord(SamplingConfig(top_p=0.7))(ids, scores.clone())  # 0.5 + 0.3 reaches 0.7
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()


def test_never_generate_ids_are_not_sampled_but_logprobs_stay_the_full_distributions():
    # a Qwen-VL policy's image pad / vision markers (ModelInputs.never_generate): one in a response
    # would be read as an image the sample does not have
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    rec = SampleAndRecord(SamplingConfig(temperature=0.0), never_ids=[0])
    out = rec(torch.zeros(1, 1, dtype=torch.long), scores.clone())
    assert out.argmax(-1).item() == 1 and torch.isinf(out[0, 0])
    assert torch.allclose(rec.pending, torch.log_softmax(scores, -1))


def test_chunked_logprobs_equal_unchunked():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50)
    labels = torch.randint(0, 50, (3, 7))
    a, ea = token_logprobs(logits, labels, chunk_size=4, with_entropy=True, temperature=0.9)
    ref = torch.log_softmax(logits / 0.9, -1)
    assert torch.allclose(a, ref.gather(-1, labels[..., None]).squeeze(-1), atol=1e-5)
    assert torch.allclose(ea, -(ref.exp() * ref).sum(-1), atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 16, 1000])
def test_chunking_paths_agree_on_non_contiguous_logits(chunk_size):
    torch.manual_seed(1)
    full = torch.randn(5, 8, 30)
    logits = full[:, :-1]  # (5, 7, 30), non-contiguous like response_logprobs' slice
    labels = torch.randint(0, 30, (5, 7))
    lp, ent = token_logprobs(logits, labels, chunk_size=chunk_size, with_entropy=True)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(lp, ref.gather(-1, labels[..., None]).squeeze(-1), atol=1e-5)
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-5)


def test_checkpoint_generation_config_cannot_change_sampling(tiny_model_dir, tmp_path):
    """Qwen checkpoints ship top_k=20, top_p=0.8, temperature=0.7, repetition_penalty=1.05; none
    may leak into what the config asked for (it would bias the recorded log-probs)."""
    import json
    import shutil

    model_dir = tmp_path / "qwen-like"
    shutil.copytree(tiny_model_dir, model_dir)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen.update(top_k=20, top_p=0.8, temperature=0.7, repetition_penalty=1.05, do_sample=True)
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    cfg = ModelConfig(path=str(model_dir))
    tok = load_tokenizer(cfg)
    model = build_model("causal_lm", cfg, FSDPConfig(), torch.device("cpu"))
    rollout = HFRollout(model, tok)
    seen = []
    original = model._get_logits_processor
    model._get_logits_processor = lambda *a, **k: seen.append(original(*a, **k)) or seen[-1]
    out = rollout.generate(prompts(tok, ["What is 1 + 1?", "Hi"]), SamplingConfig(temperature=1.0, n=8, max_tokens=6))
    assert [type(p).__name__ for p in seen[0]] == ["SampleAndRecord"]
    lp, _ = response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"],
                              out["responses"].shape[1])
    mask = out["response_mask"].bool()
    assert torch.allclose(lp[mask], out["rollout_logprobs"][mask], atol=1e-4)


def test_all_padding_columns_do_not_change_logprobs(engine):
    """Extra left padding and extra right response padding are trimmed before the forward."""
    rollout, tok = engine
    out = rollout.generate(prompts(tok, ["What is 4 + 4?", "Hi"]), SamplingConfig(n=2, max_tokens=5))
    R = out["responses"].shape[1]
    lp, _ = response_logprobs(rollout.model, out["input_ids"], out["attention_mask"], out["position_ids"], R)
    pad = rollout.pad_id
    ids = torch.nn.functional.pad(torch.nn.functional.pad(out["input_ids"], (3, 0), value=pad), (0, 4), value=pad)
    mask = torch.nn.functional.pad(out["attention_mask"], (3, 4))
    pos = torch.nn.functional.pad(out["position_ids"], (3, 4))
    lp_padded, _ = response_logprobs(rollout.model, ids, mask, pos, R + 4)
    assert lp_padded.shape == (4, R + 4)
    assert torch.allclose(lp_padded[:, :R], lp, atol=1e-5) and torch.all(lp_padded[:, R:] == 0)


def test_vllm_engine_without_vllm_installed_is_one_line(tiny_model_dir, tmp_path):
    """The main environment has no vLLM (it lives in .venv-vllm): asking for it names the install."""
    import importlib.util

    from fitrl.core.errors import ConfigError
    from fitrl.roles.workers import PolicyWorker
    from helpers import toy_config

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here (its tier covers the engine)")
    cfg = toy_config(tiny_model_dir, tmp_path / "run", "rollout.engine=vllm")
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm needs vLLM .*pip install 'fitrl\[vllm\]'"):
        PolicyWorker(cfg, rank=0, world_size=1)
