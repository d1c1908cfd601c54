"""No tensor of a training step waits for Python's cyclic collector.

A tensor held only by a reference cycle is freed at the collector's next full collection, not
when its phase ends, and the oldest generation is collected rarely in a process that has
imported torch: such tensors sit beside the next phase's peak, which the memory plan does not
count (the decode loop's KV cache did this, one cache per rollout into the update:
bench/RESULTS.md, "Every rollout's KV cache outlived its decode loop")."""

from __future__ import annotations

import gc

import torch

from helpers import toy_config as config

MIN_BYTES = 64 * 1024  # a tiny model's smallest activation or cache block is larger


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # meta or wrapper tensors hold no memory here
        return 0


def test_no_step_leaves_a_tensor_in_a_reference_cycle(tiny_model_dir, tmp_path, monkeypatch):
    """After every step (KL on: the reference runs too), what only the cyclic collector would free
    holds no tensor: the collector is off during the run, and a collection after each step keeps
    what it finds (``DEBUG_SAVEALL``) instead of freeing it."""
    from fitrl.trainer import loop
    from fitrl.trainer.run import train

    found: list[tuple[int, tuple, torch.dtype]] = []
    run_step = loop.RLTrainer.run_step

    def checked_step(self, step):
        out = run_step(self, step)
        gc.collect()
        found.extend((step, tuple(o.shape), o.dtype) for o in gc.garbage
                     if isinstance(o, torch.Tensor) and _nbytes(o) >= MIN_BYTES)
        gc.garbage.clear()
        return out

    monkeypatch.setattr(loop.RLTrainer, "run_step", checked_step)
    cfg = config(tiny_model_dir, tmp_path / "run", "trainer.max_steps=2", "rollout.n=4", "actor.mini_batch_size=4",
                 "actor.micro_batch_size=8", "trainer.val_freq=0", "trainer.val_before_train=false",
                 "checkpoint.save_freq=0", "checkpoint.save_final=false", "algorithm.use_kl_loss=true")
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable lands in gc.garbage
    try:
        train(cfg)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not found, f"{len(found)} tensors freed only by the cyclic collector (step, shape, dtype): {found[:6]}"
