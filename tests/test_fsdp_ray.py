"""Ray backend + FSDP2 on CPU (gloo): 2 ranks compute what 1 process computes.

Marked slow (each group starts 2 worker processes); run in CI.
"""

import pytest
import torch

from fitrl.trainer.verdict import judge_rise
from fitrl.data.batch import Batch
from fitrl.roles.workers import PolicyWorker
from fitrl.config.schema import SamplingConfig
from fitrl.workers.group import RoleHandle
from helpers import FP32_UNIT_ROUNDOFF, assert_same_adam_step, toy_config

pytestmark = pytest.mark.slow

BATCH = ["data.rollout_batch_size=4", "rollout.n=2", "actor.mini_batch_size=4", "actor.micro_batch_size=2",
         "trainer.device=cpu", "actor.optim.lr=1e-4", "actor.optim.warmup_steps=0"]
LR, ADAM_EPS = 1e-4, 1e-8
BF16_UNIT_ROUNDOFF = 2.0 ** -8


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """One in-process update on a fixed batch: the numbers the sharded run must reproduce."""
    cfg = toy_config(tiny_model_dir, tmp_path_factory.mktemp("run"), *BATCH)
    worker = PolicyWorker(cfg, rank=0, world_size=1)
    tok = worker.tokenizer
    texts = ["What is 1 + 2?", "What is 7 + 5? Answer with a number.", "Hi", "What is 0 + 0?"]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"] for t in texts]
    torch.manual_seed(0)
    batch = worker.generate(Batch(fields={"prompt_ids": ids}), SamplingConfig(n=2, max_tokens=6))
    batch.update(worker.compute_logprob(batch))
    g = torch.Generator().manual_seed(1)
    batch.update(advantages=torch.randn(len(batch), 1, generator=g) * batch["response_mask"])
    before = worker.state_dict()
    metrics = worker.update(batch)
    return batch, metrics, worker.state_dict(), before


def assert_same_step(state: dict, reference, variant: str, unit_roundoff: float = FP32_UNIT_ROUNDOFF) -> None:
    """The weights after the sharded step are the reference's within what rounding allows for one
    AdamW step (tests/helpers.py, ``adam_step_tolerance``): the gradients sum the batch's tokens in
    another order (two ranks, other micro-batches), and Adam's ``g / (|g| + eps)`` turns that rounding
    into up to a whole step where a gradient nearly cancels, and into almost nothing elsewhere."""
    batch, metrics, ref_state, before = reference
    assert_same_adam_step(state, ref_state, before, lr=LR, eps=ADAM_EPS, grad_norm=metrics["actor/grad_norm"],
                          terms=batch["input_ids"].numel(), unit_roundoff=unit_roundoff, label=variant)


@pytest.mark.parametrize("variant,overrides,roundoff", [
    ("rank0-init", [], FP32_UNIT_ROUNDOFF),
    ("every-rank-init", ["actor.fsdp.init=every_rank"], FP32_UNIT_ROUNDOFF),
    ("cpu-offload", ["actor.fsdp.cpu_offload=true", "actor.fsdp.offload_params=true",
                     "actor.fsdp.offload_optimizer=true"], FP32_UNIT_ROUNDOFF),
    ("mixed-precision", ["actor.fsdp.mixed_precision=true"], BF16_UNIT_ROUNDOFF),  # bf16 compute
    # ranks agree on the micro-batch count. The budget splits the batch unlike the reference's
    # micro_batch_size, so sums run in another order. A wrong count would scale the loss, which
    # grad_norm (rel 1e-5) catches; Adam's step itself is scale-free.
    ("token-budget", ["actor.micro_batch_token_budget=60"], FP32_UNIT_ROUNDOFF),
    # Ulysses: both ranks get the whole batch, each runs half of every packed row's positions
    ("ulysses-2", ["actor.ulysses_size=2"], FP32_UNIT_ROUNDOFF),
])
def test_two_fsdp_ranks_match_one_process(ray_cluster, tiny_model_dir, tmp_path, reference, variant, overrides,
                                          roundoff):
    from fitrl.workers.ray_group import RayWorkerGroup

    batch, ref_metrics, _, _ = reference
    cfg = toy_config(tiny_model_dir, tmp_path, *BATCH, "trainer.backend=ray", "trainer.devices_per_node=2",
                     *overrides)
    with RayWorkerGroup(PolicyWorker, cfg, world_size=2, name="policy") as group:
        policy = RoleHandle(group, sequence_parallel=cfg.actor.ulysses_size)
        metrics = policy.update(batch)  # each rank gets 4 of the 8 sequences (Ulysses: all 8)
        state = policy.state_dict()
    rel = 1e-2 if variant == "mixed-precision" else 1e-5
    assert metrics["actor/grad_norm"] == pytest.approx(ref_metrics["actor/grad_norm"], rel=rel)
    assert_same_step(state, reference, variant, roundoff)


def test_ranks_agree_on_sharing_a_prompt(ray_cluster, tiny_model_dir, tmp_path, reference):
    """Rank 0's micro-batches hold a prompt twice (a shared-prompt forward: the model runs twice),
    rank 1's hold distinct prompts (one packed or padded forward). Under FSDP2 each run of a layer
    all-gathers it, so ranks choosing differently would pair mismatched collectives: a hang, or
    shards silently exchanged between layers of one shape. They share all together or not at
    all, and the step is the one process's."""
    from fitrl.workers.ray_group import RayWorkerGroup

    batch, ref_metrics, _, _ = reference  # rows 2i and 2i + 1: prompt i's two samples
    shards = [batch.index([0, 1, 2, 3]), batch.index([4, 6, 5, 7])]  # rank 1's pairs: prompts 2, 3
    cfg = toy_config(tiny_model_dir, tmp_path, *BATCH, "trainer.backend=ray", "trainer.devices_per_node=2")
    # (a regression pairs mismatched collectives: their timeout ends it instead of a hang)
    with RayWorkerGroup(PolicyWorker, cfg, world_size=2, name="policy", dist_timeout_s=60) as group:
        metrics = group.call_all("update", [(shard,) for shard in shards], {})[0]  # (the shards as given)
        state = RoleHandle(group).state_dict()
    assert metrics["actor/grad_norm"] == pytest.approx(ref_metrics["actor/grad_norm"], rel=1e-5)
    assert_same_step(state, reference, "mixed-layouts")


def test_toy_task_trains_with_two_ray_workers(ray_cluster, tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    history = train(toy_config(tiny_model_dir, tmp_path, "trainer.backend=ray", "trainer.devices_per_node=2",
                               "actor.micro_batch_size=16", "trainer.max_steps=40", "trainer.val_before_train=false",
                               "data.val_files=[]", "algorithm.use_kl_loss=true"))
    verdict = judge_rise([h["reward/mean"] for h in history])
    assert verdict["rose"], verdict["message"]
    assert all("time/ref" in h for h in history)  # the reference group ran, colocated with the policy


def test_ulysses_run_trains_with_a_reference(ray_cluster, tiny_model_dir, tmp_path):
    """actor.ulysses_size=2 on 2 ranks: rollout split over both, the reference's and the policy's
    passes and the update split by positions; three steps, every loss finite."""
    from fitrl.trainer.run import train

    history = train(toy_config(tiny_model_dir, tmp_path, "trainer.backend=ray", "trainer.devices_per_node=2",
                               "actor.ulysses_size=2", "trainer.max_steps=3", "trainer.val_before_train=false",
                               "data.val_files=[]", "algorithm.use_kl_loss=true"))
    assert len(history) == 3
    for h in history:
        assert all(torch.isfinite(torch.tensor(h[k])) for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"))
    assert history[-1]["actor/kl_loss"] > 0  # the policy moved away from the reference


def test_hybrid_shard_two_nodes_of_two_ranks(tiny_model_dir, tmp_path, reference):
    """Hybrid sharding: a (replicate=2, shard=2) mesh over 4 ranks, as 2 nodes x 2 devices would
    get; gradients are summed over both mesh dimensions."""
    import pickle

    import torch.multiprocessing as mp

    from fitrl.distributed.process_group import free_port
    from fsdp_spawn import update_on_rank

    batch, ref_metrics, _, _ = reference
    cfg = toy_config(tiny_model_dir, tmp_path, *BATCH, "trainer.backend=ray", "trainer.nnodes=2",
                     "trainer.devices_per_node=2", "actor.fsdp.strategy=hybrid")
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=update_on_rank, args=(r, 4, port, cfg, batch, queue)) for r in range(4)]
    for p in procs:
        p.start()
    metrics, state = pickle.loads(queue.get(timeout=300))
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    assert metrics["actor/grad_norm"] == pytest.approx(ref_metrics["actor/grad_norm"], rel=1e-5)
    assert_same_step(state, reference, "hybrid")
