"""memory.trim_heap: CPU processes give the heap's free pages back (glibc malloc_trim) at the end
of each role's phase, and the CPU memory plan follows whether they do."""

from __future__ import annotations

import pytest
import torch

from fitrl.config.schema import FSDPConfig
from fitrl.memory import calibration as C
from fitrl.roles import offload, workers
from fitrl.roles.offload import OffloadBetweenPhases
from fitrl.sharding.fsdp2.plan import CPU_UNIT_BUFFERS
from fitrl.telemetry import memory as mem
from helpers import toy_config


@pytest.fixture
def trims(monkeypatch):
    calls = []
    monkeypatch.setattr(offload, "trim_heap", lambda: calls.append(1) or True)
    return calls


def test_phase_end_trims_on_cpu(trims):
    offload = OffloadBetweenPhases(torch.nn.Linear(2, 2), FSDPConfig(), torch.device("cpu"), trim=True)
    assert len(trims) == 1  # once built (what loading freed)
    with offload.phase():
        assert len(trims) == 1
    assert len(trims) == 2
    with pytest.raises(RuntimeError), offload.phase(needs_optimizer=True):
        raise RuntimeError("a phase that fails still ends")
    assert len(trims) == 3


def test_no_trim_when_off_or_not_cpu(trims):
    off = OffloadBetweenPhases(torch.nn.Linear(2, 2), FSDPConfig(), torch.device("cpu"), trim=False)
    with off.phase():
        pass
    # a CUDA role (FSDP2 CPU offload: nothing moves, so no CUDA call here) keeps its host heap
    cuda = OffloadBetweenPhases(torch.nn.Linear(2, 2), FSDPConfig(cpu_offload=True), torch.device("cuda"), trim=True)
    with cuda.phase():
        pass
    assert trims == []


def test_config_key(tmp_path, tiny_model_dir):
    assert toy_config(tiny_model_dir, tmp_path).memory.trim_heap is True
    assert toy_config(tiny_model_dir, tmp_path, "memory.trim_heap=false").memory.trim_heap is False


@pytest.mark.parametrize("trim", [True, False])
def test_policy_phases_trim(tmp_path, tiny_model_dir, trims, trim):
    """Each of a CPU policy's calls (generate, log-probs, update) ends with one trim, and each
    micro-batch of its log-probs and update with one more; or none at all."""
    from fitrl.config.schema import SamplingConfig
    from fitrl.data.batch import Batch

    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.device=cpu", f"memory.trim_heap={str(trim).lower()}")
    worker = workers.PolicyWorker(cfg, rank=0, world_size=1)
    built = len(trims)
    batch = worker.generate(Batch(fields={"prompt_ids": [[10, 11, 12], [13, 14]]}),
                            SamplingConfig(n=2, max_tokens=4, ignore_eos=True))
    batch.update(worker.compute_logprob(batch))
    batch.update(advantages=torch.ones_like(batch["response_mask"], dtype=torch.float32))
    worker.update(batch)
    a = worker.actor.cfg
    micro = len(worker.actor.partition(batch, a.logprob_micro_batch_size)) + len(worker.actor.partition(batch, a.micro_batch_size))
    assert micro >= 2
    assert len(trims) - built == (3 + micro if trim else 0)



def test_critic_and_reference_trim_per_micro_batch(tmp_path, tiny_model_dir, trims):
    """The critic's values and update, and the reference's log-probs, trim once per micro-batch
    besides their phase ends."""
    from fitrl.config.schema import SamplingConfig
    from fitrl.data.batch import Batch

    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.device=cpu", "algorithm.adv_estimator=gae",
                     "algorithm.use_kl_loss=true", "critic.micro_batch_size=2", "critic.values_micro_batch_size=2",
                     "ref.logprob_micro_batch_size=2")
    batch = workers.PolicyWorker(cfg, rank=0, world_size=1).generate(
        Batch(fields={"prompt_ids": [[10, 11, 12], [13, 14]]}), SamplingConfig(n=3, max_tokens=4, ignore_eos=True))
    assert len(batch) == 6
    critic, ref = workers.CriticWorker(cfg, rank=0, world_size=1), workers.ReferenceWorker(cfg, rank=0, world_size=1)
    before = len(trims)
    batch.update(critic.compute_values(batch))
    assert len(trims) - before == 3 + 1  # 6 sequences in micro-batches of 2, then the phase's end
    batch.update(returns=torch.zeros_like(batch["values"]))
    before = len(trims)
    critic.update(batch)
    mini = critic.cfg.critic.mini_batch_size * cfg.rollout.n
    updates = sum(-(-min(mini, 6 - i) // 2) for i in range(0, 6, mini)) * cfg.critic.ppo_epochs
    assert len(trims) - before == updates + 1
    before = len(trims)
    ref.compute_ref_logprob(batch)
    assert len(trims) - before == 3 + 1

@pytest.mark.skipif(mem._libc() is None, reason="no glibc")
def test_trim_heap_returns_free_pages():
    """Freed heap blocks below glibc's mmap threshold stay resident until trimmed."""
    blocks = [bytearray(64 * 1024) for _ in range(1600)]  # 100 MiB on the heap, every page touched
    keep = blocks[-1]  # holds the heap's top: only malloc_trim(0)'s walk of the free chunks can return the rest
    del blocks
    before = mem.rss_bytes()
    assert mem.trim_heap() is True
    assert before - mem.rss_bytes() > 50 * mem.MIB
    del keep


def _cpu_plan(model_dir, tmp_path, *overrides):
    from fitrl.planner import Hardware, plan_config

    cfg = toy_config(model_dir, tmp_path, "trainer.device=cpu", "rollout.ignore_eos=true", *overrides)
    return plan_config(cfg, Hardware.cpu(host_memory=64 * C.GIB)).process("trainer").phases


@pytest.mark.parametrize("ckpt", [False, True])
def test_cpu_plan_follows_trim(tmp_path, tiny_model_dir, ckpt):
    """The glibc plan is the plan without allocator factors (``plan.host_malloc=mmap``: held +
    traced transients) with the update's traced activations and logits scaled by the trimmed
    backward factor, and every other phase's transients by the trimmed phase (generation: rollout)
    factor; untrimmed, by the untrimmed factors and the retained share of the update."""
    from fitrl.memory.trainer import TRANSIENT

    ck = f"actor.model.gradient_checkpointing={str(ckpt).lower()}"
    bare = _cpu_plan(tiny_model_dir, tmp_path, ck, "plan.host_malloc=mmap")
    trimmed = _cpu_plan(tiny_model_dir, tmp_path, ck)
    untrimmed = _cpu_plan(tiny_model_dir, tmp_path, ck, "memory.trim_heap=false")
    traced = lambda u, keys=("activations", "logits"): sum(u.host.get(k, 0) for k in keys)  # noqa: E731
    held = lambda u: sum(u.host.values()) - traced(u)  # noqa: E731

    bwd = C.CPU_TRIMMED_RECOMPUTE_RSS_FACTOR if ckpt else C.CPU_TRIMMED_BACKWARD_RSS_FACTOR
    # the trimmed update also holds the heap residue: a fixed part and a share of the smaller of
    # its traced transients and its fp32 gradients (one process: every parameter trains)
    grads = bare["update"].host["grads"]
    residue = int(C.CPU_UPDATE_HEAP_FIXED + C.CPU_UPDATE_HEAP_PINNED * min(traced(bare["update"]), grads))
    assert trimmed["update"].host["allocator (heap residue)"] == pytest.approx(residue, abs=2)
    assert held(trimmed["update"]) == held(bare["update"]) + trimmed["update"].host["allocator (heap residue)"]
    assert "allocator (heap residue)" not in untrimmed["update"].host
    assert traced(trimmed["update"]) == pytest.approx(bwd * traced(bare["update"]), abs=2)
    for ph in ("rollout", "old_logprob"):
        factor = C.CPU_TRIMMED_ROLLOUT_RSS_FACTOR if ph == "rollout" else C.CPU_TRIMMED_PHASE_RSS_FACTOR
        own = traced(bare[ph], TRANSIENT)
        assert own > 0
        assert trimmed[ph].host.get("allocator (regrown heap)", 0) == pytest.approx((factor - 1) * own, abs=1)
        assert sum(trimmed[ph].host.values()) == pytest.approx(sum(bare[ph].host.values()) + (factor - 1) * own, abs=2)

    bwd = C.CPU_RECOMPUTE_RSS_FACTOR if ckpt else C.CPU_BACKWARD_RSS_FACTOR
    assert traced(untrimmed["update"]) == pytest.approx(bwd * traced(bare["update"]), abs=2)
    retained = int(C.CPU_RETAINED_AFTER_UPDATE * traced(untrimmed["update"], TRANSIENT))
    for ph in ("rollout", "old_logprob"):
        assert sum(untrimmed[ph].host.values()) == pytest.approx(
            sum(bare[ph].host.values()) + max(0, retained - traced(bare[ph], TRANSIENT)), abs=2)


def test_cpu_plan_bf16_compute_factor(tmp_path, tiny_model_dir):
    """bf16 compute over fp32 weights (autocast in one process) scales the update's traced
    activations and logits by the mixed-precision factor, not the fp32 one."""
    mixed = "actor.fsdp.mixed_precision=true"
    bare = _cpu_plan(tiny_model_dir, tmp_path, mixed, "plan.host_malloc=mmap")["update"]
    trimmed = _cpu_plan(tiny_model_dir, tmp_path, mixed)["update"]
    traced = lambda u: u.host.get("activations", 0) + u.host.get("logits", 0)  # noqa: E731
    assert traced(bare) > 0
    assert traced(trimmed) == pytest.approx(C.CPU_TRIMMED_MIXED_BACKWARD_RSS_FACTOR * traced(bare), abs=2)
    assert C.CPU_TRIMMED_MIXED_BACKWARD_RSS_FACTOR != C.CPU_TRIMMED_BACKWARD_RSS_FACTOR  # which factor is read


def test_cpu_plan_fsdp_unit_buffers(tmp_path, tiny_model_dir):
    """On CPU FSDP2 ranks the update's heap excess is the larger of the activations' factor and
    one unsharded copy of the parameters and gradients (fp32 here: 8 bytes per parameter, times
    the measured unit-buffer factor), with the heap residue on top."""
    from fitrl.planner import Hardware, plan_config

    def plan(*extra):
        cfg = toy_config(tiny_model_dir, tmp_path, "trainer.device=cpu", "rollout.ignore_eos=true",
                         "trainer.backend=ray", "trainer.devices_per_node=2", "actor.micro_batch_size=4", *extra)
        return plan_config(cfg, Hardware.cpu(host_memory=64 * C.GIB, ranks_per_node=2))

    glibc, bare = plan(), plan("plan.host_malloc=mmap")
    g, b = (p.process("trainer").phases["update"].host for p in (glibc, bare))
    traced = b.get("activations", 0) + b.get("logits", 0)
    units = int(CPU_UNIT_BUFFERS * 8 * glibc.shape.num_params)
    residue = g["allocator (heap residue)"]  # this rank's half of the gradients, or the transients
    assert residue == pytest.approx(C.CPU_UPDATE_HEAP_FIXED + C.CPU_UPDATE_HEAP_PINNED * min(
        traced, 4 * glibc.shape.num_params // 2), abs=2)
    excess = sum(g.values()) - sum(b.values())
    activations = (C.CPU_TRIMMED_BACKWARD_RSS_FACTOR - 1) * traced
    assert excess == pytest.approx(max(activations, units) + residue, abs=4)
    assert g.get("allocator (FSDP2 unit buffers)", 0) == pytest.approx(max(0, units - activations), abs=4)
