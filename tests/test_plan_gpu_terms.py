"""What a GPU run holds that the plan did not count, as named entries marked assumed
(fitrl/memory/gpu_terms.py): NCCL's buffers per communicator, a sleeping vLLM engine's residue
(loading included), AdamW's moments in power-of-two pinned host blocks under
``offload_optimizer``, the Ray driver's CUDA context (0). Each appears by name with its
hand-computed value on a ``Hardware(device="cuda")`` plan; the same config on CPU has none.
Plans are made on any machine: nothing here needs a GPU."""

from pathlib import Path

import pytest
from rich.console import Console

from fitrl.config import load_config
from fitrl.memory import calibration as C
from fitrl.memory.gpu_terms import (DRIVER_CONTEXT, ENGINE_ASLEEP, NCCL, PINNED_CACHE, PINNED_ROUNDING,
                                    is_assumed)
from fitrl.planner import Hardware, plan_config
from fitrl.planner.report import print_plan

ROOT = Path(__file__).resolve().parent.parent
ARITH = str(ROOT / "examples" / "arith.yaml")
QWEN_7B = ROOT / "examples" / "failure_stories" / "models" / "qwen2.5-7b-instruct"
H100 = dict(gpu_memory=80 * C.GIB, host_memory=2048 * C.GIB)
MIB = 2**20
ASLEEP_PHASES = ("load", "weight_sync", "old_logprob", "update", "checkpoint_save")


def _cfg(*overrides: str, backend: str = "ray", nodes: int = 1, gpus: int = 8):
    return load_config(ARITH, [f"actor.model.path={QWEN_7B}", f"trainer.backend={backend}", f"trainer.nnodes={nodes}",
                               f"trainer.devices_per_node={gpus}", "actor.micro_batch_size=4", "reward.num_workers=0",
                               *overrides])


def _plan(*overrides: str, backend: str = "ray", nodes: int = 1, gpus: int = 8):
    """Qwen2.5-7B on nodes of 8 x 80 GiB (the HF engine unless overridden)."""
    cfg = _cfg(*overrides, backend=backend, nodes=nodes, gpus=gpus)
    ranks = gpus if backend == "ray" else 1
    return plan_config(cfg, Hardware(nodes=nodes if backend == "ray" else 1, gpus_per_node=ranks, **H100))


def _assumed(plan) -> set[str]:
    """Every assumed entry of every process and phase, device or host."""
    return {k for p in plan.processes for u in p.phases.values() for k in (*u.gpu, *u.host) if is_assumed(k)}


# ------------------------------------------------------------------------------ pinned host blocks

def _qwen_7b_moment_blocks_per_rank() -> int:
    """One AdamW moment of Qwen2.5-7B sharded over 8 ranks, each shard in a pinned block of the
    next power of two, by hand (fp32: 4 bytes an element; dim 0 / 8 rows per rank)."""
    embed = 152064 // 8 * 3584 * 4     # 272,498,688 B -> 512 MiB (embed_tokens and lm_head)
    assert embed == 272_498_688
    q = 3584 // 8 * 3584 * 4           # 6,422,528 -> 8 MiB (q_proj, o_proj)
    kv = 512 // 8 * 3584 * 4           # 917,504 -> 1 MiB (k_proj, v_proj)
    mlp = 18944 // 8 * 3584 * 4        # 33,947,648 -> 64 MiB (gate, up; down_proj: 448 x 18944, the same)
    assert (q, kv, mlp) == (6_422_528, 917_504, 33_947_648)
    vector = 3584 // 8 * 4             # 1,792 -> 2,048 (the norms, q_proj's bias)
    kv_bias = 512 // 8 * 4             # 256 -> 256
    layer = 2 * 8 * MIB + 2 * 1 * MIB + 3 * 64 * MIB + 3 * 2048 + 2 * kv_bias  # 2 norms + q bias
    return 2 * 512 * MIB + 28 * layer + 2048  # + the final norm


def test_offloaded_moments_are_held_in_power_of_two_pinned_blocks_all_run():
    """A 7B on 8 ranks with offload_optimizer: the moments' pinned blocks hold 13.5 GiB per rank,
    116 GB a node (the issue's measured figure), where their bytes are 61 GB: the rounding is a
    term of its own beside the offloaded optimizer, and in the update, with the moments on the
    device, the cached blocks stay held."""
    plan = _plan("actor.fsdp.offload_optimizer=true")
    steps = 4 * 339  # AdamW's fp32 step per tensor (339 tensors), as in the optimizer's entry
    blocks = 2 * _qwen_7b_moment_blocks_per_rank() + steps
    # a moment: 2 x 512 MiB + 28 x (210 MiB + 6,656 B) + 2,048 B = 7,239,557,120 B
    assert blocks == 2 * 7_239_557_120 + 1_356 == 14_479_115_596  # 13.5 GiB per rank
    for ph in ("rollout", "old_logprob", "checkpoint_save"):
        host = plan.node_host(ph)
        assert 60e9 < host["offloaded optimizer"] < 62e9  # what the plan counted before
        assert host["offloaded optimizer"] + host[PINNED_ROUNDING.format("")] == 8 * blocks
        assert PINNED_CACHE.format("") not in host
    update = plan.node_host("update")
    assert update[PINNED_CACHE.format("")] == 8 * blocks and 115e9 < 8 * blocks < 117e9
    assert "offloaded optimizer" not in update and "optimizer" in plan.device("update")
    assert PINNED_ROUNDING.format("") not in plan.node_host("load")  # no AdamW state before the first step


def test_no_pinned_term_without_optimizer_offload_or_under_fsdp_cpu_offload():
    """Without offload_optimizer the moments never leave the device; under FSDP2's cpu_offload
    AdamW makes them on the host with zeros_like (pageable) and they never move."""
    assert not any(k.startswith("pinned") for k in _assumed(_plan()))
    plan = _plan("actor.fsdp.cpu_offload=true", "actor.fsdp.offload_optimizer=true")
    assert not any(k.startswith("pinned") and k.endswith("optimizer, assumed)") for k in _assumed(plan))


def test_a_critic_s_offloaded_moments_are_named_as_its_own():
    plan = _plan("algorithm.adv_estimator=gae", "critic.micro_batch_size=4", "critic.fsdp.offload_optimizer=true")
    assert PINNED_ROUNDING.format("critic ") in plan.node_host("rollout")
    assert PINNED_CACHE.format("critic ") in plan.node_host("update")


# ------------------------------------------------------------------------------ NCCL

def test_nccl_buffers_per_communicator_a_rank_holds():
    """16 channels x 3 peers x 10 MiB = 480 MiB per communicator, on every Ray rank's device in
    every phase: the default group's alone with a 1-D mesh (FSDP2 reuses it); a hybrid mesh over
    2 nodes adds its two, Ulysses' sequence group one; a reference rank holds its own default
    group. One process (world 1) holds none."""
    assert C.NCCL_COMMUNICATOR_BYTES == 16 * 3 * 10 * MIB == 503_316_480
    plan = _plan("algorithm.use_kl_loss=true")
    for ph in plan.phases:
        assert plan.process("trainer").phases[ph].gpu[NCCL] == C.NCCL_COMMUNICATOR_BYTES
        assert plan.process("ref").phases[ph].gpu[NCCL] == C.NCCL_COMMUNICATOR_BYTES
        assert plan.device(ph)[NCCL] == 2 * C.NCCL_COMMUNICATOR_BYTES
    hybrid = _plan("actor.fsdp.strategy=hybrid", "data.rollout_batch_size=16", "actor.mini_batch_size=16", nodes=2)
    assert hybrid.device("update")[NCCL] == 3 * C.NCCL_COMMUNICATOR_BYTES
    ulysses = _plan("actor.ulysses_size=2")
    assert ulysses.device("update")[NCCL] == 2 * C.NCCL_COMMUNICATOR_BYTES
    assert NCCL not in _assumed(_plan(backend="inprocess"))


def test_nccl_buffers_are_outside_the_caching_allocator_s_reserve():
    """The reserve factor applies to what PyTorch's allocator holds, not to NCCL's own buffers:
    the update's reserve is unchanged by them."""
    u = _plan().process("trainer").phases["update"].gpu
    held = sum(v for k, v in u.items() if k not in ("cuda context", NCCL, "allocator reserve"))
    assert u["allocator reserve"] == int((C.GPU_RESERVED_FACTORS["update"] - 1) * held)


# ------------------------------------------------------------------------------ the sleeping engine

def _vllm(*overrides: str):
    return _plan("rollout.engine=vllm", "rollout.gpu_memory_utilization=0.6", "rollout.sleep_level=1", *overrides)


def test_a_sleeping_engine_keeps_its_residue_from_loading_on():
    """The engine sleeps right after it is built (the trainer's roles share its devices), so
    loading holds its residue only (1 GiB: CUDA graphs and buffers), as does every phase it sleeps
    through; awake, the residue is inside its budget (gpu_memory_utilization)."""
    engine = _vllm().process("engine").phases
    for ph in ASLEEP_PHASES:
        assert engine[ph].gpu[ENGINE_ASLEEP] == C.VLLM_SLEEP_RESIDUE == 2**30
        assert NCCL not in engine[ph].gpu  # tp 1: no group of its own
    assert engine["load"].gpu == {ENGINE_ASLEEP: C.VLLM_SLEEP_RESIDUE}
    assert ENGINE_ASLEEP not in engine["rollout"].gpu
    assert engine["rollout"].gpu == {"engine (weights, kv cache)": int(0.6 * 80 * C.GIB)}


def test_a_sleeping_tp_engine_keeps_its_group_s_nccl_buffers():
    """tp 2: each worker's TP group (PyNccl's and torch's device group: 2 communicators) stays
    connected while the engine sleeps, 2 x 480 MiB per device."""
    engine = _vllm("rollout.tensor_parallel_size=2").process("engine").phases
    for ph in ASLEEP_PHASES:
        assert engine[ph].gpu[NCCL] == 2 * C.NCCL_COMMUNICATOR_BYTES
    assert NCCL not in engine["rollout"].gpu


def test_an_engine_that_never_sleeps_has_no_residue_term():
    engine = _vllm("rollout.sleep_level=0").process("engine").phases
    assert not any(ENGINE_ASLEEP in u.gpu for u in engine.values())


# ------------------------------------------------------------------------------ the driver

def test_the_ray_driver_holds_no_cuda_context_and_says_so():
    """Under Ray the driver never touches torch.cuda: its context is named, at 0, and would count
    on a device (GPU 0 of node 0); in one process the driver is the trainer, whose context is
    counted once."""
    plan = _plan()
    assert all(plan.process("driver").phases[ph].gpu == {DRIVER_CONTEXT: 0} for ph in plan.phases)
    assert plan.device("update")[DRIVER_CONTEXT] == 0
    one = _plan(backend="inprocess")
    assert DRIVER_CONTEXT not in _assumed(one)
    assert one.device("update")["cuda context"] == C.CUDA_CONTEXT


# ------------------------------------------------------------------------------ CPU and the printed plan

ALL_TERMS = ("actor.fsdp.offload_optimizer=true", "rollout.engine=vllm", "rollout.tensor_parallel_size=2",
             "algorithm.use_kl_loss=true")


def test_a_gpu_plan_names_every_term_and_a_cpu_plan_none(tiny_model_dir):
    """The same config on CUDA has every term; on CPU (Hardware.cpu, trainer.device=cpu) none:
    a CPU plan is unchanged by them (bench/plan_snapshot.py checks every recorded one)."""
    gpu = _plan(*ALL_TERMS)
    assert _assumed(gpu) == {NCCL, ENGINE_ASLEEP, PINNED_ROUNDING.format(""), PINNED_CACHE.format(""), DRIVER_CONTEXT}
    cfg = load_config(ARITH, [f"actor.model.path={tiny_model_dir}", "trainer.backend=ray", "trainer.devices_per_node=2",
                              "trainer.device=cpu", "actor.micro_batch_size=4", *ALL_TERMS])
    cpu = plan_config(cfg, Hardware.cpu(2, host_memory=64 * C.GIB))
    assert _assumed(cpu) == set()


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_printed_plan_lists_the_assumed_terms(device, tiny_model_dir):
    """`fitrl plan` prints a table of the assumed terms, each with its largest value, and says
    that `make gpu-check` measures them; a CPU plan prints none."""
    if device == "cuda":
        plan = _plan(*ALL_TERMS)
    else:
        cfg = load_config(ARITH, [f"actor.model.path={tiny_model_dir}", "trainer.device=cpu", *ALL_TERMS])
        plan = plan_config(cfg, Hardware.cpu(1, host_memory=64 * C.GIB))
    console = Console(record=True, width=200)
    print_plan(plan, [], None, console=console)
    text = console.export_text()
    assert ("make gpu-check" in text) == (device == "cuda")
    if device == "cuda":
        rows = {line.strip("│ ").split("│")[0].strip(): line for line in text.splitlines()}  # by the first cell
        assert f"{8 * (2 * _qwen_7b_moment_blocks_per_rank() + 4 * 339) / C.GIB:,.1f}" in rows[PINNED_CACHE.format("")]
        # a device: the trainer's and the reference's default groups, the sleeping TP engine's two
        assert f"{4 * C.NCCL_COMMUNICATOR_BYTES / C.GIB:.1f}" in rows[NCCL]  # 1.9
        assert rows[DRIVER_CONTEXT].split("│")[2].strip() == "0.0"


def test_the_plan_sleeps_the_engine_at_the_level_it_picks():
    """rollout.sleep_level=auto: level 2 in a training run (no pinned host copy of the weights:
    every update's push overwrites them), 1 with trainer.val_only (the host keeps the copy); the
    sleeping engine's residue either way."""
    train = _plan("rollout.engine=vllm").process("engine").phases
    assert "engine weights (asleep)" not in train["update"].host and ENGINE_ASLEEP in train["update"].gpu
    val = _plan("rollout.engine=vllm", "trainer.val_only=true").process("engine").phases
    assert val["update"].host["engine weights (asleep)"] > 0 and ENGINE_ASLEEP in val["load"].gpu
