"""A mixture of experts trains the same whatever carries its batch: 2 FSDP2 ranks compute what one
process computes, and packed or shared-prompt micro-batches what padded ones compute, with the
router's load-balancing loss on, with and without routing replay (the tiny Qwen3-MoE: 2 layers of
4 experts, top-2; fitrl/models/moe_routing.py, fitrl/roles/moe.py, fitrl/ops/token_origin.py).

The batch is sampled by an engine that routes otherwise than the trainer (test_moe_training.py's
``_EngineRoutesOtherwise``), so that replay changes every forward it reaches. The load-balancing
loss is each micro-batch's own (not linear in its tokens), so the ranks' micro-batches are the
one process's: the mini-batch's rows in order (``actor.shuffle_mini_batches`` is off), two by two.
"""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch

from fitrl.config.schema import ActorConfig, AlgorithmConfig, SamplingConfig
from fitrl.data.batch import Batch
from fitrl.models.moe_routing import ROUTED_EXPERTS
from fitrl.roles.actor import Actor, WeightedMetrics
from helpers import FP32_UNIT_ROUNDOFF, assert_same_adam_step, positions_run, toy_config
from test_moe_training import _EngineRoutesOtherwise

LR, ADAM_EPS, AUX = 1e-4, 1e-8, 0.1
# the aux coefficient: large enough that a wrong share of the aux loss on a rank moves grad_norm far
# beyond the 1e-5 it is compared to (measured on this batch: 0.2 against 0.1 moves it by 4e-3)
BATCH = ["data.rollout_batch_size=4", "rollout.n=2", "actor.mini_batch_size=4", "actor.micro_batch_size=2",
         "trainer.device=cpu", f"actor.optim.lr={LR}", "actor.optim.warmup_steps=0",
         f"actor.router_aux_loss_coef={AUX}"]
REPLAY = [False, True]


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from fitrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", arch="qwen3_moe")


# a long prompt then a short one: a micro-batch of 4 packs the short ones' rows into one
TEXTS = ["What is 7 + 5? Answer with a number, and write nothing else: no words, no sign, only the sum.", "Hi",
         "What is 1 + 2?", "What is 0 + 0?"]
ENDS = [6, 2, 6, 1, 2, 3, 6, 4]  # each response's length: the random policy never ends one itself


def _prompts(tok) -> Batch:
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for t in TEXTS]
    return Batch(fields={"prompt_ids": ids})


def _end_early(batch: Batch, ends: list[int]) -> Batch:
    """``batch`` with response b cut to ``ends[b]`` tokens, laid out as the engine lays out a
    response that ended there (right padding; its last token's experts never recorded)."""
    from fitrl.core.padding import position_ids_from_mask

    R = batch["responses"].shape[1]
    P = batch["input_ids"].shape[1] - R
    assert torch.equal(batch["position_ids"], position_ids_from_mask(batch["attention_mask"]))
    keep = torch.arange(R) < torch.tensor(ends)[:, None]  # (B, R)
    pad = batch.meta["pad_id"]
    out = batch.index(slice(None))
    out.update(responses=batch["responses"].masked_fill(~keep, pad), response_mask=batch["response_mask"] * keep,
               rollout_logprobs=batch["rollout_logprobs"] * keep)
    full = torch.cat([torch.ones(len(batch), P, dtype=torch.bool), keep], 1)
    mask = batch["attention_mask"] * full
    out.update(input_ids=batch["input_ids"].masked_fill(~full, pad), attention_mask=mask,
               position_ids=position_ids_from_mask(mask))
    recorded = torch.arange(R) < torch.tensor(ends)[:, None] - 1
    out.update(**{ROUTED_EXPERTS: batch[ROUTED_EXPERTS].masked_fill(~recorded[:, :, None, None], -1)})
    return out


def _config(model_dir, run_dir, replay: bool, *extra):
    return toy_config(model_dir, run_dir, *BATCH, f"actor.routing_replay={str(replay).lower()}", *extra)


@pytest.fixture(scope="module")
def sampled(tiny_moe_dir, tmp_path_factory):
    """8 sequences (4 prompts x 2) sampled with the decode steps routed otherwise, ended early
    (``ENDS``), and advantages."""
    from fitrl.roles.workers import PolicyWorker

    worker = PolicyWorker(_config(tiny_moe_dir, tmp_path_factory.mktemp("run"), False), rank=0, world_size=1)
    torch.manual_seed(0)
    with _EngineRoutesOtherwise(worker.model):
        batch = worker.generate(_prompts(worker.tokenizer), SamplingConfig(n=2, max_tokens=6))
    assert bool(batch["response_mask"].all())  # none ended: ENDS are where they end
    batch = _end_early(batch, ENDS)
    g = torch.Generator().manual_seed(1)
    batch.update(advantages=torch.randn(len(batch), 1, generator=g) * batch["response_mask"])
    return batch


# ------------------------------------------------------------------------------------------------
# 2 FSDP2 ranks against one process


def updates_on_rank(rank, world, port, cfgs, batch, queue):
    """For each config: a policy worker on this rank's half of ``batch``, its old log-probs pass
    then one update. Every rank reports its log-probs and metrics; rank 0 the full weights too."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from fitrl.roles.workers import PolicyWorker

        shard, out = batch.chunk(world)[rank], []
        for cfg in cfgs:
            worker = PolicyWorker(cfg, rank=rank, world_size=world)
            old = worker.compute_logprob(shard)["old_logprobs"]
            metrics = worker.update(shard.index(slice(None)).update(old_logprobs=old))
            state = worker.state_dict()  # (a collective: every rank gathers)
            out.append((old, metrics, state if rank == 0 else None))
            del worker
        queue.put(pickle.dumps((rank, out)))  # pickled bytes: tensors shared through fds would die with this process
        dist.barrier()
    finally:
        dist.destroy_process_group()


def one_process(cfg, batch: Batch):
    """What :func:`updates_on_rank` computes, in this process on the whole batch; and the moe/*
    metrics each half's old log-probs pass alone measures (a rank's own counts)."""
    from fitrl.roles.workers import PolicyWorker

    worker = PolicyWorker(cfg, rank=0, world_size=1)
    halves = []
    for half in batch.chunk(2):
        worker.compute_logprob(half)
        halves.append(worker.actor.moe.metrics())
    before = worker.state_dict()
    old = worker.compute_logprob(batch)["old_logprobs"]
    metrics = worker.update(batch.index(slice(None)).update(old_logprobs=old))
    return old, metrics, worker.state_dict(), before, halves


@pytest.fixture(scope="module")
def two_ranks(tiny_moe_dir, sampled, tmp_path_factory):
    """One spawned pair of ranks for every assertion below: per replay setting, the 2-rank run's
    ranks' (log-probs, metrics, weights) and the one process's."""
    import torch.multiprocessing as mp

    from fitrl.distributed.process_group import free_port

    run = tmp_path_factory.mktemp("run")
    ranked = [_config(tiny_moe_dir, run, r, "trainer.backend=ray", "trainer.devices_per_node=2") for r in REPLAY]
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=updates_on_rank, args=(r, 2, port, ranked, sampled, queue)) for r in range(2)]
    for p in procs:
        p.start()
    reports = dict(pickle.loads(queue.get(timeout=300)) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    ones = [one_process(_config(tiny_moe_dir, run, r), sampled) for r in REPLAY]
    return {r: ([reports[k][i] for k in range(2)], ones[i]) for i, r in enumerate(REPLAY)}


def _token_mean(metrics: list[dict], key: str, tokens: list[float]) -> float:
    """The ranks' token means of ``key`` (each over its own response tokens) as one over all of them."""
    return sum(m[key] * t for m, t in zip(metrics, tokens)) / sum(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("replay", REPLAY, ids=["free", "replay"])
def test_two_fsdp_ranks_train_a_moe_as_one_process(two_ranks, sampled, replay):
    ranks, (old, ref, ref_state, before, halves) = two_ranks[replay]
    mask = sampled["response_mask"].bool()
    tokens = [float(h["response_mask"].sum()) for h in sampled.chunk(2)]
    metrics = [m for _, m, _ in ranks]
    # the old log-probs pass: the one process's; under replay, the engine's
    got = torch.cat([o for o, _, _ in ranks])
    assert torch.allclose(got[mask], old[mask], atol=1e-5)
    engine = (old - sampled["rollout_logprobs"]).abs()[mask].max()
    assert engine < 1e-5 if replay else engine > 1e-2
    # the update: the same losses over all tokens, gradient norm and AdamW step
    for key in ("actor/pg_loss", "actor/router_aux_loss", "actor/entropy"):
        assert _token_mean(metrics, key, tokens) == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    assert ref["actor/router_aux_loss"] > 0
    assert metrics[0]["actor/grad_norm"] == metrics[1]["actor/grad_norm"] == pytest.approx(ref["actor/grad_norm"],
                                                                                         rel=1e-5)
    assert_same_adam_step(ranks[0][2], ref_state, before, lr=LR, eps=ADAM_EPS, grad_norm=ref["actor/grad_norm"],
                          terms=sampled["input_ids"].numel(), unit_roundoff=FP32_UNIT_ROUNDOFF,
                          label=f"moe-2-ranks-replay={replay}")
    # each rank's moe/* are what its half's pass measures alone (counts of its own tokens)
    for m, half in zip(metrics, halves):
        assert {k: v for k, v in m.items() if k.startswith("moe/")} == pytest.approx(half), half
        assert m["moe/routing_mismatch/layer0"] == 1.0  # the engine's bottom-2 (test_moe_training.py)


# ------------------------------------------------------------------------------------------------
# Packed and shared-prompt micro-batches against padded ones


LAYOUTS = {"padded": dict(packing=False, share_prompts=False), "packed": dict(packing=True, share_prompts=False),
           "shared": dict(packing=False, share_prompts=True)}


@pytest.mark.parametrize("replay", REPLAY, ids=["free", "replay"])
def test_packed_and_shared_micro_batches_train_a_moe_as_padded_ones(tiny_moe_dir, sampled, replay):
    """Old log-probs, moe/* counts, losses (policy and load-balancing) and every gradient of one
    mini-batch in two micro-batches of 4, whichever layout each forward runs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    mask = sampled["response_mask"].bool()
    out = {}
    for name, layout in LAYOUTS.items():
        m = copy.deepcopy(model)
        actor = Actor(m, ActorConfig(micro_batch_size=4, routing_replay=replay, router_aux_loss_coef=AUX, **layout),
                      AlgorithmConfig(), total_steps=1, max_response_length=6)
        batch = sampled.index(slice(None))  # (a copy: the fixture is shared)
        ran = positions_run(m, lambda: batch.update(actor.compute_logprob(batch, 1.0)))
        moe = actor.moe.metrics()
        actor.model.train()
        metrics = WeightedMetrics()
        actor.accumulate_gradients(batch, 1.0, metrics)  # (the update's backward, without its step)
        out[name] = batch["old_logprobs"], moe, metrics.result(), [p.grad for p in m.parameters()], ran
    old0, moe0, m0, g0, ran0 = out["padded"]
    engine = (old0 - sampled["rollout_logprobs"]).abs()[mask].max()
    assert engine < 1e-5 if replay else engine > 1e-2  # replay reaches this forward
    assert m0["actor/router_aux_loss"] > 0 and moe0["moe/routing_mismatch/layer0"] == 1.0
    for name in ("packed", "shared"):
        old, moe, m, g, ran = out[name]
        assert ran < ran0, name  # the layout ran: fewer positions than padded
        assert torch.allclose(old[mask], old0[mask], atol=2e-5), name
        assert moe == pytest.approx(moe0), name  # the same tokens counted, each once
        for key in ("actor/pg_loss", "actor/router_aux_loss", "actor/entropy"):
            assert m[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-7), (name, key)
        for a, b in zip(g0, g):  # summed in another order: rounding, relative to the tensor's norm
            assert (a - b).norm() <= 1e-5 * a.norm() + 1e-7, name
    names = [n for n, _ in model.named_parameters()]
    assert g0[names.index("model.layers.0.mlp.gate.weight")].abs().max() > 0  # the router learns


def test_the_sampled_batch_records_the_engines_routing(sampled):
    """(The tests above lean on it: every response token but each response's last has its experts.)"""
    routed, mask = sampled[ROUTED_EXPERTS], sampled["response_mask"].bool()
    assert sampled["response_mask"].sum(-1).tolist() == ENDS
    inner = mask & (torch.arange(mask.shape[1]) < torch.tensor(ENDS)[:, None] - 1)
    assert inner.any() and bool((routed[inner] >= 0).all()) and bool((routed[~inner] == -1).all())
