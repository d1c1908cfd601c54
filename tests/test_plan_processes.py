"""Every process counted (fitrl/memory/roles.py, ``process_roles``; fitrl/memory/services.py): under
Ray the reference's and the critic's ranks are Ray actors of their own on the policy's bundles,
each with a process runtime on the host and a CUDA context on its device; with LoRA the
reference is the policy (no process); in one process everything is the trainer's. A device sums
one process of each kind on it, a node every process x its count. vLLM with tensor parallelism
takes gpu_memory_utilization x every device of its group, and a node holds its G workers' host
memory whatever tp is."""

from pathlib import Path

import pytest

from fitrl.config import ConfigError, load_config
from fitrl.planner import Hardware, plan_config
from fitrl.memory import calibration as C
from fitrl.memory.gpu_terms import DRIVER_CONTEXT, NCCL
from fitrl.memory.states import frozen_states, full_weights, trained_states
from fitrl.report.load import PlanPredictions

ROOT = Path(__file__).resolve().parent.parent
ARITH = str(ROOT / "examples" / "arith.yaml")
QWEN_7B = ROOT / "examples" / "failure_stories" / "models" / "qwen2.5-7b-instruct"
H100 = dict(gpu_memory=80 * C.GIB, host_memory=2048 * C.GIB)
KL = "algorithm.use_kl_loss=true"
GAE = "algorithm.adv_estimator=gae"


def _plan(*overrides: str, backend: str = "ray", nodes: int = 1, gpus: int = 8):
    """Qwen2.5-7B on nodes of 8 x 80 GiB, the HF engine unless overridden."""
    cfg = load_config(ARITH, [f"actor.model.path={QWEN_7B}", f"trainer.backend={backend}", f"trainer.nnodes={nodes}",
                              f"trainer.devices_per_node={gpus}", "actor.micro_batch_size=4", "reward.num_workers=0",
                              "critic.micro_batch_size=4", *overrides])
    ranks = gpus if backend == "ray" else 1
    return plan_config(cfg, Hardware(nodes=nodes if backend == "ray" else 1, gpus_per_node=ranks, **H100))


def _host(plan, kind, phase):
    return sum(plan.process(kind).phases[phase].host.values())


def _gpu(plan, kind, phase):
    return sum(plan.process(kind).phases[phase].gpu.values())


def test_ray_reference_is_a_process_with_its_own_runtime_and_context():
    """KL under Ray: a "ref" process per device (8 per node). Beside the same run without KL, a
    device holds exactly one more CUDA context in a phase the reference does not run (its weights
    under FSDP CPU offload are on the host), and node 0 exactly 8 x (a CUDA process's runtime +
    the reference's pinned shard, in the policy's dtype: fp32 here); the policy's process is the same as without KL."""
    kl, off = _plan(KL, "ref.fsdp.cpu_offload=true"), _plan("ref.fsdp.cpu_offload=true")
    ref = kl.process("ref")
    assert ref.per_node == 8 and "ref" not in [p.kind for p in off.processes]
    shard = frozen_states(kl.shape, 8, kl.cfg.actor.model.dtype, pinned=True).params
    for ph in ("rollout", "update", "checkpoint_save"):
        # one more process on the device: its context and its default group's NCCL buffers
        assert sum(kl.device(ph).values()) - sum(off.device(ph).values()) == C.CUDA_CONTEXT + C.NCCL_COMMUNICATOR_BYTES
        assert kl.device(ph)["cuda context"] == 2 * C.CUDA_CONTEXT
        assert sum(kl.node_host(ph).values()) - sum(off.node_host(ph).values()) == 8 * (C.CUDA_PROCESS_RUNTIME + shard)
        assert ref.phases[ph].host == {"runtime": C.CUDA_PROCESS_RUNTIME, "offloaded ref params": shard}
        assert kl.process("trainer").phases[ph] == off.process("trainer").phases[ph]  # nothing of the ref's in it
    assert kl.node_host("update")["runtime"] == 16 * C.CUDA_PROCESS_RUNTIME + C.DRIVER_RUNTIME


def test_reference_log_probs_are_the_reference_process_s():
    """In ref_logprob the reference's process holds the batch, its traced transients and FSDP2's
    gathered units; the policy's process only its own states (as in any phase it does not run)."""
    plan = _plan(KL)
    trainer, ref = plan.process("trainer").phases, plan.process("ref").phases
    for part in ("batch", "activations", "logits", "gathered weights"):
        assert part in ref["ref_logprob"].gpu and part not in trainer["ref_logprob"].gpu
        assert part not in ref["rollout"].gpu
    assert set(trainer["ref_logprob"].gpu) == {"cuda context", "params", "optimizer", NCCL}
    states = frozen_states(plan.shape, 8, plan.cfg.actor.model.dtype).params  # on the device in every phase (no offload)
    assert ref["rollout"].gpu == {"cuda context": C.CUDA_CONTEXT, "ref params": states, NCCL: C.NCCL_COMMUNICATOR_BYTES}
    # a device in ref_logprob: the policy's resident states, the reference's everything, once each
    assert plan.device("ref_logprob")[DRIVER_CONTEXT] == 0  # the Ray driver touches no GPU
    assert {k: v for k, v in plan.device("ref_logprob").items() if k != DRIVER_CONTEXT} == {k: trainer["ref_logprob"].gpu.get(k, 0) + ref["ref_logprob"].gpu.get(k, 0)
                                          for k in set(trainer["ref_logprob"].gpu) | set(ref["ref_logprob"].gpu)}


def test_lora_reference_adds_no_process():
    """With LoRA the reference is the policy with its adapters off: no process, no context."""
    plan = _plan(KL, "actor.lora.rank=16")
    assert [p.kind for p in plan.processes if p.kind in ("trainer", "ref", "critic")] == ["trainer"]
    assert plan.device("ref_logprob")["cuda context"] == C.CUDA_CONTEXT
    assert "activations" in plan.process("trainer").phases["ref_logprob"].gpu  # the policy computes it
    assert plan.node_host("update")["runtime"] == 8 * (C.CUDA_PROCESS_RUNTIME + C.PEFT_IMPORT_HOST) + C.DRIVER_RUNTIME


def test_in_process_backend_keeps_every_role_in_one_process():
    plan = _plan(KL, GAE, backend="inprocess")
    assert [p.kind for p in plan.processes] == ["trainer", "driver", "node"]
    trainer = plan.process("trainer").phases
    assert plan.device("update")["cuda context"] == C.CUDA_CONTEXT
    assert {"ref params", "critic params", "critic optimizer", "grads"} <= set(trainer["update"].gpu)
    # one role updates at a time: the critic's update frees its gradients before the policy's starts
    assert "critic grads" not in trainer["update"].gpu
    assert "activations" in trainer["ref_logprob"].gpu


def test_ray_critic_is_a_process_with_its_states_and_update():
    """PPO under Ray: a "critic" process per device with its fp32 states; its gradients exist in
    the update only; one more runtime per rank on the node and one more context per device."""
    ppo, grpo = _plan(GAE), _plan()
    critic = ppo.process("critic")
    assert critic.per_node == 8
    st = trained_states(ppo.shape, 8, "float32")
    assert critic.phases["update"].gpu["critic grads"] == st.grads
    assert "critic grads" not in critic.phases["rollout"].gpu
    assert critic.phases["rollout"].gpu == {"cuda context": C.CUDA_CONTEXT, "critic params": st.params,
                                            "critic optimizer": st.optimizer, NCCL: C.NCCL_COMMUNICATOR_BYTES}
    assert not any("critic" in k for ph in ppo.phases for k in ppo.process("trainer").phases[ph].gpu)
    for ph in ("rollout", "update"):
        assert sum(ppo.device(ph).values()) - sum(grpo.device(ph).values()) == sum(critic.phases[ph].gpu.values())
        assert sum(ppo.node_host(ph).values()) - sum(grpo.node_host(ph).values()) == 8 * C.CUDA_PROCESS_RUNTIME
    both = _plan(KL, GAE)
    assert both.device("update")["cuda context"] == 3 * C.CUDA_CONTEXT


def test_a_ray_critic_rank_holds_its_values_and_update_passes(tiny_model_dir):
    """On CPU under Ray the critic's rank holds its own traced passes (issue 38 measured it 37-39 %
    over its plan without them): its values forward in ``old_logprob``, its update with FSDP2's
    units and glibc's heap terms, none of it outside those phases; in one process the policy's
    passes are the larger and the critic adds none."""
    from fitrl.memory.trace import trace_spec, transient_bytes

    args = [f"actor.model.path={tiny_model_dir}", "trainer.device=cpu", GAE, "critic.micro_batch_size=4"]
    ray = plan_config(load_config(ARITH, args + ["trainer.backend=ray", "trainer.devices_per_node=2"]),
                      Hardware.cpu(ranks_per_node=2, host_memory=64 * C.GIB))
    critic = ray.process("critic").phases
    seq_len = ray.cfg.data.max_prompt_length + ray.cfg.rollout.max_response_length
    traced = transient_bytes(trace_spec(ray.shape, phase="value_update", batch=4, seq_len=seq_len,
                                        response_len=ray.cfg.rollout.max_response_length), ray.shape.layers)
    assert critic["update"].host["activations"] >= traced > 0
    for part in ("gathered weights", "allocator (FSDP2 unit buffers)", "allocator (heap residue)", "critic grads"):
        assert critic["update"].host[part] > 0, part
    assert critic["old_logprob"].host["activations"] > 0 and critic["old_logprob"].host["allocator (regrown heap)"] > 0
    assert "activations" not in critic["rollout"].host
    one = plan_config(load_config(ARITH, args), Hardware.cpu(host_memory=64 * C.GIB))
    grpo = plan_config(load_config(ARITH, args[:2]), Hardware.cpu(host_memory=64 * C.GIB))
    assert one.process("trainer").phases["update"].host["activations"] == \
        grpo.process("trainer").phases["update"].host["activations"]


def test_cpu_ray_role_processes_cost_a_ray_actor_runtime(tiny_model_dir):
    """On CPU a role's rank is a Ray actor: CPU_PROCESS_RUNTIME + CPU_RANK_EXTRA (bench/process_memory.py)."""
    cfg = load_config(ARITH, [f"actor.model.path={tiny_model_dir}", "trainer.device=cpu", "trainer.backend=ray",
                              "trainer.devices_per_node=2", KL, GAE, "reward.num_workers=3",
                              "actor.micro_batch_size=4", "critic.micro_batch_size=4"])
    plan = plan_config(cfg, Hardware.cpu(ranks_per_node=2, host_memory=64 * C.GIB))
    runtime = C.CPU_PROCESS_RUNTIME + C.CPU_RANK_EXTRA
    for kind in ("trainer", "ref", "critic"):
        assert plan.process(kind).phases["rollout"].host["runtime"] == runtime
        assert plan.process(kind).per_node == 2
    assert plan.node_host("rollout")["runtime"] == 6 * runtime + C.DRIVER_RUNTIME
    assert plan.node_host("rollout")["reward workers"] == 3 * C.REWARD_WORKER_HOST
    assert plan.device("rollout") == {}  # no device memory on CPU


def test_report_reads_the_reference_and_critic_kinds():
    plan = PlanPredictions({"processes": {
        "trainer": {"phases": {"update": {"gpu_gib": 3.0, "host_gib": 1.0}}},
        "ref": {"phases": {"ref_logprob": {"gpu_gib": 2.0, "host_gib": 0.5}}},
        "critic": {"phases": {"old_logprob": {"gpu_gib": 1.5, "host_gib": 0.25},
                              "update": {"gpu_gib": 1.75, "host_gib": 0.25}}}}})
    assert plan.peak("ref.rank3", "ref", "gpu") == 2.0
    assert plan.peak("critic.rank0", "values", "gpu") == 1.5
    assert plan.peak("critic.rank0", "critic_update", "gpu") == 1.75
    assert plan.peak("policy.rank1", "update", "host") == 1.0


# ------------------------------------------------------------------------------ vLLM tensor parallelism

ENGINE, ASLEEP, SWAP = "engine (weights, kv cache)", "engine weights (asleep)", "engine swap space"


def _vllm(tp: int, nodes: int = 1, gpus: int = 8, *overrides: str):
    return _plan("rollout.engine=vllm", f"rollout.tensor_parallel_size={tp}", "rollout.sleep_level=1",
                 "rollout.gpu_memory_utilization=0.6", "plan.emulate.swap_space_gib=4", "data.rollout_batch_size=48",
                 "actor.mini_batch_size=48", *overrides, nodes=nodes, gpus=gpus)


@pytest.mark.parametrize("tp,engines", [(1, 8), (2, 4), (8, 1)])
def test_tp_engine_takes_the_utilization_of_every_device(tp, engines):
    """8 x 80 GiB: 0.6 x 80 GiB on every device whatever tp is (not / tp); a node holds its 8
    workers' host memory: 8 pinned 1/tp shards, 8 x 4 GiB of swap (vLLM's swap_space is per GPU),
    8 x vLLM's runtime in the trainer processes."""
    plan = _vllm(tp)
    assert plan.device("rollout")[ENGINE] == int(0.6 * 80 * C.GIB)
    assert plan.process("engine").per_node == engines
    shard = full_weights(plan.shape, "bfloat16", tp, pinned=True)
    assert plan.node_host("update")[ASLEEP] == 8 * shard
    assert plan.node_host("update")[SWAP] == 8 * 4 * C.GIB
    assert plan.node_host("update")["vLLM runtime"] == 8 * C.VLLM_IN_PROCESS_RUNTIME


def test_tp_16_over_two_nodes_keeps_each_node_s_host_memory():
    plan = _vllm(16, nodes=2)
    assert plan.process("engine").per_node == 1
    assert plan.device("rollout")[ENGINE] == int(0.6 * 80 * C.GIB)
    host = plan.node_host("update")
    assert host[ASLEEP] == 8 * full_weights(plan.shape, "bfloat16", 16, pinned=True)
    assert host[SWAP] == 8 * 4 * C.GIB and host["vLLM runtime"] == 8 * C.VLLM_IN_PROCESS_RUNTIME


def test_tp_not_dividing_the_node_straddles_nodes():
    """tp=3 on 3 nodes of 8 (24 devices, 8 engines): 2 engines per node of 4 workers' host memory
    each, the node's 8 workers in all; tp=4 on 2 nodes of 6: 1 engine part of 6 workers."""
    plan = _vllm(3, 3, 8, "data.rollout_batch_size=24", "actor.mini_batch_size=24")
    assert plan.process("engine").per_node == 2
    assert plan.node_host("update")[ASLEEP] == 8 * full_weights(plan.shape, "bfloat16", 3, pinned=True)
    assert plan.device("rollout")[ENGINE] == int(0.6 * 80 * C.GIB)
    plan = _vllm(4, 2, 6)
    assert plan.process("engine").per_node == 1
    assert plan.node_host("update")[SWAP] == 6 * 4 * C.GIB
    with pytest.raises(ConfigError, match="do not divide into engines of 6"):
        _vllm(6)


def test_separate_engine_processes_cost_a_runtime_and_context_per_worker():
    plan = _vllm(2, 1, 8, "plan.emulate.separate_processes=true")
    assert plan.node_host("update")["runtime"] == 8 * C.VLLM_PROCESS_RUNTIME + 8 * C.CUDA_PROCESS_RUNTIME + C.DRIVER_RUNTIME
    assert "vLLM runtime" not in plan.node_host("update")
    assert plan.device("update")["cuda context"] == 2 * C.CUDA_CONTEXT


def test_a_vllm_rollout_worker_is_planned_as_its_engine_and_the_trainer_holds_none():
    """rollout.workers with rollout.engine=vllm: each worker's device holds its engine
    (gpu_memory_utilization x the device: weights and KV cache; its module is only the
    architecture, on meta), its host the vLLM runtime and the version in the mailbox; the trainer
    ranks validate with the hf engine on the trained module, so they plan no engine. On CPU the
    worker holds the CPU engine's measured parts."""
    from fitrl.memory.run import Run
    from fitrl.rollout.vllm_plan import vllm_cpu_engine

    common = ("rollout.workers=4", "rollout.mode=one_step_off", "trainer.devices_per_node=4",
              "rollout.gpu_memory_utilization=0.6")
    hf, vllm = _plan(*common), _plan("rollout.engine=vllm", *common)
    engine = "rollout vllm engine (weights, kv cache)"
    for ph in ("rollout", "update"):
        # (and the weight channel's communicator: rollout.weight_transport=auto is the collective on CUDA)
        assert vllm.process("rollout").phases[ph].gpu == {"cuda context": C.CUDA_CONTEXT, engine: int(0.6 * 80 * C.GIB),
                                                          NCCL: C.NCCL_COMMUNICATOR_BYTES}
        assert vllm.process("rollout").phases[ph].host["vLLM runtime"] == C.VLLM_IN_PROCESS_RUNTIME
        assert "rollout params" in hf.process("rollout").phases[ph].gpu
        assert vllm.process("trainer").phases[ph].gpu == hf.process("trainer").phases[ph].gpu
        assert vllm.process("trainer").phases[ph].host == hf.process("trainer").phases[ph].host
    assert "engine" not in [p.kind for p in vllm.processes]  # no colocated engine process
    cfg = load_config(ARITH, ["rollout.engine=vllm", "rollout.workers=1", "rollout.mode=one_step_off",
                              "trainer.backend=ray", "trainer.devices_per_node=1"])
    cpu = plan_config(cfg, Hardware.cpu(1, host_memory=64 * C.GIB))
    parts = cpu.process("rollout").phases["update"].host
    run = Run(cfg, cpu.hardware, cpu.shape, None, cpu.spec)
    assert parts["rollout vllm engine (weights, kv cache)"] == sum(vllm_cpu_engine(run).values()) > 0
    assert "vLLM runtime" not in cpu.process("trainer").phases["update"].host
