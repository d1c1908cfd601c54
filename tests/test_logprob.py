"""Chunked log-probs from hidden states equal the full-logits computation, values and gradients."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fitrl.core.padding import position_ids_from_mask
from fitrl.ops.logprob import head_logprobs, response_logprobs, token_logprobs


def naive(logits, labels, temperature=1.0):
    """The reference: full fp32 log_softmax, gather, entropy."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp_all.gather(-1, labels[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=atol)


def close_grad(a, b):
    """Gradients summed chunk by chunk differ from one big matmul by fp32 summation order."""
    close(a, b, atol=5e-5)


ENTROPY = {"none": (False, False), "metric": (True, False), "grad": (True, True)}


def loss_of(logp, entropy, entropy_mode):
    """A loss with distinct per-token weights, so every token's gradient is checked."""
    w = torch.linspace(-1, 2, logp.numel()).view_as(logp)
    loss = (w * logp).sum()
    return loss + (w.flip(-1) * entropy).sum() if entropy_mode == "grad" else loss


@pytest.mark.parametrize("entropy_mode", list(ENTROPY))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_head_logprobs_equal_full_logits(entropy_mode, temperature, chunk_size, with_bias):
    B, T, H, V = 3, 7, 16, 50
    hidden = torch.randn(B, T, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    bias = torch.randn(V, requires_grad=True) if with_bias else None
    labels = torch.randint(0, V, (B, T))
    with_entropy, entropy_grad = ENTROPY[entropy_mode]

    ref_lp, ref_ent = naive(torch.nn.functional.linear(hidden, weight, bias), labels, temperature)
    params = [hidden, weight] + ([bias] if with_bias else [])
    ref_grads = torch.autograd.grad(loss_of(ref_lp, ref_ent, entropy_mode), params)

    lp, ent = head_logprobs(hidden, labels, weight, bias, temperature=temperature, chunk_size=chunk_size,
                            with_entropy=with_entropy, entropy_grad=entropy_grad)
    close(lp, ref_lp)
    if with_entropy:
        close(ent, ref_ent)
        assert ent.requires_grad == entropy_grad
    else:
        assert ent is None
    for g, ref in zip(torch.autograd.grad(loss_of(lp, ent, entropy_mode), params), ref_grads):
        close_grad(g, ref)

    with torch.no_grad():  # the old/ref log-prob path: no graph, no checkpoint
        lp, ent = head_logprobs(hidden, labels, weight, bias, temperature=temperature, chunk_size=chunk_size,
                                with_entropy=True)
    close(lp, ref_lp)
    close(ent, ref_ent)


@pytest.mark.parametrize("chunk_size,builds", [(64, 1), (5, 2 * 5)])  # 21 tokens: 1 chunk, or 5 recomputed
def test_one_chunk_keeps_its_logits_for_backward(monkeypatch, chunk_size, builds):
    """With one chunk the backward takes the forward's logits instead of another head matmul."""
    import fitrl.ops.logprob as ops

    calls = []
    build = ops._chunk_logits
    monkeypatch.setattr(ops, "_chunk_logits", lambda *a: calls.append(1) or build(*a))
    hidden, weight = torch.randn(3, 7, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    lp, _ = head_logprobs(hidden, torch.randint(0, 50, (3, 7)), weight, chunk_size=chunk_size)
    lp.sum().backward()
    assert len(calls) == builds


@pytest.mark.parametrize("frozen", ["hidden", "weight"])
def test_head_logprobs_gradient_of_one_input(frozen):
    """A frozen lm_head (or frozen hidden states) gets no gradient; the other input's is unchanged."""
    hidden = torch.randn(11, 8, requires_grad=frozen != "hidden")
    weight = torch.randn(30, 8, requires_grad=frozen != "weight")
    labels = torch.randint(0, 30, (11,))
    trained = weight if frozen == "hidden" else hidden
    ref_lp, ref_ent = naive(hidden @ weight.T, labels, 0.8)
    (ref,) = torch.autograd.grad(loss_of(ref_lp, ref_ent, "grad"), [trained])
    lp, ent = head_logprobs(hidden, labels, weight, temperature=0.8, chunk_size=4, with_entropy=True, entropy_grad=True)
    (g,) = torch.autograd.grad(loss_of(lp, ent, "grad"), [trained])
    close_grad(g, ref)


def test_head_logprobs_bf16_matches_hf_style_upcast():
    """bf16 weights: the matmul runs in bf16 and the logits are upcast, as HF's forward + .float()."""
    hidden = torch.randn(2, 6, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(40, 16, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 40, (2, 6))
    ref_lp, ref_ent = naive(hidden @ weight.T, labels, 0.7)
    ref_grads = torch.autograd.grad(loss_of(ref_lp, ref_ent, "grad"), [hidden, weight])
    lp, ent = head_logprobs(hidden, labels, weight, temperature=0.7, chunk_size=5, with_entropy=True, entropy_grad=True)
    assert lp.dtype == ent.dtype == torch.float32
    close(lp, ref_lp)
    close(ent, ref_ent)
    for g, ref in zip(torch.autograd.grad(loss_of(lp, ent, "grad"), [hidden, weight]), ref_grads):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, ref, rtol=2e-2, atol=2e-2)  # bf16 rounding of per-chunk sums


def test_token_logprobs_and_head_logprobs_agree():
    hidden, weight = torch.randn(2, 9, 8), torch.randn(40, 8)
    labels = torch.randint(0, 40, (2, 9))
    a = token_logprobs(hidden @ weight.T, labels, chunk_size=4, with_entropy=True, temperature=1.3)
    b = head_logprobs(hidden, labels, weight, chunk_size=4, with_entropy=True, temperature=1.3)
    close(a[0], b[0])
    close(a[1], b[1])


@pytest.fixture(scope="module", params=[("qwen2", "tiny"), ("llama", "tiny"), ("qwen2", "small"), ("llama", "small")],
                ids=lambda p: "-".join(p))
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from fitrl.models.tiny import make_tiny_model

    arch, size = request.param
    path = make_tiny_model(tmp_path_factory.mktemp("models") / f"{arch}-{size}", arch=arch, size=size)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tied = lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    assert tied == (size == "tiny")  # both cases are exercised
    return lm


def rollout_like_batch(vocab, prompt_lengths=(5, 2, 4), P=6, R=9):
    """Left-padded prompts then right-padded responses, as the rollout lays them out."""
    B = len(prompt_lengths)
    input_ids = torch.randint(3, vocab, (B, P + R))
    attention_mask = torch.ones(B, P + R, dtype=torch.long)
    for b, n in enumerate(prompt_lengths):
        attention_mask[b, :P - n] = 0
    attention_mask[1, -3:] = 0  # a response that stopped early
    return input_ids, attention_mask, position_ids_from_mask(attention_mask), R


@pytest.mark.parametrize("temperature,entropy_mode", [(1.0, "none"), (0.6, "metric"), (0.6, "grad")])
def test_response_logprobs_equal_full_model_logits(model, temperature, entropy_mode):
    model.zero_grad(set_to_none=True)
    input_ids, mask, pos, R = rollout_like_batch(model.config.vocab_size)
    labels = input_ids[:, -R:]
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    ref_lp, ref_ent = naive(logits[:, -R - 1:-1], labels, temperature)
    params = [p for p in model.parameters()]
    ref_grads = torch.autograd.grad(loss_of(ref_lp, ref_ent, entropy_mode), params)

    with_entropy, entropy_grad = ENTROPY[entropy_mode]
    lp, ent = response_logprobs(model, input_ids, mask, pos, R, temperature=temperature, chunk_size=4,
                                with_entropy=with_entropy, entropy_grad=entropy_grad)
    close(lp, ref_lp)
    if with_entropy:
        close(ent, ref_ent)
    for g, ref in zip(torch.autograd.grad(loss_of(lp, ent, entropy_mode), params), ref_grads):
        close_grad(g, ref)

    with torch.no_grad():
        lp, ent = response_logprobs(model, input_ids, mask, pos, R, temperature=temperature, chunk_size=5,
                                    with_entropy=True)
    close(lp, ref_lp)
    close(ent, ref_ent)


class WidestVocabTensor(TorchDispatchMode):
    """Largest number of vocabulary rows in any tensor an op allocates (views of inputs excluded)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab
                    and t.untyped_storage().data_ptr() not in inputs):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_no_tensor_holds_more_than_a_chunk_of_logits(model):
    """The property the module exists for, forward and backward: at most chunk_size x V."""
    input_ids, mask, pos, R = rollout_like_batch(model.config.vocab_size)
    with WidestVocabTensor(model.config.vocab_size) as probe:
        model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=R + 1)
    assert probe.rows >= input_ids.shape[0] * R  # the probe sees HF's (B, R+1, V) logits
    with WidestVocabTensor(model.config.vocab_size) as probe:
        lp, ent = response_logprobs(model, input_ids, mask, pos, R, chunk_size=4, with_entropy=True,
                                    entropy_grad=True)
        (lp.sum() + ent.sum()).backward()
    assert 0 < probe.rows <= 4
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("root_reshards,share", [(False, False), (True, False), (False, True)])
def test_fsdp2_root_sharded_model(tiny_model_dir, tmp_path, root_reshards, share):
    """Under fully_shard (per layer + root, as fitrl.distributed.fsdp.shard does) the head's weight is
    a DTensor outside the forward; the chunked head runs inside it, so values and gradients equal
    the unsharded model's, also when the root reshards after forward (it does once generation
    has called set_reshard_after_forward(True)). Tied embeddings: both uses are one parameter.
    ``share``: rows 0 and 2 have one prompt, which the shared-prompt forward runs once (two
    forwards of the root before one backward, fitrl/ops/shared_prompt.py)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sharded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    input_ids, mask, pos, R = rollout_like_batch(plain.config.vocab_size)
    if share:
        P = input_ids.shape[1] - R
        input_ids[2, :P], mask[2, :P] = input_ids[0, :P], mask[0, :P]
        pos = position_ids_from_mask(mask)
    kw = dict(temperature=0.8, chunk_size=4, with_entropy=True, entropy_grad=True)
    ref_lp, ref_ent = response_logprobs(plain, input_ids, mask, pos, R, **kw)
    (ref_lp.sum() + ref_ent.sum()).backward()
    kw["share_prompts"] = share
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        if root_reshards:
            sharded.set_reshard_after_forward(True, recurse=False)
        with torch.no_grad():
            lp, ent = response_logprobs(sharded, input_ids, mask, pos, R, **kw)
        close(lp, ref_lp)
        close(ent, ref_ent)
        lp, ent = response_logprobs(sharded, input_ids, mask, pos, R, **kw)
        (lp.sum() + ent.sum()).backward()
        close(lp, ref_lp)
        close(ent, ref_ent)
        for p, ref in zip(sharded.parameters(), plain.parameters()):
            close_grad(p.grad.full_tensor(), ref.grad)
    finally:
        dist.destroy_process_group()
