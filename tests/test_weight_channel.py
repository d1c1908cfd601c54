"""The weight channel to rollout workers of their own (fitrl/distributed/weight_sync.py,
``rollout.weight_transport``): a broadcast in buckets between three processes with gloo, bit-exact;
a Ray run whose worker gets its weights over it as the object-store run's does; ``auto`` per
device."""

from __future__ import annotations

import io
import multiprocessing

import pytest
import torch
from helpers import read_metrics, toy_config

from fitrl.config import ConfigError
from fitrl.distributed.weight_sync import WeightChannel, open_rendezvous, resolve_transport
from fitrl.trainer.run import train

LEAN = ("trainer.val_before_train=false", "trainer.val_freq=0", "data.val_files=[]", "reward.num_workers=0",
        "checkpoint.save_final=false")


def _receive(address, rank: int, versions: int, out) -> None:
    channel = WeightChannel(address, rank, torch.device("cpu"))
    for _ in range(versions):
        buf = io.BytesIO()
        torch.save(channel.receive(), buf)  # bytes: a tensor's shared memory would die with this process
        out.put((rank, buf.getvalue()))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # bit for bit (NaNs included)


def _tiny_weights(model_dir) -> dict[str, torch.Tensor]:
    from fitrl.config.schema import FSDPConfig, ModelConfig
    from fitrl.distributed.state import stream_full_tensors
    from fitrl.models.loading import build_model

    model = build_model("causal_lm", ModelConfig(path=str(model_dir)), FSDPConfig(), torch.device("cpu"))
    return dict(stream_full_tensors(model))


@pytest.mark.parametrize("bucket_bytes", [4096, 64 << 20], ids=["smaller-than-a-tensor", "larger-than-all"])
def test_a_broadcast_in_buckets_arrives_bit_exact_at_every_worker(tiny_model_dir, bucket_bytes):
    """Rank 0 (this process) sends a tiny model's weights twice, as they are (fp32) and in bf16, to
    two spawned processes: each receives every tensor under its name, bit for bit, in its dtype and
    shape. 4 KiB buckets: tensors larger than a bucket go on their own, the small ones (norms) share
    buckets; 64 MiB: the whole model in one bucket."""
    weights = _tiny_weights(tiny_model_dir)
    sizes = [t.numel() * t.element_size() for t in weights.values()]
    assert min(sizes) < bucket_bytes // 4 and (max(sizes) > bucket_bytes or sum(sizes) < bucket_bytes)
    as_bf16 = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    ctx = multiprocessing.get_context("spawn")
    store, address = open_rendezvous("127.0.0.1", 3, timeout_s=120)
    out = ctx.Queue()
    procs = [ctx.Process(target=_receive, args=(address, rank, 2, out), daemon=True) for rank in (1, 2)]
    for p in procs:
        p.start()
    try:
        channel = WeightChannel(address, 0, torch.device("cpu"), store=store)
        buckets = [channel.send(iter(w.items()), bucket_bytes) for w in (weights, as_bf16)]
        got: dict[int, list] = {1: [], 2: []}
        for _ in range(4):
            rank, received = out.get(timeout=120)
            got[rank].append(torch.load(io.BytesIO(received)))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if bucket_bytes > sum(sizes):
        assert buckets == [1, 1]
    else:  # every tensor over a bucket alone, and the rest packed: fewer buckets than tensors
        big = sum(s > bucket_bytes for s in sizes)
        assert big < buckets[0] < len(weights), (buckets, big, len(weights))
    for rank in (1, 2):
        for sent, received in zip((weights, as_bf16), got[rank]):
            assert list(received) == list(sent)
            for name, t in sent.items():
                r = received[name]
                assert r.dtype == t.dtype and r.shape == t.shape, name
                assert torch.equal(_bits(r), _bits(t)), name


def test_auto_is_the_collective_on_cuda_under_ray_and_the_object_store_elsewhere():
    assert resolve_transport("auto", "cuda", "ray") == "collective"
    assert resolve_transport("auto", "cpu", "ray") == "object_store"  # CPU runs keep today's path
    assert resolve_transport("auto", "cuda", "inprocess") == "object_store"  # a thread: no copy at all
    assert resolve_transport("collective", "cpu", "ray") == "collective"  # gloo, as the CPU tests use it
    assert resolve_transport("object_store", "cuda", "ray") == "object_store"
    with pytest.raises(ValueError, match="not one of"):
        resolve_transport("nccl", "cuda", "ray")


def test_the_collective_needs_ray(tiny_model_dir, tmp_path):
    assert toy_config(tiny_model_dir, tmp_path, "rollout.workers=1").rollout.weight_transport == "auto"
    with pytest.raises(ConfigError, match="needs trainer.backend=ray"):
        toy_config(tiny_model_dir, tmp_path, "rollout.workers=1", "rollout.weight_transport=collective")
    with pytest.raises(ConfigError, match="weight_bucket_mb"):
        toy_config(tiny_model_dir, tmp_path, "rollout.weight_bucket_mb=0")


STEP_KEYS = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response/length_mean", "rollout/staleness_max")


@pytest.mark.slow
def test_a_worker_fed_by_the_channel_trains_as_one_fed_by_the_object_store(tiny_model_dir, tmp_path, ray_cluster):
    """rollout.workers=1, one_step_off, 3 steps under Ray on CPU: with weight_transport=collective
    (gloo) the worker's engine gets each version over the channel, in several buckets, and samples
    exactly what it samples from the object store's copy: the same rewards, losses and gradients
    step by step (the samples of steps 2 and 3 come from pushed versions 0 and 1)."""
    runs = {}
    for transport in ("object_store", "collective"):
        cfg = toy_config(tiny_model_dir, tmp_path / transport, "rollout.mode=one_step_off", "trainer.backend=ray",
                         "trainer.devices_per_node=1", "trainer.max_steps=3", "rollout.weight_bucket_mb=0.1",
                         f"rollout.weight_transport={transport}", *LEAN)
        train(cfg)
        runs[transport] = [r for r in read_metrics(tmp_path / transport) if "event" not in r and "reward/mean" in r]
    assert len(runs["collective"]) == 3
    assert all(r["rollout/weight_buckets"] > 1 for r in runs["collective"])  # 100 KiB buckets: the model in several
    assert not any("rollout/weight_buckets" in r for r in runs["object_store"])
    for a, b in zip(runs["object_store"], runs["collective"]):
        assert {k: a[k] for k in STEP_KEYS} == {k: b[k] for k in STEP_KEYS}


def _rebuilt(handle: str) -> str:
    return f"opened {handle}"


class _DeviceTensorStandIn:
    """Where a CPU can only stand in for a CUDA tensor: what :func:`to_wire` asks of one."""

    is_cuda = True

    def detach(self):
        return self

    def contiguous(self):
        return self


def test_tp_workers_get_host_tensors_on_cpu_and_ipc_handles_of_device_tensors_on_cuda(monkeypatch):
    """vLLM's ``workers`` TP layout (fitrl/rollout/tensor_ipc.py): a host tensor goes as itself; a
    device tensor as torch's CUDA IPC description (reduce_tensor), which survives the pickling of
    vLLM's message queue and opens into a tensor on the worker's side. Only a GPU can open a real
    handle."""
    import pickle

    import torch.multiprocessing.reductions as reductions

    from fitrl.rollout.tensor_ipc import CudaIpcTensor, from_wire, to_wire

    t = torch.arange(6.0).view(2, 3)
    assert isinstance(to_wire(t), torch.Tensor) and torch.equal(from_wire(to_wire(t)), t)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda x: (_rebuilt, ("handle-0",)))
    wire = to_wire(_DeviceTensorStandIn())
    assert isinstance(wire, CudaIpcTensor)
    assert from_wire(pickle.loads(pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL))) == "opened handle-0"
