"""Padding-free packing (fitrl/core/packing.py, fitrl/ops/packed.py): the layout by hand, and the
same log-probs, entropies, losses, gradients and values as padded micro-batches, fewer positions,
only where it is exact."""

import copy
import random

import pytest
import torch

from fitrl.config.schema import ActorConfig, AlgorithmConfig, CriticConfig
from fitrl.core.packing import pack_layout, pack_rows, packed_positions, packed_size
from fitrl.core.padding import position_ids_from_mask
from fitrl.data.balance import micro_batches_by_tokens
from fitrl.data.batch import Batch
from fitrl.ops.logprob import choose_layout, response_logprobs
from fitrl.ops.packed import can_pack
from fitrl.roles.actor import Actor, WeightedMetrics
from helpers import assert_same_pass, assert_text_full_attention_only, logprobs_and_grads, positions_run


def test_rows_are_first_fit_decreasing():
    assert pack_rows([5, 1, 4, 2, 3], 6) == [[0, 1], [2, 3], [4]]
    assert pack_rows([3, 3, 3], 3) == [[0], [1], [2]]
    assert pack_rows([7, 2], 5) == [[0], [1]]  # longer than the width: alone
    assert packed_size([5, 1, 4, 2, 3]) == 3 * 5  # width 5: 5 | 4+1 | 3+2
    assert packed_size([]) == 0


def test_layout_by_hand():
    # rows: 2 real tokens (cols 1-2), 4 (cols 0-3), 1 (col 2); width 4: [4-token], [2-token + 1-token + filler]
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0]])
    layout = pack_layout(mask)
    assert layout.shape == (2, 4)
    assert layout.source.tolist() == [[4, 5, 6, 7], [1, 2, 10, 0]]  # the filler points at a padding slot
    assert layout.filler.tolist() == [[False] * 4, [False, False, False, True]]
    assert layout.target.tolist() == [[-1, 4, 5, -1], [0, 1, 2, 3], [-1, -1, 6, -1]]
    pos = packed_positions(layout, position_ids_from_mask(mask))
    assert pos.tolist() == [[0, 1, 2, 3], [0, 1, 0, 0]]  # each sequence from 0; the filler its own
    ids = torch.arange(12).view(3, 4)
    assert layout.gather(ids)[layout.filler.logical_not()].tolist() == [4, 5, 6, 7, 1, 2, 10]


def test_layout_refuses_a_row_with_a_gap():
    with pytest.raises(ValueError, match="row 1 .* padding between its tokens"):
        pack_layout(torch.tensor([[1, 1, 0], [1, 0, 1]]))


@pytest.fixture(scope="module", params=[("qwen2", "tiny"), ("llama", "small")], ids=lambda p: "-".join(p))
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from fitrl.models.tiny import make_tiny_model

    arch, size = request.param
    path = make_tiny_model(tmp_path_factory.mktemp("models") / f"{arch}-{size}", arch=arch, size=size)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def mixed_batch(vocab, prompts=(9, 3, 5, 2, 7, 4), responses=(12, 2, 3, 1, 6, 12), seed=0):
    """Left-padded prompts and right-padded responses of very different lengths, all distinct."""
    g = torch.Generator().manual_seed(seed)
    P, R, B = max(prompts), max(responses), len(prompts)
    ids = torch.randint(3, vocab, (B, P + R), generator=g)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        mask[b, P - p:P + r] = 1
    return ids, mask, position_ids_from_mask(mask), R


@pytest.mark.parametrize("temperature,entropy_grad", [(1.0, False), (0.7, True)])
def test_packed_forward_equals_the_padded_one(model, temperature, entropy_grad):
    ids, mask, pos, R = mixed_batch(model.config.vocab_size)
    live = mask[:, -R:].bool()
    padded, packed = (logprobs_and_grads(model, ids, mask, pos, R, temperature=temperature, entropy_grad=entropy_grad,
                                         pack=pack) for pack in (False, True))
    assert_same_pass(padded, packed, live)
    assert (packed[0][~live] == 0).all()  # padding response positions: nothing computed


def test_packing_runs_rows_times_the_longest(model):
    ids, mask, pos, R = mixed_batch(model.config.vocab_size)  # lengths 21, 5, 8, 3, 13, 16
    with torch.no_grad():
        padded = positions_run(model, lambda: response_logprobs(model, ids, mask, pos, R))
        packed = positions_run(model, lambda: response_logprobs(model, ids, mask, pos, R, pack=True))
    assert padded == 6 * 21  # every row as wide as the widest prompt plus the widest response
    assert packed == 4 * 21  # 21 | 16+5 | 13+8 | 3


def test_the_fewest_positions_win(model):
    model.eval()
    ids, mask, pos, R = mixed_batch(model.config.vocab_size, prompts=(4, 4, 4), responses=(3, 3, 3))
    # equal lengths: packing saves nothing, the padded forward stays
    assert choose_layout(model, ids, mask, pos, R, None, share_prompts=False, pack=True) is None
    ids[1, :4] = ids[0, :4]
    ids[2, :4] = ids[0, :4]  # one prompt for all three rows: sharing it runs 4 + 3 x 3 < 3 x 7
    groups = choose_layout(model, ids, mask, pos, R, None, share_prompts=True, pack=True)
    assert groups is not None and groups.rows.numel() == 1


def test_only_where_it_is_exact(model):
    assert_text_full_attention_only(can_pack, model)
    pos = torch.zeros(2, 4, dtype=torch.long)
    flex = copy.deepcopy(model)
    flex.config._attn_implementation = "flex_attention"
    assert not can_pack(flex, pos, None)


def rl_batch(vocab, seed=1):
    ids, mask, pos, R = mixed_batch(vocab, prompts=(9, 3, 5, 2, 7, 4, 6, 2), responses=(12, 2, 3, 1, 6, 12, 9, 4),
                                    seed=seed)
    g = torch.Generator().manual_seed(seed)
    response_mask = mask[:, -R:].clone()
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, -R:],
                  "response_mask": response_mask, "advantages": torch.randn(len(ids), 1, generator=g) * response_mask,
                  "old_logprobs": -torch.rand(len(ids), R, generator=g) - 2.0,
                  "ref_logprobs": -torch.rand(len(ids), R, generator=g) - 2.0})


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("kl", [False, True], ids=["no-kl", "kl"])
def test_actor_loss_and_gradients_are_the_same_packed(tiny_model_dir, agg, kl):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = rl_batch(model.config.vocab_size)
    algo = AlgorithmConfig(loss_agg_mode=agg, use_kl_loss=kl, kl_coef=0.1)
    results = {}
    for pack in (False, True):
        m = copy.deepcopy(model)
        actor = Actor(m, ActorConfig(micro_batch_size=4, packing=pack, entropy_coeff=0.01), algo, total_steps=1,
                      max_response_length=12)
        actor.model.train()
        metrics = WeightedMetrics()
        ran = positions_run(m, lambda: actor.accumulate_gradients(batch, temperature=1.0, metrics=metrics))
        results[pack] = metrics.result(), [p.grad for p in m.parameters()], ran
    (m0, g0, ran0), (m1, g1, ran1) = results[False], results[True]
    assert ran1 < ran0  # packing ran fewer positions
    for key in ("actor/pg_loss", "actor/entropy") + (("actor/kl_loss",) if kl else ()):
        assert m0[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    for a, b in zip(g0, g1):
        assert (a - b).norm() <= 1e-5 * a.norm() + 1e-7


def test_critic_values_are_the_same_packed(tiny_model_dir):
    from transformers import AutoModelForTokenClassification

    from fitrl.roles.critic import response_values, value_head

    model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32)
    assert value_head(model) is model.score
    batch = rl_batch(model.config.vocab_size, seed=2)
    live = batch["response_mask"].bool()
    params = list(model.parameters())
    out = {}
    for pack in (False, True):
        values = response_values(model, batch, pack=pack)
        out[pack] = values.detach(), torch.autograd.grad((values * live).sum(), params)
    assert torch.allclose(out[False][0][live], out[True][0][live], atol=2e-5)
    for a, b in zip(out[False][1], out[True][1]):
        assert (a - b).norm() <= 1e-5 * a.norm() + 1e-7


def test_token_budget_counts_packed_size():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([rng.randint(2, 20), rng.randint(50, 200)]) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(50, 600)
        packed = micro_batches_by_tokens(lengths, budget, packed=True)
        padded = micro_batches_by_tokens(lengths, budget)
        assert sorted(i for b in packed for i in b) == list(range(len(lengths)))
        for b in packed:  # within the budget, or a sequence longer than it alone
            assert packed_size([lengths[i] for i in b]) <= budget or len(b) == 1
        for b in padded:
            assert len(b) * max(lengths[i] for i in b) <= budget or len(b) == 1
        assert len(packed) <= len(padded)  # never more forwards than padded
        forced = micro_batches_by_tokens(lengths, budget, min_count=len(packed) + 1, packed=True)
        assert len(forced) == min(len(lengths), len(packed) + 1)


def test_a_vision_language_actor_is_told_packing_does_not_apply(tmp_path, tiny_model_dir):
    from fitrl.config.loader import load_config
    from fitrl.config.schema import adjustments
    from fitrl.models.check import check_model_configs
    from fitrl.models.tiny import make_tiny_model

    vl = make_tiny_model(tmp_path / "vl", arch="qwen2_5_vl")
    cfg = load_config(None, [f"actor.model.path={vl}"])
    check_model_configs(cfg)
    assert any("actor.packing does not apply to a vision-language model" in n for n in adjustments(cfg))
    text = load_config(None, [f"actor.model.path={tiny_model_dir}"])
    check_model_configs(text)
    assert not adjustments(text)
