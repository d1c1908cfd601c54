"""A prompt shared by several rows goes through the model once (fitrl/ops/shared_prompt.py):
the same log-probs and gradients as the plain forward, fewer tokens, and only where it is exact."""

import copy

import pytest
import torch

from fitrl.config.schema import ActorConfig, AlgorithmConfig
from fitrl.core.padding import position_ids_from_mask
from fitrl.ops.logprob import response_logprobs
from fitrl.ops.shared_prompt import can_share, find_prompt_groups
from fitrl.roles.actor import Actor, WeightedMetrics
from helpers import assert_same_pass, assert_text_full_attention_only, logprobs_and_grads, tiny_rollout


def test_groups_are_found_by_prompt_ids_and_padding_only():
    ids = torch.tensor([[0, 5, 6, 1, 2],
                        [9, 5, 6, 3, 4],    # row 0's prompt: another pad id under the mask
                        [0, 0, 6, 1, 2],    # another prompt (padding differs)
                        [0, 5, 6, 7, 7]])   # row 0's prompt again, not next to it
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 0]])
    g = find_prompt_groups(ids, mask, prompt_len=3)
    assert g.inverse[0] == g.inverse[1] == g.inverse[3] != g.inverse[2]
    assert sorted(g.rows.tolist()) == [0, 2]  # the first row of each group
    assert g.shared
    assert not find_prompt_groups(ids[:3:2], mask[:3:2], prompt_len=3).shared


@pytest.fixture(scope="module", params=[("qwen2", "tiny"), ("llama", "small")], ids=lambda p: "-".join(p))
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from fitrl.models.tiny import make_tiny_model

    arch, size = request.param
    path = make_tiny_model(tmp_path_factory.mktemp("models") / f"{arch}-{size}", arch=arch, size=size)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def grouped_batch(vocab, P=7, R=9):
    """Three prompts (left-padded to P) with 3, 1 and 2 samples, rows interleaved; responses
    right-padded, two stopped early."""
    g = torch.Generator().manual_seed(3)
    lengths, order = (7, 3, 5), [0, 1, 0, 2, 0, 2]
    prompts = torch.randint(3, vocab, (3, P), generator=g)
    B = len(order)
    ids = torch.cat([prompts[order], torch.randint(3, vocab, (B, R), generator=g)], dim=1)
    mask = torch.ones(B, P + R, dtype=torch.long)
    for b, k in enumerate(order):
        mask[b, :P - lengths[k]] = 0
    mask[1, -4:] = 0
    mask[4, -1:] = 0
    return ids, mask, position_ids_from_mask(mask), R


@pytest.mark.parametrize("temperature,entropy_grad", [(1.0, False), (0.7, True)])
def test_shared_prompt_forward_equals_the_plain_one(model, temperature, entropy_grad):
    ids, mask, pos, R = grouped_batch(model.config.vocab_size)
    live = mask[:, -R:].bool()
    plain, shared = (logprobs_and_grads(model, ids, mask, pos, R, temperature=temperature, entropy_grad=entropy_grad,
                                        share_prompts=share) for share in (False, True))
    assert_same_pass(plain, shared, live)
    lp0 = plain[0]
    with torch.no_grad():
        lp2, _ = response_logprobs(model, ids, mask, pos, R, temperature=temperature, share_prompts=True)
    assert torch.allclose(lp0[live], lp2[live], atol=2e-5)


def test_each_prompt_runs_once(model):
    """Counted at the first decoder layer: G x P + B x R tokens instead of B x (P + R)."""
    ids, mask, pos, R = grouped_batch(model.config.vocab_size)
    seen = []
    hook = model.model.layers[0].register_forward_hook(lambda m, args, out: seen.append(args[0].shape[:2].numel()))
    try:
        with torch.no_grad():
            response_logprobs(model, ids, mask, pos, R, share_prompts=False)
            plain, seen[:] = sum(seen), []
            response_logprobs(model, ids, mask, pos, R, share_prompts=True)
    finally:
        hook.remove()
    B, T = ids.shape
    assert plain == B * T
    assert sum(seen) == 3 * (T - R) + B * R


def test_only_where_it_is_exact(model):
    pos = torch.zeros(2, 4, dtype=torch.long)
    model.eval()
    assert_text_full_attention_only(can_share, model)
    ckpt = copy.deepcopy(model)
    with pytest.warns(FutureWarning):  # as fitrl/models/loading.py turns it on
        ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert can_share(ckpt, pos, None)  # no recomputation without autograd
    ckpt.train()
    assert not can_share(ckpt, pos, None)


def test_actor_update_gradient_is_the_same_with_and_without_sharing(tiny_model_dir):
    """The actor's micro-batches of consecutive rows hold whole groups (n = 2 here)."""
    model, batch = tiny_rollout(tiny_model_dir)
    g = torch.Generator().manual_seed(1)
    mask = batch["response_mask"].float()
    batch.update(old_logprobs=batch["rollout_logprobs"], advantages=torch.randn(8, 1, generator=g) * mask)
    assert find_prompt_groups(batch["input_ids"], batch["attention_mask"],
                              batch["input_ids"].shape[1] - batch["responses"].shape[1]).rows.numel() == 4
    grads = {}
    for share in (False, True):
        m = copy.deepcopy(model)
        actor = Actor(m, ActorConfig(micro_batch_size=4, share_prompts=share), AlgorithmConfig(), total_steps=1)
        actor.model.train()
        actor.accumulate_gradients(batch, temperature=1.0, metrics=WeightedMetrics())
        grads[share] = [p.grad for p in m.parameters()]
    for a, b in zip(grads[False], grads[True]):
        assert (a - b).norm() <= 1e-5 * a.norm() + 1e-7

