"""Rank-0 initialisation vs every rank reading the checkpoint (docs/architecture.md, "Failure stories").

N CPU ranks (gloo) build the small model under FSDP2. ``rank0``: rank 0 reads the checkpoint
and broadcasts into the shards, the others build on the meta device; ``every_rank``: each rank
reads the whole checkpoint, then shards it. Reported: load time (slowest rank) and the peak,
over the load, of the summed RSS of all rank processes above their summed RSS just before
loading (after a warm-up build of the tiny model of the same architecture), sampled every 10 ms;
and each rank's own high-water mark (VmHWM, reset just before loading).

    .venv/bin/python bench/rank0_init.py                 # 2 and 4 ranks, small model
    .venv/bin/python bench/rank0_init.py --size medium   # 0.2B parameters
    .venv/bin/python bench/rank0_init.py --ranks 2 --size tiny
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch.multiprocessing as mp

from fitrl.telemetry.memory import GIB, peak_rss_bytes, reset_peak_rss, status_kib


def rank_main(rank: int, world: int, port: int, model_dir: str, warmup_dir: str, init: str, ready, go, done,
              times) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import fitrl.sharding  # noqa: F401  (registers the FSDP2 backend build_model shards with)
    from fitrl.config.schema import ActorConfig, FSDPConfig, ModelConfig
    from fitrl.models.loading import build_model

    # Warm up with the tiny model of the same architecture, so the lazy imports and the
    # collective buffers are in the baseline and the measurement is the model's memory alone.
    build_model("causal_lm", ModelConfig(path=warmup_dir), ActorConfig(fsdp=FSDPConfig(init=init)), torch.device("cpu"))
    import gc

    gc.collect()
    ready.wait()
    go.wait()
    base = status_kib("VmRSS") * 1024
    if not reset_peak_rss():
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): the peak would be the lifetime one")
    start = time.perf_counter()
    model = build_model("causal_lm", ModelConfig(path=model_dir), ActorConfig(fsdp=FSDPConfig(init=init)), torch.device("cpu"))
    dist.barrier()
    times[rank] = (time.perf_counter() - start, (peak_rss_bytes() - base) / GIB)
    done.wait()
    del model
    dist.destroy_process_group()


def measure(world: int, model_dir: str, warmup_dir: str, init: str, port: int) -> dict:
    ctx = mp.get_context("spawn")
    ready, go, done = ctx.Barrier(world + 1), ctx.Barrier(world + 1), ctx.Barrier(world + 1)
    times = ctx.Manager().dict()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, model_dir, warmup_dir, init, ready, go, done, times))
             for r in range(world)]
    for p in procs:
        p.start()
    ready.wait()
    handles = [psutil.Process(p.pid) for p in procs]
    baseline = sum(h.memory_info().rss for h in handles)
    peak, stop = [baseline], threading.Event()

    def sample():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], sum(h.memory_info().rss for h in handles))
            except psutil.NoSuchProcess:
                return
            time.sleep(0.01)

    thread = threading.Thread(target=sample)
    thread.start()
    go.wait()
    while len(times) < world:
        time.sleep(0.01)
    stop.set()
    thread.join()
    done.wait()
    for p in procs:
        p.join()
    per_rank = [times[r][1] for r in range(world)]
    return {"ranks": world, "init": init, "seconds": max(t for t, _ in times.values()),
            "peak_gib": (peak[0] - baseline) / GIB, "rank_peaks": per_rank, "sum_rank_peaks": sum(per_rank)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--size", default="small")
    args = parser.parse_args()
    from fitrl.models.tiny import describe, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(Path(tmp) / "m", arch="qwen2", size=args.size))
        warmup_dir = str(make_tiny_model(Path(tmp) / "warm", arch="qwen2", size="tiny"))
        info = describe(model_dir)
        size_gib = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / GIB
        rows = []
        port = 29600
        for world in args.ranks:
            for init in ("rank0", "every_rank"):
                port += 1
                rows.append(measure(world, model_dir, warmup_dir, init, port))
    print(f"qwen2 {args.size}: {info['params'] / 1e6:.1f}M params, checkpoint {size_gib:.3f} GiB (fp32)")
    print("host memory above each rank's RSS before loading, GiB: per-rank high-water marks (VmHWM) and their sum,"
          " and the sampled peak of the summed RSS of all ranks")
    print(f"{'ranks':>5} | {'init':>10} | {'load s':>7} | {'per-rank peaks':>28} | {'sum':>6} | {'sampled total':>13}")
    for r in rows:
        peaks = " ".join(f"{p:.2f}" for p in r["rank_peaks"])
        print(f"{r['ranks']:>5} | {r['init']:>10} | {r['seconds']:>7.2f} | {peaks:>28} | {r['sum_rank_peaks']:>6.2f} | "
              f"{r['peak_gib']:>13.2f}")


if __name__ == "__main__":
    main()
