"""fitrl.models.tiny: locally built random-weight causal LMs load and behave like the real ones."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

from fitrl.models.tiny import ARCHS, SIZES, build_corpus, describe, make_tiny_model  # noqa: E402

# arch -> (end-of-turn token, pad token, bos token, assistant header rendered by add_generation_prompt)
EXPECT = {
    "qwen2": ("<|im_end|>", "<|endoftext|>", None, "<|im_start|>assistant\n"),
    "llama": (
        "<|eot_id|>",
        "<|finetune_right_pad_id|>",
        "<|begin_of_text|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
}
CONVO = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 12 + 345? Answer with a number."},
]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch=arch, size="tiny", seed=0) for arch in ARCHS}


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return {
        arch: (AutoTokenizer.from_pretrained(p), AutoModelForCausalLM.from_pretrained(p))
        for arch, p in tiny_dirs.items()
    }


def test_import_is_light():
    code = "import sys, fitrl.models.tiny; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_loads_through_auto_classes(arch, tiny_dirs, loaded):
    tok, model = loaded[arch]
    eot, pad, bos, _ = EXPECT[arch]
    cfg = model.config
    assert cfg.model_type == arch
    assert type(model).__name__ == ARCHS[arch].model_class
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert cfg.intermediate_size == 256 and cfg.max_position_embeddings == 2048
    assert cfg.tie_word_embeddings is True
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert cfg.vocab_size == len(tok)
    assert 400 <= len(tok) <= 600
    assert tok.eos_token == eot and tok.pad_token == pad and tok.bos_token == bos
    assert tok.pad_token_id != tok.eos_token_id
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    assert cfg.bos_token_id == (tok.bos_token_id if bos else None)
    for t in ARCHS[arch].special_tokens:  # all specials are single, special tokens
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] in tok.all_special_ids


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tokenizer_json_matches_auto_tokenizer(arch, tiny_dirs, loaded):
    # AutoTokenizer may pick a model-specific class (Qwen2Tokenizer rebuilds its pre-tokenizer):
    # it must still tokenise exactly like the tokenizer.json we trained.
    tok, _ = loaded[arch]
    raw = Tokenizer.from_file(str(tiny_dirs[arch] / "tokenizer.json"))
    samples = build_corpus()[::7] + ["Hello  world!\n\n(answer): 3.14159\t-42 ok\n", "x<|im_end|>y"]
    for s in samples:
        assert tok(s, add_special_tokens=False)["input_ids"] == raw.encode(s, add_special_tokens=False).ids, s


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_chat_template(arch, loaded):
    tok, _ = loaded[arch]
    eot, _, bos, header = EXPECT[arch]
    text = tok.apply_chat_template(CONVO, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    assert text.endswith(header)
    assert text.count(eot) == 2
    assert "You are a helpful assistant." in text and "What is 12 + 345? Answer with a number." in text
    if arch == "qwen2":
        assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    else:
        assert text.startswith(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\n"
        )
    no_prompt = tok.apply_chat_template(CONVO, add_generation_prompt=False, tokenize=False)
    assert not no_prompt.endswith(header) and text.startswith(no_prompt)

    # The way the rest of fitrl encodes prompts: render, then tokenise without added specials.
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    if bos is None:
        assert tok.bos_token_id is None
        assert tok("hi 1")["input_ids"] == tok("hi 1", add_special_tokens=False)["input_ids"]
    else:
        assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
        assert tok("hi 1")["input_ids"][0] == tok.bos_token_id  # plain encode adds BOS, like Llama-3

    # tokenize=True gives a BatchEncoding in transformers 5; same ids as the two-step path.
    enc = tok.apply_chat_template(CONVO, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert list(enc["input_ids"]) == ids

    # Assistant turns are marked for loss masks.
    convo = CONVO + [{"role": "assistant", "content": "357"}]
    out = tok.apply_chat_template(convo, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    marked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(marked) == "357" + eot


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_digits_are_single_tokens(arch, loaded):
    tok, _ = loaded[arch]
    text = "What is 12345 + 67890? 80235"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("1234567890" + "80235")
    assert tok.decode(ids) == text
    # No learned token mixes a digit with anything else.
    specials = set(tok.all_special_ids)
    for i in range(len(tok)):
        if i in specials:
            continue
        piece = tok.decode([i])
        if any(c.isdigit() for c in piece):
            assert len(piece) == 1, (i, piece)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_eos_is_end_of_turn_and_matches_generation_config(arch, tiny_dirs, loaded):
    tok, model = loaded[arch]
    eot, pad, bos, _ = EXPECT[arch]
    gen = GenerationConfig.from_pretrained(tiny_dirs[arch])
    assert gen.eos_token_id == tok.convert_tokens_to_ids(eot) == tok.eos_token_id == model.config.eos_token_id
    assert gen.pad_token_id == tok.convert_tokens_to_ids(pad) == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    if bos:
        assert gen.bos_token_id == tok.bos_token_id


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_generate_with_sampling(arch, loaded):
    tok, model = loaded[arch]
    tok.padding_side = "left"
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
        for c in ("What is 3 + 4?", "Compute 12 - 5. Answer with a number.")
    ]
    enc = tok(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=6)
    prompt_len = enc["input_ids"].shape[1]
    assert out.shape[0] == 2 and prompt_len < out.shape[1] <= prompt_len + 6
    assert ((out >= 0) & (out < len(tok))).all()
    assert isinstance(tok.decode(out[0, prompt_len:]), str)


def test_deterministic(tmp_path, tiny_dirs):
    a = tiny_dirs["qwen2"]  # built with seed 0
    b = make_tiny_model(tmp_path / "b", arch="qwen2", size="tiny", seed=0)
    c = make_tiny_model(tmp_path / "c", arch="qwen2", size="tiny", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # Another seed: other weights, same tokenizer.
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    wa, wc = load_file(str(a / "model.safetensors")), load_file(str(c / "model.safetensors"))
    assert wa.keys() == wc.keys()
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    # Building does not disturb the caller's RNG.
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_model(tmp_path / "d", arch="llama", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_arch_or_size(tmp_path):
    with pytest.raises(ValueError) as e:
        make_tiny_model(tmp_path / "x", arch="gpt9")
    assert "qwen2" in str(e.value) and "llama" in str(e.value)
    with pytest.raises(ValueError) as e:
        make_tiny_model(tmp_path / "y", size="huge")
    assert "tiny" in str(e.value) and "small" in str(e.value)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_describe(tiny_dirs, loaded):
    for arch, path in tiny_dirs.items():
        info = describe(path)
        _, model = loaded[arch]
        assert info["arch"] == arch and info["size"] == "tiny"
        assert info["params"] == sum(p.numel() for p in model.parameters())
        assert info["vocab_size"] == model.config.vocab_size
        assert (info["hidden_size"], info["num_layers"]) == (64, 2)


def test_small_size(tmp_path):
    assert set(SIZES) >= {"tiny", "small"}
    path = make_tiny_model(tmp_path / "small", arch="llama", size="small", seed=0)
    info = describe(path)
    assert 25_000_000 <= info["params"] <= 35_000_000, info
    assert (info["hidden_size"], info["num_layers"], info["num_heads"], info["num_kv_heads"]) == (512, 8, 8, 4)
    assert info["intermediate_size"] == 1408 and info["tie_word_embeddings"] is False
    cfg = AutoConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert cfg.vocab_size == len(tok) > 2000
    model = AutoModelForCausalLM.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) == info["params"]
    ids = tok("What is 3 + 4?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_the_agent_size_tokenizes_a_tool_prompt_and_call_compactly(tmp_path):
    """The agent example's model (SIZES["agent"]): its tokenizer, trained on tool-calling
    conversations too, writes the calculator's prompt in under 140 tokens and a call in under 30
    (the base corpus: 511 and 66, too long for a 0.6M model to learn to copy across in minutes),
    digits still one token each; the base tokenizer is the one it was (the weights pin above)."""
    from fitrl.agents.tools import tool_schemas

    path = make_tiny_model(tmp_path / "agent", arch="qwen2", size="agent", seed=0)
    info = describe(path)
    assert (info["hidden_size"], info["num_layers"], info["head_dim"]) == (128, 2, 32) and info["params"] < 1_000_000
    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 37 * 43? Use the calculator."}],
                                     tools=tool_schemas(["calculator"]), add_generation_prompt=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    call = tok('<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 43"}}\n</tool_call>')["input_ids"]
    assert len(prompt) < 140 and len(call) < 30, (len(prompt), len(call))
    assert [tok.decode([i]) for i in call if tok.decode([i]).isdigit()] == ["3", "7", "4", "3"]


# sha256 of model.safetensors of `make_tiny_model(arch=..., size="tiny", seed=0)`, as built before the
# head_dim option existed (transformers 5.19 and 5.23 alike): the demo, tests and planner calibrations
# rely on these exact weights. config.json is not pinned: it records the transformers version.
TINY_WEIGHTS_SHA256 = {
    "qwen2": "ab0dd7a89b363ad54e2dc2b22097b42f7aab93e932e71cf03da94f0b30e33589",
    "llama": "244e306765287ff0d05fb76da85c52100f773b3d3116a3e8e244150c81399181",
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_default_tiny_weights_are_pinned(arch, tiny_dirs, tmp_path):
    import hashlib

    path = tiny_dirs[arch]
    assert hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest() == TINY_WEIGHTS_SHA256[arch]
    # the size's own head_dim is the default: every file byte for byte
    own = make_tiny_model(tmp_path / "own", arch=arch, size="tiny", seed=0, head_dim=16)
    assert sorted(p.name for p in own.iterdir()) == sorted(p.name for p in path.iterdir())
    for f in path.iterdir():
        assert (own / f.name).read_bytes() == f.read_bytes(), f.name
    assert "head_dim" not in (path / "fitrl_tiny.json").read_text()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_head_dim_resplits_the_heads(arch, tiny_dirs, loaded, tmp_path):
    import json

    from fitrl.models.tiny import head_dims

    assert head_dims(arch, "tiny") == [2, 4, 8, 16, 32, 64]
    path = make_tiny_model(tmp_path / "hd32", arch=arch, size="tiny", seed=0, head_dim=32)
    cfg = AutoConfig.from_pretrained(path)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 1)  # q/kv ratio 2 kept
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.model.layers[0].self_attn.head_dim == 32
    # same shapes, so the same weights for the seed; only the split into heads (and so the outputs) differs
    assert load_file(str(path / "model.safetensors")).keys() == load_file(str(tiny_dirs[arch] / "model.safetensors")).keys()
    assert (path / "model.safetensors").read_bytes() == (tiny_dirs[arch] / "model.safetensors").read_bytes()
    tok, default = loaded[arch]
    ids = tok("What is 3 + 4? 7", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = model(ids).logits, default(ids).logits
    assert torch.isfinite(a).all() and (a - b).abs().max() > 1e-6
    assert (path / "tokenizer.json").read_bytes() == (tiny_dirs[arch] / "tokenizer.json").read_bytes()
    assert json.loads((path / "fitrl_tiny.json").read_text())["head_dim"] == 32
    info = describe(path)
    assert (info["num_heads"], info["num_kv_heads"], info["head_dim"]) == (2, 1, 32)
    assert describe(tiny_dirs[arch])["head_dim"] == 16
    # one head of 64: the ratio cannot be kept, one kv head (k/v projections of 64 rows instead of 32)
    one = AutoConfig.from_pretrained(make_tiny_model(tmp_path / "hd64", arch=arch, size="tiny", head_dim=64))
    assert (one.num_attention_heads, one.num_key_value_heads) == (1, 1)


@pytest.mark.parametrize("bad", [24, 0, -32, 128, 3, 1, True, "32", 32.0])
def test_bad_head_dim_is_one_line(bad, tmp_path):
    with pytest.raises(ValueError) as e:
        make_tiny_model(tmp_path / "m", arch="qwen2", size="tiny", head_dim=bad)
    message = str(e.value)
    assert "\n" not in message and f"head_dim {bad!r} is not possible for qwen2 size 'tiny'" in message
    assert message.endswith("valid: 2, 4, 8, 16, 32, 64")
    assert not (tmp_path / "m").exists()


def test_make_tiny_model_command_head_dim(tmp_path, capsys):
    from fitrl.cli import main

    assert main(["make-tiny-model", str(tmp_path / "m"), "--head-dim", "32"]) == 0
    out = capsys.readouterr().out
    assert "num_heads=2, num_kv_heads=1, head_dim=32" in out
    assert main(["make-tiny-model", str(tmp_path / "x"), "--size", "small", "--head-dim", "48"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fitrl: config error: head_dim 48 is not possible for qwen2 size 'small'")
    assert not (tmp_path / "x").exists()
