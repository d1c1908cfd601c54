"""Rank-0 initialisation vs every rank reading the checkpoint (DESIGN §1, story 5).

N CPU ranks (gloo) build the small model under FSDP2. ``rank0``: rank 0 reads the checkpoint
and broadcasts into the shards, the others build on the meta device; ``every_rank``: each rank
reads the whole checkpoint, then shards it. Reported: load time (slowest rank) and the peak,
over the load, of the summed RSS of all rank processes above their summed RSS just before
loading (torch and transformers already imported), sampled every 10 ms.

    .venv/bin/python bench/rank0_init.py                 # 2 and 4 ranks, small model
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

GIB = 1024**3


def rank_main(rank: int, world: int, port: int, model_dir: str, init: str, ready, go, done, times) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from fitrl.config.schema import FSDPConfig, ModelConfig
    from fitrl.models.parallelize import build_model
    import transformers  # noqa: F401  (imported before the baseline is taken)

    ready.wait()
    go.wait()
    start = time.perf_counter()
    model = build_model("causal_lm", ModelConfig(path=model_dir), FSDPConfig(init=init), torch.device("cpu"))
    dist.barrier()
    times[rank] = time.perf_counter() - start
    done.wait()
    del model
    dist.destroy_process_group()


def measure(world: int, model_dir: str, init: str, port: int) -> dict:
    ctx = mp.get_context("spawn")
    ready, go, done = ctx.Barrier(world + 1), ctx.Barrier(world + 1), ctx.Barrier(world + 1)
    times = ctx.Manager().dict()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, model_dir, init, ready, go, done, times))
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
    return {"ranks": world, "init": init, "seconds": max(times.values()), "peak_gib": (peak[0] - baseline) / GIB,
            "baseline_gib": baseline / GIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--size", default="small")
    args = parser.parse_args()
    from fitrl.models.tiny import describe, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(Path(tmp) / "m", arch="qwen2", size=args.size))
        info = describe(model_dir)
        size_gib = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / GIB
        rows = []
        port = 29600
        for world in args.ranks:
            for init in ("rank0", "every_rank"):
                port += 1
                rows.append(measure(world, model_dir, init, port))
    print(f"qwen2 {args.size}: {info['params'] / 1e6:.1f}M params, checkpoint {size_gib:.3f} GiB (fp32)")
    print(f"{'ranks':>5} | {'init':>10} | {'load s':>7} | {'host GiB over baseline (all ranks)':>35}")
    for r in rows:
        print(f"{r['ranks']:>5} | {r['init']:>10} | {r['seconds']:>7.2f} | {r['peak_gib']:>35.3f}")


if __name__ == "__main__":
    main()
