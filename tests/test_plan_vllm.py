"""The vLLM engine in the plan, read from the run's own keys (``rollout.engine``,
``rollout.gpu_memory_utilization``, ``rollout.kv_cache_memory``, ``rollout.tensor_parallel_size``,
``rollout.sleep_level``; fitrl/memory/services.py), and the recommendations that change them."""

from pathlib import Path

from fitrl.config import load_config
from fitrl.memory import Hardware, plan_config
from fitrl.memory import calibration as C
from fitrl.memory.recommend import candidates
from fitrl.memory.states import full_weights

ROOT = Path(__file__).resolve().parent.parent
ARITH = str(ROOT / "examples" / "arith.yaml")
QWEN_7B = ROOT / "examples" / "failure_stories" / "models" / "qwen2.5-7b-instruct"
ENGINE = "engine (weights, kv cache)"


def _plan(*overrides: str):
    """Qwen2.5-7B on one node of 8 x 80 GiB under Ray, a colocated vLLM engine."""
    cfg = load_config(ARITH, [f"actor.model.path={QWEN_7B}", "trainer.backend=ray", "trainer.devices_per_node=8",
                              "actor.micro_batch_size=4", "rollout.engine=vllm", *overrides])
    return plan_config(cfg, Hardware(nodes=1, gpus_per_node=8, gpu_memory=80 * C.GIB, host_memory=2048 * C.GIB))


def test_tensor_parallel_engine_takes_its_share_of_every_device():
    """An engine over tp devices takes gpu_memory_utilization x the memory of EVERY device in its
    group (vLLM's budget is per worker), not 1/tp of it: TP=2 and TP=1 give the same device memory
    while awake; asleep (weight sync) each device holds its 1/tp of the bf16 weights."""
    one, two = _plan("rollout.tensor_parallel_size=1"), _plan("rollout.tensor_parallel_size=2")
    for plan in (one, two):
        assert plan.device("rollout")[ENGINE] == int(0.6 * 80 * C.GIB)
    assert one.peaks()["rollout"][0] == two.peaks()["rollout"][0]
    assert one.process("engine").per_node == 8 and two.process("engine").per_node == 4
    for tp, plan in ((1, one), (2, two)):
        assert plan.device("weight_sync")["engine weights"] == full_weights(plan.shape, "bfloat16", tp)


def test_kv_cache_memory_sizes_the_engine_instead_of_the_utilization():
    """rollout.kv_cache_memory: the engine holds its weights, that KV cache and vLLM's activation
    reserve, whatever gpu_memory_utilization says (per device, with TP too)."""
    for tp in (1, 2):
        plan = _plan("rollout.kv_cache_memory=4GiB", "rollout.gpu_memory_utilization=0.9",
                     f"rollout.tensor_parallel_size={tp}")
        weights = full_weights(plan.shape, "bfloat16", tp)
        assert plan.device("rollout")[ENGINE] == weights + 4 * C.GIB + C.VLLM_ACTIVATION_RESERVE


def test_recommendations_name_the_keys_users_set():
    changes = {c.text: c.overrides for c in candidates(_plan("rollout.gpu_memory_utilization=0.5"))}
    assert changes["rollout.sleep_level 1 -> 2"] == [("rollout.sleep_level", 2)]
    assert changes["rollout.gpu_memory_utilization 0.5 -> 0.4"] == [("rollout.gpu_memory_utilization", 0.4)]
    # with a KV cache of a set size, the utilization is not read: the size is what to lower
    changes = {c.text: c.overrides for c in candidates(_plan("rollout.kv_cache_memory=4GiB"))}
    assert changes["rollout.kv_cache_memory 4GiB -> 2048MiB"] == [("rollout.kv_cache_memory", "2048MiB")]
    assert not any("gpu_memory_utilization" in text for text in changes)
    # another framework's behaviour, emulated to reproduce its run: the fix is to drop it
    changes = {c.text: c.overrides for c in candidates(_plan("plan.emulate.free_cache_engine=true"))}
    fix = "plan.emulate.free_cache_engine true -> false (fitrl's engine sleeps and wakes)"
    assert changes[fix] == [("plan.emulate.free_cache_engine", False)]
