"""Training a mixture of experts (Qwen3-MoE, the tiny one: 2 layers of 4 experts, top-2): each
sampled token's experts recorded by the HF engine, the router's load-balancing loss in the update,
routing replay in the training forwards, and the expert-load and routing-mismatch metrics
(fitrl/models/moe_routing.py, fitrl/roles/moe.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from fitrl.config.schema import ActorConfig, AlgorithmConfig, ConfigError, FSDPConfig, ModelConfig, SamplingConfig
from fitrl.data.batch import Batch
from fitrl.models.moe_routing import ROUTED_EXPERTS, Routers, RoutingCounts, replay_scores
from fitrl.roles.actor import Actor, WeightedMetrics

LAYOUTS = [dict(packing=False, share_prompts=False), dict(packing=True, share_prompts=False),
           dict(packing=False, share_prompts=True)]
LAYOUT_IDS = ["padded", "packed", "shared"]


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from fitrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", arch="qwen3_moe")


@pytest.fixture(scope="module")
def policy(tiny_moe_dir):
    from fitrl.models.loading import build_model, load_tokenizer

    cfg = ModelConfig(path=str(tiny_moe_dir))
    return build_model("causal_lm", cfg, FSDPConfig(), torch.device("cpu")), load_tokenizer(cfg)


def _prompts(tok) -> Batch:
    texts = ["What is 1 + 2?", "What is 7 + 5? Answer with a number.", "Hi", "What is 0 + 0?"]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for t in texts]
    return Batch(fields={"prompt_ids": ids})


def _rollout(model, tok, decode="generate", seed=0, greedy=False, max_tokens=6):
    from fitrl.rollout.hf import HFRollout

    torch.manual_seed(seed)
    sampling = SamplingConfig(n=2, max_tokens=max_tokens, temperature=0.0 if greedy else 1.0)
    return HFRollout(model, tok, decode=decode).generate(_prompts(tok), sampling)


def _actor(model, **cfg) -> Actor:
    return Actor(model, ActorConfig(**cfg), AlgorithmConfig(), total_steps=1, max_response_length=6)


class _EngineRoutesOtherwise:
    """An engine whose router picks other experts on decode steps than the trainer's would (its
    bottom-k instead of its top-k; weights recomputed as the router computes them): a case built to
    disagree. Registered before the engine's recorder, so that the recorder sees its choice."""

    def __init__(self, model):
        self.routers = Routers.of(model)

    def __enter__(self):
        def hook(module, _inputs, output):
            logits, scores, indices = output
            if indices.shape[0] > 8:  # a prefill (every prompt token): left alone
                return None
            other = logits.topk(module.top_k, dim=-1, largest=False).indices
            return logits, replay_scores(logits, other, module.norm_topk_prob, scores.dtype), other
        self.handles = [m.register_forward_hook(hook) for m in self.routers.modules]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


# ------------------------------------------------------------------------------------------------
# What the engine records


@pytest.mark.parametrize("decode", ["generate", "loop"])
def test_the_engine_records_each_sampled_tokens_experts(policy, decode):
    model, tok = policy
    out = _rollout(model, tok, decode=decode)
    routed, mask = out[ROUTED_EXPERTS], out["response_mask"].bool()
    B, R = out["responses"].shape
    assert routed.dtype == torch.int16 and tuple(routed.shape) == (B, R, 2, 2)  # 2 sparse layers, top-2
    assert bool((routed[~mask] == -1).all())  # after EOS: nothing
    recorded = (routed >= 0).all(-1).all(-1)  # (B, R)
    last = mask.sum(-1) - 1  # each response's last token is never fed back in: unrecorded
    assert not recorded[torch.arange(B), last].any()
    assert bool(recorded[mask & (torch.arange(R) < last[:, None])].all())
    assert bool((routed[recorded].long().sort(-1).values.diff(dim=-1) > 0).all())  # two distinct experts of 4


def test_both_decode_paths_record_the_same_experts_greedily(policy):
    model, tok = policy
    a, b = _rollout(model, tok, "generate", greedy=True), _rollout(model, tok, "loop", greedy=True)
    assert torch.equal(a["responses"], b["responses"])
    both = (a[ROUTED_EXPERTS] >= 0) & (b[ROUTED_EXPERTS] >= 0)
    assert both.any() and torch.equal(a[ROUTED_EXPERTS][both], b[ROUTED_EXPERTS][both])


def test_joined_rollouts_pad_the_recorded_experts_with_none(policy):
    from fitrl.rollout.layout import concat_rollouts

    model, tok = policy
    short, long = _rollout(model, tok, max_tokens=2), _rollout(model, tok, max_tokens=6, seed=1)
    joined = concat_rollouts([short, long], pad_id=tok.pad_token_id)
    r = short["responses"].shape[1]
    assert joined[ROUTED_EXPERTS].shape[1] == joined["responses"].shape[1]
    assert torch.equal(joined[ROUTED_EXPERTS][:8, :r], short[ROUTED_EXPERTS])
    assert bool((joined[ROUTED_EXPERTS][:8, r:] == -1).all())


# ------------------------------------------------------------------------------------------------
# Routing mismatch and replay


@pytest.mark.parametrize("replay", [False, True], ids=["free", "replay"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_the_same_weights_in_fp32_route_alike_and_the_mismatch_is_0(policy, layout, replay):
    """The engine's log-probs of the sampled tokens are the trainer's, and the router's own choice
    the engine's, whether or not the forward replays it."""
    model, tok = policy
    out = _rollout(model, tok)
    actor = _actor(model, routing_replay=replay, **layout)
    old = actor.compute_logprob(out, 1.0)["old_logprobs"]
    mask = out["response_mask"].bool()
    assert torch.allclose(old[mask], out["rollout_logprobs"][mask], atol=1e-5)
    m = actor.moe.metrics()
    assert m["moe/routing_mismatch"] == 0 and m["moe/routing_mismatch/layer0"] == m["moe/routing_mismatch/layer1"] == 0
    assert 0 < m["moe/expert_load_entropy"] <= 1 and 0.25 <= m["moe/max_expert_share"] <= 1
    assert actor.moe.metrics() == {}  # one step's worth: counted afresh


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_replay_makes_the_trainers_logprobs_the_engines_where_routing_disagrees(policy, layout):
    model, tok = policy
    with _EngineRoutesOtherwise(model):
        out = _rollout(model, tok)
    mask = out["response_mask"].bool()
    off, on = _actor(model, **layout), _actor(model, routing_replay=True, **layout)
    free = off.compute_logprob(out, 1.0)["old_logprobs"]
    replayed = on.compute_logprob(out, 1.0)["old_logprobs"]
    # the tokens after a response's first: those whose context holds a token routed otherwise
    later = mask & (torch.arange(mask.shape[1]) > 0)
    assert (free - out["rollout_logprobs"]).abs()[later].max() > 1e-2
    assert torch.allclose(replayed[mask], out["rollout_logprobs"][mask], atol=1e-5)
    # measured either way: the router's own choice against the engine's. Layer 0 routes the same
    # hidden states in both (embeddings, attention over embeddings): bottom-2 of 4 is never top-2.
    # Layer 1 routes on what layer 0 made of them: the engine's again only under replay.
    m_off, m_on = off.moe.metrics(), on.moe.metrics()
    assert m_off["moe/routing_mismatch/layer0"] == m_on["moe/routing_mismatch/layer0"] == 1.0
    assert m_on["moe/routing_mismatch"] == 1.0 and m_off["moe/routing_mismatch"] > 0.5


def test_replay_goes_through_the_router_peft_wraps(policy):
    """LoRA on every linear layer (PEFT wraps the router, ``mlp.gate.base_layer``, and the
    experts), its adapters made nonzero so that the router's weights are not the base's."""
    import warnings

    from fitrl.config.roles import LoRAConfig
    from fitrl.models.params import LoRA

    model, tok = copy.deepcopy(policy[0]), policy[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        LoRA(LoRAConfig(rank=4, target_modules=["all-linear"])).apply(model)
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5, generator=g)
    assert [type(m).__name__ for m in Routers.of(model).modules] == ["Qwen3MoeTopKRouter"] * 2
    with _EngineRoutesOtherwise(model):
        out = _rollout(model, tok)
    mask = out["response_mask"].bool()
    replayed = _actor(model, routing_replay=True).compute_logprob(out, 1.0)["old_logprobs"]
    assert torch.allclose(replayed[mask], out["rollout_logprobs"][mask], atol=1e-5)


def test_replay_reaches_the_reference_and_the_updates_forward_with_checkpointing(policy):
    from fitrl.ops.logprob import response_logprobs
    from fitrl.roles.moe import replaying

    model, tok = policy
    with _EngineRoutesOtherwise(model):
        out = _rollout(model, tok)
    mask = out["response_mask"].bool()
    ref = copy.deepcopy(model).eval()  # the reference worker's forward (fitrl/roles/workers.py)
    with replaying(Routers.of(ref), out):
        lp, _ = response_logprobs(ref, out["input_ids"], out["attention_mask"], out["position_ids"],
                                  out["responses"].shape[1], share_prompts=True, pack=True)
    assert torch.allclose(lp[mask], out["rollout_logprobs"][mask], atol=1e-5)

    # the update's own forward as the old log-probs (one optimizer step), its layers recomputed in
    # backward: the engine's log-probs, and the experts used in backward the forward's
    g = torch.Generator().manual_seed(1)
    out.update(advantages=torch.randn(8, 1, generator=g) * mask)
    diffs = {}
    for replay in (False, True):
        m = copy.deepcopy(model)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        actor = _actor(m, routing_replay=replay, micro_batch_size=4)
        metrics = actor.update(out, sequences_per_mini_batch=8, temperature=1.0, old_logprobs_from="update")
        assert math.isfinite(metrics["actor/grad_norm"]) and metrics["moe/routing_mismatch/layer0"] == 1.0
        diffs[replay] = metrics["rollout/logprob_diff_max"]
    assert diffs[True] < 1e-5 < 1e-2 < diffs[False]


# ------------------------------------------------------------------------------------------------
# The load-balancing loss


def test_the_aux_loss_is_transformers_over_every_layout(policy):
    """The hooked routers' loss equals the model's own ``output_router_logits`` forward's (real
    tokens by the attention mask), whichever layout the forward runs: a shared prompt's tokens
    count once per row that shares them."""
    from fitrl.models.moe_routing import RouterPass
    from fitrl.ops.logprob import response_logprobs

    model, tok = policy
    out = _rollout(model, tok)
    own = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"],
                output_router_logits=True).aux_loss
    for layout in LAYOUTS:
        with RouterPass(Routers.of(model), out["attention_mask"], out["response_mask"], None, capture=True) as p:
            response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"],
                              out["responses"].shape[1], share_prompts=layout["share_prompts"], pack=layout["packing"])
            assert torch.allclose(p.aux_loss(), own, rtol=1e-5), layout


def test_the_update_adds_the_model_coefficient_times_the_aux_loss(policy):
    model, tok = policy
    out = _rollout(model, tok)
    mask = out["response_mask"].float()
    out.update(advantages=torch.zeros(8, 1) * mask)  # no policy gradient: the aux loss alone moves the router

    def router_grad(**cfg):
        m = copy.deepcopy(model)
        actor = _actor(m, **cfg)
        out.update(actor.compute_logprob(out, 1.0))
        metrics = WeightedMetrics()
        actor.model.train()
        actor.accumulate_gradients(out, 1.0, metrics)  # (the update's backward, without its step)
        return metrics.result(), Routers.of(m).modules[0].weight.grad.clone()

    assert model.config.router_aux_loss_coef == 0.001  # Qwen3-MoE's default, the tiny model's
    m_default, g_default = router_grad()
    m_ten, g_ten = router_grad(router_aux_loss_coef=0.01)
    m_off, g_off = router_grad(router_aux_loss_coef=0.0)
    assert math.isfinite(m_default["actor/router_aux_loss"]) and m_default["actor/router_aux_loss"] > 0
    assert m_default["actor/router_aux_loss"] == pytest.approx(m_ten["actor/router_aux_loss"])
    assert torch.allclose(g_ten, 10 * g_default, rtol=1e-4, atol=1e-9) and g_default.abs().max() > 0
    assert g_off.abs().max() == 0


# ------------------------------------------------------------------------------------------------
# The metrics on hand-written counts


def test_routing_metrics_from_counts():
    c = RoutingCounts(layers=(0, 3), experts=4, compared=torch.tensor([10, 5]), mismatched=torch.tensor([1, 0]),
                      load=torch.tensor([[5, 5, 5, 5], [20, 0, 0, 0]]))
    m = c.metrics()
    assert m["moe/expert_load_entropy"] == pytest.approx((1.0 + 0.0) / 2)  # balanced; one expert takes all
    assert m["moe/max_expert_share"] == 1.0
    assert m["moe/routing_mismatch"] == pytest.approx(1 / 15)
    assert (m["moe/routing_mismatch/layer0"], m["moe/routing_mismatch/layer3"]) == (0.1, 0.0)
    assert RoutingCounts(layers=(0,), experts=4).metrics() == {}


def test_replayed_weights_are_the_routers_own_for_its_own_choice():
    logits = torch.randn(6, 4)
    probs = torch.softmax(logits, -1)
    top, idx = torch.topk(probs, 2, dim=-1)
    assert torch.equal(replay_scores(logits, idx, True, torch.float32), top / top.sum(-1, keepdim=True))
    assert torch.equal(replay_scores(logits, idx, False, torch.float32), top)


# ------------------------------------------------------------------------------------------------
# A short run, and bad input


def test_a_two_step_moe_run_logs_the_aux_loss_and_routing_metrics(tiny_moe_dir, tmp_path):
    from helpers import read_metrics, toy_config

    from fitrl.trainer.run import train

    run = tmp_path / "run"
    train(toy_config(tiny_moe_dir, run, "trainer.max_steps=2", "trainer.val_before_train=false",
                     "data.rollout_batch_size=4", "rollout.n=2", "actor.mini_batch_size=4",
                     "actor.micro_batch_size=4", "actor.routing_replay=true", "trainer.val_freq=0"))
    steps = [r for r in read_metrics(run) if "event" not in r and "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["actor/router_aux_loss"]) and r["actor/router_aux_loss"] > 0
        assert r["moe/routing_mismatch"] == 0.0  # the HF engine, the same weights in fp32
        assert {"moe/routing_mismatch/layer0", "moe/routing_mismatch/layer1"} <= set(r)
        assert 0 < r["moe/expert_load_entropy"] <= 1 and 0.25 <= r["moe/max_expert_share"] <= 1
        assert r["rollout/logprob_diff_max"] < 1e-5


def test_replay_is_refused_where_nothing_records_or_routes(tiny_model_dir, tmp_path):
    from helpers import toy_config

    import fitrl.rollout  # noqa: F401  (registers the engines)
    from fitrl.models.loading import build_model

    with pytest.raises(ConfigError, match=r"rollout.engine=vllm does not; use rollout.engine=hf"):
        toy_config(tiny_model_dir, tmp_path, "actor.routing_replay=true", "rollout.engine=vllm")
    with pytest.raises(ConfigError, match=r"actor.router_aux_loss_coef must be >= 0"):
        ActorConfig(router_aux_loss_coef=-1.0)
    dense = build_model("causal_lm", ModelConfig(path=str(tiny_model_dir)), FSDPConfig(), torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"the policy \(qwen2\) routes nothing"):
        _actor(dense, routing_replay=True)
    assert _actor(dense).moe is None


def test_the_report_draws_expert_load_and_routing_mismatch():
    from fitrl.report.keys import training_charts

    keys = ["actor/entropy", "actor/router_aux_loss", "moe/expert_load_entropy", "moe/max_expert_share",
            "moe/routing_mismatch", "moe/routing_mismatch/layer0"]
    charts = {c.title: c for c in training_charts(keys, [])}
    assert charts["Entropy"].keys == ["actor/entropy"]
    assert charts["Expert load"].keys == ["moe/expert_load_entropy", "moe/max_expert_share"]
    assert charts["Expert load"].secondary == ["actor/router_aux_loss"]
    assert charts["Routing mismatch (engine vs trainer)"].keys == ["moe/routing_mismatch", "moe/routing_mismatch/layer0"]
