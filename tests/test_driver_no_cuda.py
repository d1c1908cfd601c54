"""A Ray run's driver never calls ``torch.cuda`` (issue 59): its devices come from the cluster.

A call there would make a CUDA context on GPU 0 (memory no plan counts, on a GPU a rank uses),
a ``synchronize()`` that waits for nothing and a guard reading the ranks' device-wide use as the
driver's; on a head node without GPUs ``trainer.device=cuda`` would be refused and ``auto``
would put every rank on the CPU. The unit tests give the resolver a fake cluster; the Ray run
makes every ``torch.cuda`` function raise in the driver (its ranks are other processes).
"""

import io
import sys
import types

import pytest
import torch
from rich.console import Console

from fitrl.config import ConfigError
from fitrl.core import device as D
from fitrl.core.device import ClusterDevices, GPUFacts, driving, resolve_device
from helpers import toy_config

GIB = 1024**3
H100 = GPUFacts(name="NVIDIA H100 80GB HBM3", memory=80 * GIB, host_memory=2048 * GIB)


class CudaCalled(AssertionError):
    pass


# What a library other than fitrl may ask in the driver, each documented by torch not to touch a
# device: seeding (torch.manual_seed) only queues the seed for when CUDA initialises, which never
# comes in a driver (torch.cuda._lazy_call); transformers asks whether a CUDA graph is being
# captured, False without initialising a context. Every call from fitrl's own code raises.
ELSEWHERE_OK = {"manual_seed_all": None, "manual_seed": None, "seed_all": None, "is_current_stream_capturing": False}


@pytest.fixture
def no_cuda(monkeypatch):
    """Every public function of ``torch.cuda`` raises in this process (``ELSEWHERE_OK`` from other
    libraries excepted); returns the calls made, as ``name from module``."""
    called: list[str] = []
    for name in dir(torch.cuda):
        fn = getattr(torch.cuda, name)
        if name.startswith("_") or not isinstance(fn, types.FunctionType):
            continue

        def refuse(*args, _name=name, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if _name in ELSEWHERE_OK and not caller.startswith("fitrl"):
                return ELSEWHERE_OK[_name]
            called.append(f"{_name} from {caller}")
            raise CudaCalled(f"torch.cuda.{_name} called in the driver (from {caller})")
        monkeypatch.setattr(torch.cuda, name, refuse)
    return called


def fake_cluster(monkeypatch, resources: dict) -> ClusterDevices:
    """:func:`cluster_devices` of a cluster reporting ``resources``, its GPUs probed as an H100."""
    import fitrl.workers.ray_cluster as rc

    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "cluster_resources", lambda: dict(resources))
    monkeypatch.setattr(rc, "probe_gpu", lambda timeout_s=0: H100)
    return rc.cluster_devices()


@pytest.mark.parametrize("resources,asked,expected", [
    ({"CPU": 64.0, "GPU": 8.0}, "auto", "cuda"),
    ({"CPU": 64.0, "GPU": 8.0}, "cuda", "cuda"),
    ({"CPU": 64.0, "GPU": 8.0}, "cpu", "cpu"),
    ({"CPU": 2.0}, "auto", "cpu"),
    ({"CPU": 2.0}, "cpu", "cpu"),
])
def test_the_driver_resolves_devices_from_the_cluster(monkeypatch, no_cuda, resources, asked, expected):
    with driving(fake_cluster(monkeypatch, resources)):
        assert resolve_device(asked).type == expected
        assert not D.cuda_here() and not D.cuda_in_use()
    assert no_cuda == []


def test_cuda_on_a_cluster_without_gpus_is_one_line(monkeypatch, no_cuda):
    with driving(fake_cluster(monkeypatch, {"CPU": 2.0})), pytest.raises(ConfigError) as info:
        resolve_device("cuda")
    assert "\n" not in str(info.value) and "the Ray cluster has no CUDA device" in str(info.value)


def test_the_driver_plans_a_cluster_gpu_not_its_own(monkeypatch, no_cuda, tiny_model_dir, tmp_path):
    """A head node without GPUs plans the cluster's: one GPU's memory and its node's RAM, probed."""
    from fitrl.trainer.preflight import detect_hardware

    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.device=auto", "trainer.backend=ray",
                     "trainer.devices_per_node=8", "actor.micro_batch_size=2")
    with driving(fake_cluster(monkeypatch, {"CPU": 64.0, "GPU": 8.0})):
        hw = detect_hardware(cfg)
        assert D.gpu_name(torch.device("cuda")) == H100.name  # (the MFU's datasheet peak)
    assert (hw.device, hw.gpus_per_node, hw.gpu_memory, hw.host_memory) == ("cuda", 8, 80 * GIB, 2048 * GIB)
    assert no_cuda == []


def test_the_drivers_gpu_paths_ask_the_cluster(monkeypatch, no_cuda, tiny_model_dir, tmp_path):
    """What a driver does only when its run is on CUDA: the allocator line (CUDA is never
    initialised there, so never "late") and the MFU's datasheet peak, named by the probed GPU."""
    from fitrl.telemetry.perf import gpu_peak_flops
    from fitrl.trainer import run
    from fitrl.trainer.perf import StepPerf

    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.device=cuda", "trainer.backend=ray",
                     "trainer.devices_per_node=2")
    out = io.StringIO()
    with driving(fake_cluster(monkeypatch, {"CPU": 64.0, "GPU": 8.0})):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # (restored after the test, which sets it)
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
        run._device_allocator(cfg, Console(file=out, width=200))
        perf = StepPerf(cfg)
        peak = perf.peak()
        assert H100.name in perf.peak_source and peak in {gpu_peak_flops(H100.name, perf.dtype, tf32=t) for t in (0, 1)}
    assert out.getvalue().startswith("GPU allocator: expandable segments") and "initialised before" not in out.getvalue()
    assert no_cuda == []


def test_a_failed_probe_is_asked_once_and_said(no_cuda):
    calls = []

    def probe():
        calls.append(1)
        raise TimeoutError("no GPU came free")
    cluster = ClusterDevices(gpus=8, probe=probe)
    with driving(cluster):
        for _ in range(2):
            with pytest.raises(RuntimeError, match="could not read a GPU of the Ray cluster: TimeoutError: no GPU"):
                D.gpu_memory()
        assert D.gpu_name(torch.device("cuda")) == ""  # perf/mfu then says no peak is known
    assert calls == [1]


def test_auto_on_a_gpu_cluster_says_cuda_in_one_line(monkeypatch, no_cuda, tiny_model_dir, tmp_path):
    import fitrl.workers.ray_group as rg
    from fitrl.trainer import run

    cluster = fake_cluster(monkeypatch, {"CPU": 64.0, "GPU": 8.0})
    monkeypatch.setattr(rg, "ensure_ray", lambda address=None: None)
    monkeypatch.setattr(rg, "cluster_devices", lambda: cluster)
    out = io.StringIO()
    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.device=auto", "trainer.backend=ray",
                     "trainer.devices_per_node=2")
    with run._run_devices(cfg, Console(file=out, width=200)):
        assert resolve_device("auto").type == "cuda"
    assert out.getvalue() == "trainer.device=auto: cuda, the Ray cluster has 8 GPU(s)\n"
    assert D.cluster() is None  # (the run over: this process answers for itself again)


@pytest.mark.slow
def test_a_ray_run_calls_no_torch_cuda_in_the_driver(ray_cluster, no_cuda, tiny_model_dir, tmp_path):
    """One step of a 2-rank Ray run, with what reaches ``torch.cuda`` in a driver switched on: the
    memory plan (detect_hardware), the phases' memory records and timer sync, the guard, a
    checkpoint's RNG states and the restart loop's allocator line."""
    from fitrl.trainer.run import train

    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.device=auto", "trainer.backend=ray",
                     "trainer.devices_per_node=2", "trainer.max_steps=1", "trainer.val_before_train=false",
                     "data.rollout_batch_size=4", "rollout.n=2", "actor.mini_batch_size=4",
                     "actor.micro_batch_size=2", "memory.plan=warn", "memory.guard=true",
                     "memory.uss_min_phase_s=0", "checkpoint.save_freq=1")
    out = io.StringIO()
    history = train(cfg, Console(file=out, width=300))
    assert history and "reward/mean" in history[-1]
    assert no_cuda == [], (sorted(set(no_cuda)), out.getvalue())
    assert "trainer.device=auto: cpu, the Ray cluster has no GPU" in out.getvalue()
    assert (tmp_path / "checkpoints" / "step_1").is_dir()


def test_a_cluster_with_fewer_gpus_than_the_ranks_is_one_line_before_anything_loads(tiny_model_dir, tmp_path,
                                                                                    monkeypatch):
    """The README's recipe (8 ranks) on a cluster of 2 GPUs: refused at once, naming what was
    asked and what the cluster has, before the run directory, the plan or a model."""
    import fitrl.workers.ray_group as ray_group
    from fitrl.trainer import run

    cfg = toy_config(tiny_model_dir, tmp_path / "run", "trainer.backend=ray", "trainer.devices_per_node=8",
                     "rollout.workers=2", "rollout.mode=one_step_off")
    monkeypatch.setattr(ray_group, "ensure_ray", lambda address=None: None)
    monkeypatch.setattr(ray_group, "cluster_devices", lambda: ClusterDevices(gpus=2, probe=lambda: None))
    with pytest.raises(ConfigError) as e:
        run.train(cfg)
    line = str(e.value)
    assert "\n" not in line and "take 10 GPU(s)" in line and "has 2" in line and "rollout.workers=2" in line
    assert not (tmp_path / "run").exists()  # nothing was made
    run.check_gpu_count(cfg, 10)  # exactly enough: no refusal
    run.check_gpu_count(cfg, 8, supervised=True)  # `fitrl sft` starts no rollout workers


def test_a_vllm_run_without_vllm_is_one_line_before_ray_starts(tiny_model_dir, tmp_path, monkeypatch):
    """rollout.engine=vllm in an environment without vLLM: refused before Ray is asked anything."""
    import fitrl.workers.ray_group as ray_group
    from fitrl.trainer import run

    def no_ray(address=None):
        raise AssertionError("Ray was started before the vLLM check")

    monkeypatch.setitem(sys.modules, "vllm", None)  # as absent, even in .venv-vllm
    monkeypatch.setattr(ray_group, "ensure_ray", no_ray)
    cfg = toy_config(tiny_model_dir, tmp_path / "run", "trainer.backend=ray", "rollout.engine=vllm")
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm needs vLLM \(not installed"):
        run.train(cfg)
