"""``plan.emulate.load_on_device`` (fitrl/config/plan.py; fitrl/memory/trainer.py, ``_load``):
another framework's checkpoint loading (EasyR1 without ``enable_rank0_init``: every rank's
``from_pretrained(device_map="cuda")``, failure story 5), planned only. With
``actor.fsdp.init=every_rank`` under Ray on CUDA each rank's full copy of the checkpoint is on its
device at load instead of in host memory; with ``init=rank0``, in one process or on CPU nothing
changes."""

from pathlib import Path

from fitrl.config import load_config
from fitrl.planner import Hardware, plan_config
from fitrl.memory import calibration as C

ROOT = Path(__file__).resolve().parent.parent
ARITH = str(ROOT / "examples" / "arith.yaml")
QWEN_7B = ROOT / "examples" / "failure_stories" / "models" / "qwen2.5-7b-instruct"
EMULATE = "plan.emulate.load_on_device=true"
# Qwen2.5-7B-Instruct's parameters (its model card's 7.62B; embeddings and lm_head untied), in the
# actor's fp32 (fitrl trains fp32 master weights, as EasyR1 loads its actor)
FP32_COPY = 7_615_616_512 * 4  # 30,462,466,048 bytes = 28.37 GiB


def _plan(*overrides: str, backend: str = "ray", gpu_memory: int = 80 * C.GIB, device: str = "cuda"):
    """Qwen2.5-7B on one node of 8 devices, the HF engine, no reference."""
    cfg = load_config(ARITH, [f"actor.model.path={QWEN_7B}", f"trainer.backend={backend}", "trainer.nnodes=1", "trainer.devices_per_node=8",
                              "actor.micro_batch_size=4", "reward.num_workers=0", *overrides])
    ranks = 8 if backend == "ray" else 1
    cuda = device == "cuda"
    return plan_config(cfg, Hardware(nodes=1, gpus_per_node=ranks, gpu_memory=gpu_memory if cuda else 0,
                                     host_memory=2048 * C.GIB, device=device))


def test_default_is_off():
    assert load_config(ARITH, []).plan.emulate.load_on_device is False
    assert load_config(ARITH, [EMULATE]).plan.emulate.load_on_device is True


def test_every_rank_holds_the_whole_fp32_model_on_its_device_at_load():
    """Each of the 8 ranks: the full fp32 weights on its device (28.37 GiB, hand-computed), none
    in host memory; without the emulation the 8 copies are node 0's host memory. Only the load
    phase changes."""
    on, off = _plan("actor.fsdp.init=every_rank", EMULATE), _plan("actor.fsdp.init=every_rank")
    assert on.process("trainer").phases["load"].gpu["checkpoint copy"] == FP32_COPY
    assert on.device("load")["checkpoint copy"] == FP32_COPY
    assert "checkpoint copy" not in on.node_host("load")
    assert off.node_host("load")["checkpoint copy"] == 8 * FP32_COPY
    assert "checkpoint copy" not in off.device("load")
    assert sum(on.device("load").values()) - sum(off.device("load").values()) == FP32_COPY
    assert sum(off.node_host("load").values()) - sum(on.node_host("load").values()) == 8 * FP32_COPY
    for ph in on.phases:
        if ph != "load":
            assert on.device(ph) == off.device(ph) and on.node_host(ph) == off.node_host(ph), ph


def test_a_device_smaller_than_the_model_runs_out_at_load():
    """32 GiB devices: the 28.37 GiB copy and the CUDA context pass the usable 97 %, less the plan's
    band, at load (the run's other phases are not what this checks); without the emulation load
    fits the device."""
    on = _plan("actor.fsdp.init=every_rank", EMULATE, gpu_memory=32 * C.GIB)
    off = _plan("actor.fsdp.init=every_rank", gpu_memory=32 * C.GIB)
    assert sum(on.device("load").values()) >= FP32_COPY + C.CUDA_CONTEXT > 0.9 * 32 * C.GIB
    assert ("gpu", "load") in [(p.resource, p.phase) for p in on.problems()]
    assert ("gpu", "load") not in [(p.resource, p.phase) for p in off.problems()]


def test_rank0_init_in_process_and_cpu_are_unchanged():
    """init=rank0 (rank 0 reads into host memory, as EasyR1's rank-0 path does), the in-process
    backend and a CPU run: the emulation changes nothing."""
    for overrides, kw in ((("actor.fsdp.init=rank0",), {}), ((), {"backend": "inprocess"}),
                          (("actor.fsdp.init=every_rank",), {"device": "cpu"})):
        on, off = _plan(*overrides, EMULATE, **kw), _plan(*overrides, **kw)
        for ph in on.phases:
            assert on.device(ph) == off.device(ph) and on.node_host(ph) == off.node_host(ph), (overrides, kw, ph)
    rank0 = _plan("actor.fsdp.init=rank0", EMULATE)
    assert rank0.node_host("load")["checkpoint copy"] == FP32_COPY and "checkpoint copy" not in rank0.device("load")
