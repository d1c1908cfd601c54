"""The GPU path's offloading, checked where a CPU can see it (issue 59).

- A GPU process group names a CPU backend beside NCCL (``cpu:gloo,cuda:nccl``): with CPU offload,
  host tensors (FSDP2's host shards in the rank-0 broadcast, in gradient clipping and in a weight
  push's ``full_tensor()``) meet collectives, which NCCL alone refuses. The CPU half of that string
  is run here for real, on 2 gloo ranks.
- Optimizer state (moments and a fused AdamW's ``step``) sits on its parameter's device at every
  update, a resume included. A CPU-only machine emulates the GPU with the ``meta`` device: moves
  to it are real ``.to("meta")``; moves back allocate empty host tensors (meta holds no data), which
  these tests never read.
"""

from __future__ import annotations

import pytest
import torch

from fitrl.config.schema import FSDPConfig
from fitrl.distributed.host_device import check_optimizer_on_param_devices, move_optimizer_state, optimizer_state_misplaced
from fitrl.distributed.process_group import backend_for_device, default_backend
from fitrl.roles import offload
from fitrl.roles.offload import OffloadBetweenPhases
from helpers import toy_config

META = torch.device("meta")


# --- the backend string ---------------------------------------------------------------------

def test_gpu_groups_name_a_cpu_backend_beside_nccl():
    gpu = backend_for_device(default_backend(use_gpu=True))
    assert gpu == {"cpu": "gloo", "cuda": "nccl"}  # host tensors through gloo, device ones through NCCL
    assert default_backend(use_gpu=False) == "gloo"


def test_backend_strings_parse_as_torch_reads_them():
    assert backend_for_device("nccl") == {"cuda": "nccl"}  # no CPU backend: host tensors fail
    assert backend_for_device("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert backend_for_device("cuda:nccl, cpu:gloo") == {"cuda": "nccl", "cpu": "gloo"}


def host_collectives_on_rank(rank: int, world: int, port: int, backend: str, queue) -> None:
    """Join ``backend`` through fitrl's init_distributed; run the collectives CPU offload puts
    host tensors into: an all-reduce, an FSDP2 gather of host shards (a weight push's
    ``full_tensor()``) and a gradient-norm clip over host DTensor gradients."""
    import torch.distributed as dist

    from fitrl.distributed.fsdp import shard
    from fitrl.distributed.state import stream_full_tensors
    from fitrl.distributed.process_group import DistEnv, init_distributed
    from fitrl.roles.actor import clip_gradients

    init_distributed(DistEnv(rank, world, rank, world, "127.0.0.1", port), backend, timeout_s=60)
    try:
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        torch.manual_seed(0)  # the same full weights on every rank
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        shard(model, FSDPConfig(), list(model), torch.device("cpu"))
        full = {name: t.clone() for name, t in stream_full_tensors(model)}
        model(torch.ones(3, 4)).sum().backward()
        norm = clip_gradients(model, 1.0)
        queue.put((rank, float(total), {k: tuple(v.shape) for k, v in full.items()}, norm))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_gpu_groups_cpu_backend_runs_host_collectives():
    """The CPU entry of the GPU group's backend, as a composite string (``cpu:gloo``), on 2 ranks."""
    import torch.multiprocessing as mp

    from fitrl.distributed.process_group import free_port

    cpu = backend_for_device(default_backend(use_gpu=True))["cpu"]
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=host_collectives_on_rank, args=(r, 2, port, f"cpu:{cpu}", queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, rest) for r, *rest in (queue.get(timeout=180) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    for total, shapes, norm in results.values():
        assert total == 3.0
        assert shapes == {"0.weight": (6, 4), "0.bias": (6,), "1.weight": (2, 6), "1.bias": (2,)}
        assert norm > 0
    assert results[0][2] == results[1][2]  # one global norm


# --- optimizer state on the parameters' device -----------------------------------------------

@pytest.fixture
def params_keep_identity():
    """``Module.to`` swaps a parameter's contents in place (as ``.to("cuda")`` does by ``set_data``),
    so the optimizer still holds the model's parameters after a move to ``meta``."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


def stepped(fused: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and its AdamW after one step: moments and ``step`` exist, on the host."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), fused=fused)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def test_fused_step_follows_its_parameters_to_the_device(params_keep_identity):
    model, opt = stepped(fused=True)
    assert optimizer_state_misplaced(opt) == []
    model.to(META)
    move_optimizer_state(opt, META)
    assert optimizer_state_misplaced(opt) == []
    assert {v.device for s in opt.state.values() for v in s.values()} == {META}  # step included


def test_default_adamw_keeps_step_on_the_host(params_keep_identity):
    """The default (foreach) kernel reads ``step`` on the host: moving it would cost a sync per step."""
    model, opt = stepped(fused=False)
    model.to(META)
    move_optimizer_state(opt, META)
    assert optimizer_state_misplaced(opt) == []
    assert all(s["step"].device.type == "cpu" and s["exp_avg"].is_meta for s in opt.state.values())


def test_misplaced_states_are_named_one_line_each():
    model, opt = stepped(fused=True)
    weight = opt.state[model.weight]
    weight["exp_avg"] = weight["exp_avg"].to(META)
    opt.state[model.bias]["step"] = opt.state[model.bias]["step"].to(META)
    wrong = optimizer_state_misplaced(opt)
    assert wrong == ["param group 0 parameter 0 (2, 3): exp_avg on meta, its update reads it on cpu",
                     "param group 0 parameter 1 (2,): step on meta, its update reads it on cpu"]
    with pytest.raises(RuntimeError, match="exp_avg on meta"):
        check_optimizer_on_param_devices(opt)


@pytest.mark.parametrize("debug", ["1", ""])
def test_debug_runs_check_the_states_when_an_update_starts(monkeypatch, debug):
    monkeypatch.setenv("FITRL_DEBUG", debug)
    model, opt = stepped(fused=True)
    off = OffloadBetweenPhases(model, FSDPConfig(), torch.device("cpu"), opt)
    opt.state[model.bias]["step"] = opt.state[model.bias]["step"].to(META)  # as a fault would leave it
    with off.phase():  # no update: nothing to check
        pass
    if debug:
        with pytest.raises(RuntimeError, match="step on meta"), off.phase(needs_optimizer=True):
            pass
    else:
        with off.phase(needs_optimizer=True):
            pass


@pytest.fixture
def emulated_gpu(monkeypatch, params_keep_identity):
    """``meta`` stands for the GPU: host -> meta moves are the real ones; meta -> host moves
    allocate empty host tensors (meta has no data to copy back)."""
    real_model, real_optimizer = offload.move_model, offload.move_optimizer_state

    def move_model(m, device):
        if torch.device(device).type == "cpu" and any(p.is_meta for p in m.parameters()):
            m.to_empty(device="cpu")
        real_model(m, device)

    def move_optimizer(opt, device):
        if torch.device(device).type == "cpu":
            for state in opt.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.is_meta:
                        state[k] = torch.empty_like(v, device="cpu")
        real_optimizer(opt, device)

    monkeypatch.setattr(offload, "move_model", move_model)
    monkeypatch.setattr(offload, "move_optimizer_state", move_optimizer)


def role_optimizer(worker):
    return worker.actor.optimizer if hasattr(worker, "actor") else worker.critic.optimizer


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("optimizer_too", [False, True], ids=["offload_params", "offload_params+optimizer"])
def test_resume_with_offload_puts_every_state_on_the_param_device(tmp_path, tiny_model_dir, emulated_gpu, role,
                                                                  optimizer_too):
    """save -> load_checkpoint (outside a phase, as a resume or a restart runs it) -> the update's
    phase: every restored state, fused AdamW's ``step`` included, on the parameters' device."""
    from fitrl.roles.workers import CriticWorker, PolicyWorker

    cls = PolicyWorker if role == "actor" else CriticWorker
    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.device=cpu", f"{role}.fsdp.offload_params=true",
                     f"{role}.fsdp.offload_optimizer={str(optimizer_too).lower()}")
    saver = cls(cfg, rank=0, world_size=1)
    opt = role_optimizer(saver)
    for p in saver.model.parameters():
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    opt.step()
    saver.save_checkpoint(str(tmp_path / "ckpt"))

    worker = cls(cfg, rank=0, world_size=1)
    opt = role_optimizer(worker)
    assert opt.param_groups[0]["fused"]  # the kernel that reads step on the device
    worker.offload = OffloadBetweenPhases(worker.model, getattr(cfg, role).fsdp, META, opt)
    worker.load_checkpoint(str(tmp_path / "ckpt"))
    assert opt.state, "the checkpoint restored no optimizer state"
    with worker.offload.phase(needs_optimizer=True):
        assert next(worker.model.parameters()).is_meta
        wrong = optimizer_state_misplaced(opt)
    assert wrong == []
    steps = {s["step"].device for s in opt.state.values()}
    assert steps == {torch.device("cpu") if optimizer_too else META}  # between phases: with its moments


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_resumed_fused_adamw_steps_on_cuda_with_offload(tmp_path, tiny_model_dir):
    """On a GPU: the first update after a resume with both offloads runs (it raised with fused
    AdamW's step left on the host)."""
    from fitrl.roles.workers import PolicyWorker

    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.device=cuda", "actor.fsdp.offload_params=true",
                     "actor.fsdp.offload_optimizer=true")
    saver = PolicyWorker(cfg, rank=0, world_size=1)
    with saver.offload.phase(needs_optimizer=True):
        for p in saver.model.parameters():
            p.grad = torch.ones_like(p)
        saver.actor.optimizer.step()
    saver.save_checkpoint(str(tmp_path / "ckpt"))
    worker = PolicyWorker(cfg, rank=0, world_size=1)
    worker.load_checkpoint(str(tmp_path / "ckpt"))
    with worker.offload.phase(needs_optimizer=True):
        assert optimizer_state_misplaced(worker.actor.optimizer) == []
        for p in worker.model.parameters():
            p.grad = torch.ones_like(p)
        worker.actor.optimizer.step()
        torch.cuda.synchronize()
