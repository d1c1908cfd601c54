"""Checkpoint save (and load) time and host memory for the ``small`` tiny model with its AdamW state.

Each rank process builds the model (plain in one process, as the in-process backend does;
FSDP2-sharded over gloo with N ranks, as the Ray backend does), takes one optimizer step so the
AdamW moments exist, and then, timed:

  ``save``      fitrl's save: ``fitrl.checkpoint.sharded.save_role`` (torch.distributed.checkpoint;
                every rank writes its own shards);
  ``gathered``  the naive alternative, for comparison (N > 1 only): gather the full model and
                optimizer state onto rank 0's host (``get_state_dict(full_state_dict=True,
                cpu_offload=True)``) and ``torch.save`` it there;
  ``load``      fitrl's resume: ``load_role`` into a fresh copy whose AdamW moments already exist
                (they are resident state either way; the figure is the load's own overhead).

Reported per rank: wall time and the high-water mark of host memory above the RSS just before
the phase (VmHWM, reset with /proc/self/clear_refs). Files are fsynced (DCP's default), so the
times include the disk.

    .venv/bin/python bench/checkpoint_save.py                  # 1 and 2 ranks, small model
    .venv/bin/python bench/checkpoint_save.py --ranks 1 --size tiny
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

from fitrl.telemetry.memory import GIB, peak_rss_bytes, reset_peak_rss, status_kib, trim_heap


def _measure(fn) -> tuple[float, float]:
    """(seconds, GiB of host memory above the RSS before ``fn``)."""
    gc.collect()
    trim_heap()  # freed heap back to the OS: a phase cannot hide in the last one's
    base = status_kib("VmRSS") * 1024
    if not reset_peak_rss():  # VmHWM := current RSS
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): the peak would be the lifetime one")
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start, (peak_rss_bytes() - base) / GIB


def _build(model_dir: str):
    import torch

    from fitrl.config.schema import FSDPConfig, ModelConfig, OptimConfig
    from fitrl.models.loading import build_model
    from fitrl.roles.actor import build_optimizer

    model = build_model("causal_lm", ModelConfig(path=model_dir), FSDPConfig(), torch.device("cpu"))
    return model, build_optimizer(model, OptimConfig(lr=1e-5))


def rank_main(rank: int, world: int, port: int, model_dir: str, out: str, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, get_state_dict

    from fitrl.checkpoint.sharded import load_role, save_role

    model, optim = _build(model_dir)
    ids = torch.randint(0, 500, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()  # the AdamW moments now exist: 2 fp32 copies of the weights
    optim.zero_grad(set_to_none=True)
    barrier = dist.barrier if world > 1 else (lambda: None)

    row = {}
    barrier()
    row["save"] = _measure(lambda: (save_role(out, model, optim, {"step": 1}, rank=rank), barrier()))
    if world > 1:
        def gathered():
            full = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                torch.save(full, os.path.join(out, "full.pt"))
            barrier()
        row["gathered"] = _measure(gathered)
    del model, optim
    fresh, fresh_optim = _build(model_dir)
    get_optimizer_state_dict(fresh, fresh_optim)  # creates the moments: resident state, not load overhead
    barrier()
    row["load"] = _measure(lambda: (load_role(out, fresh, fresh_optim, rank=rank, what="bench"), barrier()))
    results[rank] = row
    if world > 1:
        dist.destroy_process_group()


def measure(world: int, model_dir: str, port: int) -> dict:
    out = tempfile.mkdtemp(prefix="fitrl-ckpt-bench-")
    try:
        ctx = mp.get_context("spawn")
        results = ctx.Manager().dict()
        procs = [ctx.Process(target=rank_main, args=(r, world, port, model_dir, out, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a rank failed with {world} ranks")
        sharded = sum(f.stat().st_size for f in Path(out).iterdir() if f.suffix == ".distcp" or f.name == ".metadata")
        return {"ranks": world, "rows": [results[r] for r in range(world)], "bytes": sharded}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--size", default="small")
    args = parser.parse_args()
    from fitrl.models.tiny import describe, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(Path(tmp) / "m", arch="qwen2", size=args.size))
        info = describe(model_dir)
        results = [measure(world, model_dir, 29700 + world) for world in args.ranks]
    params = info["params"]
    print(f"qwen2 {args.size}: {params / 1e6:.1f}M params; fp32 weights {params * 4 / GIB:.3f} GiB, "
          f"+ AdamW moments {params * 8 / GIB:.3f} GiB")
    print("seconds (slowest rank) and host memory above each rank's RSS before the phase (GiB, VmHWM per rank)")
    print(f"{'ranks':>5} | {'phase':>8} | {'seconds':>7} | {'per-rank peak GiB':>18} | {'on disk GiB':>11}")
    for r in results:
        for phase in ("save", "gathered", "load"):
            if phase not in r["rows"][0]:
                continue
            secs = max(row[phase][0] for row in r["rows"])
            peaks = " ".join(f"{row[phase][1]:.3f}" for row in r["rows"])
            disk = f"{r['bytes'] / GIB:.3f}" if phase == "save" else ""
            print(f"{r['ranks']:>5} | {phase:>8} | {secs:>7.2f} | {peaks:>18} | {disk:>11}")


if __name__ == "__main__":
    main()
