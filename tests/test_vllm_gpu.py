"""The vLLM engine on a CUDA GPU: sleep levels free what they say, a push after wake is exact, and
what a push costs in time and host memory per GB of weights. Marked ``gpu`` and ``vllm``; skipped
without CUDA or without vLLM's CUDA build (``pip install 'fitrl[vllm]'``). Never run in this
repository's CI (no GPU) nor on the lent GPU machines (vLLM's CUDA wheel cannot be installed
there): docs/vllm.md says so."""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from fitrl.roles.workers import PolicyWorker  # noqa: E402
from vllm_helpers import prompts_from, trainer_logprobs, vllm_config  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from fitrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "medium", arch="qwen2", size="medium", seed=0)


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def weight_bytes(worker) -> int:
    return sum(t.numel() * t.element_size() for _, t in worker.params.inference_weights(worker.model))


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_kv_cache_and_by_level_the_weights(model_dir, tmp_path, level):
    kv = 1 << 30
    w = PolicyWorker(vllm_config(model_dir, tmp_path, "trainer.device=cuda", f"rollout.sleep_level={level}",
                                 "rollout.kv_cache_memory=1GiB"), rank=0, world_size=1)
    w.generate(prompts_from(w, 4), w.cfg.rollout.sampling())  # ends asleep
    asleep = free_bytes()
    w.rollout.wake()
    awake = free_bytes()
    freed = awake - asleep
    assert freed < 0  # waking takes memory back ...
    expected = kv + (weight_bytes(w) if level == 2 else 0)
    assert -freed >= 0.9 * expected, (level, -freed, expected)  # ... the KV cache, and at level 2 the weights
    seq = prompts_from(w, 1)["prompt_ids"][0] + [7, 8, 9]
    assert (w.rollout.sequence_logprobs([seq])[0] - trainer_logprobs(w.model, seq)).abs().max() <= 1e-4


def test_push_time_and_host_memory_per_gb(model_dir, tmp_path):
    import psutil

    w = PolicyWorker(vllm_config(model_dir, tmp_path, "trainer.device=cuda", "rollout.sleep_level=0",
                                 "rollout.kv_cache_memory=1GiB"), rank=0, world_size=1)
    w.generate(prompts_from(w, 2), w.cfg.rollout.sampling())
    proc, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    base = proc.memory_info().rss
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        w.rollout.push_weights()
    finally:
        done.set()
        sampler.join()
    gb = weight_bytes(w) / 1e9
    seconds, host = w.rollout.last_push["seconds"], (peak[0] - base) / 1e9
    print(f"push: {gb:.3f} GB of weights in {seconds:.3f} s ({seconds / gb:.3f} s/GB), host +{host:.3f} GB "
          f"({host / gb:.3f} GB per GB)")
    assert host / gb < 0.25  # device to device: the host never holds the weights


def test_engine_is_asleep_once_built_and_auto_discards_the_weights(model_dir, tmp_path):
    """rollout.sleep_level=auto in a training run: the engine sleeps at level 2 as soon as it is
    built (the roles loading after it find the memory free), and its first wake pushes the
    trainer's weights exactly."""
    before = free_bytes()
    w = PolicyWorker(vllm_config(model_dir, tmp_path, "trainer.device=cuda", "rollout.kv_cache_memory=1GiB"),
                     rank=0, world_size=1)
    assert not w.rollout.awake and w.rollout.sleep_level == 2
    held = before - free_bytes() - weight_bytes(w)  # what the engine keeps asleep, beside the trainer's model
    print(f"asleep once built: {held / 2**20:.0f} MiB held beside the trainer's weights")
    assert held < (1 << 30) // 2  # neither the KV cache nor the engine's weights
    seq = prompts_from(w, 1)["prompt_ids"][0] + [7, 8, 9]
    assert (w.rollout.sequence_logprobs([seq])[0] - trainer_logprobs(w.model, seq)).abs().max() <= 1e-4
