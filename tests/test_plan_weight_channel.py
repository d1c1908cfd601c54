"""The plan follows ``rollout.weight_transport`` (fitrl/distributed/weight_sync.py): with rollout
workers of their own under Ray on CUDA (``auto`` -> ``collective``) the weights go from rank 0's
device over NCCL a bucket at a time, so ``weight_sync`` holds the bucket on rank 0's device and
each worker's, not rank 0's host copy and the object store's; ``object_store`` keeps today's
host entries, and a CPU plan is unchanged."""

from pathlib import Path

from fitrl.config import load_config
from fitrl.memory import calibration as C
from fitrl.memory.gpu_terms import NCCL
from fitrl.memory.states import WEIGHT_CHANNEL
from fitrl.memory.states import full_weights
from fitrl.models.shape import numel
from fitrl.planner import Hardware, plan_config

ROOT = Path(__file__).resolve().parent.parent
ARITH = str(ROOT / "examples" / "arith.yaml")
QWEN_7B = ROOT / "examples" / "failure_stories" / "models" / "qwen2.5-7b-instruct"
MIB = 2**20


def _plan(*overrides: str, model=QWEN_7B, device: str = "cuda"):
    cfg = load_config(ARITH, [f"actor.model.path={model}", "trainer.backend=ray", "trainer.devices_per_node=8",
                              "actor.micro_batch_size=4", "reward.num_workers=0", "rollout.workers=2",
                              "rollout.weight_bucket_mb=64", *overrides])
    hw = Hardware(nodes=1, gpus_per_node=8, gpu_memory=80 * C.GIB if device == "cuda" else 0,
                  host_memory=2048 * C.GIB, device=device)
    return plan_config(cfg, hw)


def _ws(plan, kind):
    return plan.process(kind).phases["weight_sync"]


def test_collective_holds_the_bucket_on_rank0_and_each_worker_not_the_host_copies():
    """Qwen2.5-7B (15.2 GB in bf16) against 64 MiB buckets: rank 0 holds its bucket, made whole,
    and the embedding (152064 x 3584 bf16 = 1,089,994,752 bytes, larger than a bucket: sent on its
    own from where the gather left it); a worker the embedding and the first bucket after it
    (the one before is still referenced as the next arrives), no more than two buckets' worth
    beyond the largest tensor."""
    plan = _plan()
    bucket, embed = 64 * MIB, 152064 * 3584 * 2
    assert full_weights(plan.shape, "bfloat16") > bucket
    r0 = _ws(plan, "rank0")
    assert r0.gpu == {WEIGHT_CHANNEL: bucket + embed} and r0.host == {}
    assert plan.device("weight_sync")[WEIGHT_CHANNEL] == bucket + embed  # rank 0's bucket is on the device planned
    assert "object store (weights)" not in _ws(plan, "node").host
    assert "weights sent" not in plan.node_host("weight_sync")
    worker = _ws(plan, "rollout")
    assert embed < worker.gpu[WEIGHT_CHANNEL] <= embed + bucket
    # layer 0's q, k, v (and biases) and o fit one bucket, its gate_proj does not: the bucket after the embedding
    first = sum(-(-numel(s) * 2 // 16) * 16 for _, s in plan.shape.layer_tensors(0)[:9])
    assert worker.gpu[WEIGHT_CHANNEL] == embed + first
    assert worker.host["weights in the mailbox"] == full_weights(plan.shape, "bfloat16")
    for ph in ("weight_sync", "update"):  # the channel's communicator, in every phase: rank 0's and each worker's
        assert plan.process("trainer").phases[ph].gpu[NCCL] == 2 * C.NCCL_COMMUNICATOR_BYTES
        assert plan.process("rollout").phases[ph].gpu[NCCL] == C.NCCL_COMMUNICATOR_BYTES
    assert WEIGHT_CHANNEL not in plan.device("update") and WEIGHT_CHANNEL not in _ws(plan, "trainer").gpu


def test_weights_smaller_than_a_bucket_make_one_payload():
    """A model whose weights all fit one 64 MiB bucket: rank 0 still makes the whole bucket; the
    worker receives one payload, the packed weights (each tensor at a 16-byte offset)."""
    plan = _plan(model=ROOT / ".cache" / "models" / "tiny-qwen2")
    packed = sum(-(-numel(s) * 2 // 16) * 16 for _, s in plan.shape.tensors())
    assert packed < 64 * MIB
    assert _ws(plan, "rank0").gpu == {WEIGHT_CHANNEL: 64 * MIB}
    assert _ws(plan, "rollout").gpu[WEIGHT_CHANNEL] == packed
    assert "object store (weights)" not in _ws(plan, "node").host


def test_object_store_transport_keeps_the_host_copies():
    plan = _plan("rollout.weight_transport=object_store")
    weights = full_weights(plan.shape, "bfloat16")
    assert _ws(plan, "rank0").host == {"weights sent": weights} and _ws(plan, "rank0").gpu == {}
    assert _ws(plan, "node").host["object store (weights)"] == weights
    assert WEIGHT_CHANNEL not in _ws(plan, "rollout").gpu and NCCL not in _ws(plan, "rollout").gpu
    assert _ws(plan, "trainer").gpu[NCCL] == C.NCCL_COMMUNICATOR_BYTES


def test_cpu_plan_is_unchanged():
    """On CPU ``auto`` is ``object_store``: the host copies, no bucket, no NCCL."""
    plan = _plan(device="cpu", model=ROOT / ".cache" / "models" / "tiny-qwen2")
    weights = full_weights(plan.shape, plan.cfg.actor.model.dtype if not plan.cfg.actor.fsdp.mixed_precision
                           else "bfloat16")
    assert _ws(plan, "rank0").host == {"weights sent": weights}
    assert _ws(plan, "node").host["object store (weights)"] == weights
    assert all(WEIGHT_CHANNEL not in p.phases[ph].gpu and WEIGHT_CHANNEL not in p.phases[ph].host
               for p in plan.processes for ph in p.phases)
