"""Building the vLLM engine of one policy rank (fitrl/rollout/vllm_engine.py runs it): where its
tensor-parallel shards live, the checks that turn vLLM's long failures into one line, and what
building it must not do to the trainer's process.

Three layouts (:func:`engine_layout`, docs/vllm.md "Tensor parallelism"):

- ``own``: ``rollout.tensor_parallel_size`` 1; the engine is this process (vLLM's in-process
  mode), one per policy rank.
- ``shared``: tp > 1 with several policy ranks; ``tp`` consecutive ranks form one engine, each
  holding one TP shard in its own process (vLLM's ``external_launcher`` executor over the
  policy's process group). Every rank of a group submits the same requests and draws from the
  same RNG state; on a GPU node each rank keeps its own GPU.
- ``workers``: tp > 1 with one policy rank; the engine core stays in this process and its TP
  workers are processes of vLLM's multiprocess executor, tied to this process's life.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from fitrl.config.plan import parse_bytes
from fitrl.config.schema import RolloutConfig
from fitrl.core.errors import ConfigError, EngineError
from fitrl.data.media import MediaSpec
from fitrl.rollout.engine import EngineContext

SUPPORTED_VLLM = ("0.32.",)
"""vLLM releases this engine was written and tested against (its worker extension touches the
sampler and the in-place weight reload, which change between releases)."""
CPU_KV_CACHE = "256MiB"
"""KV cache on CPU when ``rollout.kv_cache_memory`` is unset (vLLM's own CPU default takes
several GiB of host memory)."""
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vLLM 0.32's CPU backend runs."""


@dataclass(frozen=True)
class EngineLayout:
    """Where one rank's engine keeps its TP shards."""

    mode: str
    """``own``, ``shared`` or ``workers`` (module docstring)."""
    tp: int
    rank: int = 0
    """This process's rank in the policy's process group (0 without one)."""
    world: int = 1

    @property
    def group(self) -> list[int]:
        """The policy ranks of this rank's engine (``shared``: ``tp`` consecutive ranks, as vLLM
        lays out its TP groups over the process group; otherwise this rank alone)."""
        if self.mode != "shared":
            return [self.rank]
        first = self.rank // self.tp * self.tp
        return list(range(first, first + self.tp))


def engine_layout(tp: int) -> EngineLayout:
    """The layout for ``rollout.tensor_parallel_size`` = ``tp`` in this process's policy group."""
    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    if tp == 1:
        return EngineLayout("own", 1, rank, world)
    if world == 1:
        return EngineLayout("workers", tp, rank, world)
    if world % tp:
        raise ConfigError(f"rollout.tensor_parallel_size={tp} with {world} policy ranks: each engine spans {tp} "
                          f"consecutive ranks, so the ranks must be a multiple of {tp}; set "
                          f"rollout.tensor_parallel_size to a divisor of {world}")
    return EngineLayout("shared", tp, rank, world)


def build_llm(cfg: RolloutConfig, context: EngineContext, model: torch.nn.Module, layout: EngineLayout, *, cuda: bool,
              sleep: bool, vision: Optional[MediaSpec] = None):
    """The vLLM ``LLM`` for this rank, or one line saying why it cannot be built. ``shared``: a
    collective over the policy's process group (every rank builds at the same point). ``vision``:
    the model's vision settings (None for a text model)."""
    # in-process engine core: no engine process to orphan, weights passed as tensors. Set before
    # vLLM reads its environment (it reads it lazily, at engine construction).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM logs every engine step's housekeeping at INFO; fitrl's console shows the run's own lines
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"rollout.engine=vllm needs vLLM ({e}): pip install 'fitrl[vllm]' on a CUDA machine, or "
                          "`make .venv-vllm` for the CPU build (docs/vllm.md); or set rollout.engine=hf") from None
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise ConfigError(f"rollout.engine=vllm: vLLM {vllm.__version__} is installed but fitrl's engine supports vLLM "
                          f"{', '.join(v + 'x' for v in SUPPORTED_VLLM)}: pip install 'fitrl[vllm]'")
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    if not cuda and head not in CPU_HEAD_SIZES:
        raise ConfigError(f"rollout.engine=vllm on CPU: {context.model_path} has attention heads of size {head}, which "
                          f"vLLM's CPU backend does not run (sizes {', '.join(map(str, CPU_HEAD_SIZES))}); use "
                          "rollout.engine=hf, or a model with such heads (fitrl make-tiny-model --head-dim 32)")
    if layout.tp > 1:
        check_tensor_parallel(layout, text_cfg, context.model_path, cuda=cuda)
    kwargs = llm_kwargs(cfg, context, layout, cuda=cuda, sleep=sleep, vision=vision)
    if layout.mode == "workers" and not cuda:  # its TP workers are processes, spawned
        bind_cpu_workers(layout.tp)
    # each push warns that rotary embeddings (which have no weights) "failed to load"
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        lambda record: "Failed to load weights" not in record.getMessage())
    # vLLM freezes its environment variables once an engine is built in a process; a later
    # engine here (a test's, or this one's TP binding) must see the current ones
    import vllm.envs

    vllm.envs.disable_envs_cache()
    try:
        with trainer_process_kept(), device_rank_for_vllm(layout, cuda):
            return vllm.LLM(**kwargs)
    except Exception as e:  # vLLM's own errors are long; the first line names the cause
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise EngineError(f"vLLM could not build its engine for {context.model_path}: {first}") from e


def llm_kwargs(cfg: RolloutConfig, context: EngineContext, layout: EngineLayout, *, cuda: bool, sleep: bool,
               vision: Optional[MediaSpec] = None) -> dict[str, Any]:
    """The arguments of this rank's ``vllm.LLM`` (pure: no vLLM import, nothing set)."""
    kwargs: dict[str, Any] = dict(
        model=context.model_path, tokenizer=context.tokenizer_path or context.model_path,
        dtype=context.dtype, seed=context.seed, max_model_len=context.max_model_len,
        enforce_eager=cfg.enforce_eager or not cuda, enable_prefix_caching=cfg.enable_prefix_caching,
        logprobs_mode="processed_logprobs",  # sampler output the worker extension replaces (untruncated)
        load_format="dummy",  # never read the checkpoint: the first wake pushes the trainer's weights
        worker_extension_cls="fitrl.rollout.vllm_worker.FitrlWorkerExtension",
        enable_sleep_mode=sleep, disable_log_stats=True, tensor_parallel_size=layout.tp,
    )
    if layout.mode == "workers":  # the engine core stays here; its TP workers are processes
        kwargs["distributed_executor_backend"] = "mp"
    elif layout.mode == "shared":  # this process is one TP shard; vLLM builds its groups over the policy's
        kwargs["distributed_executor_backend"] = "external_launcher"
        # each shard is a Ray actor that sees its own GPU alone (as device 0): custom all-reduce's
        # peer-to-peer buffers between the shards' GPUs cannot be set up across them (veRL and
        # EasyR1 turn it off here too); NCCL's all-reduce serves instead
        kwargs["disable_custom_all_reduce"] = True
    if cfg.kv_cache_memory or not cuda:
        kwargs["kv_cache_memory_bytes"] = parse_bytes(cfg.kv_cache_memory or CPU_KV_CACHE, "rollout.kv_cache_memory")
    else:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if context.limit_images:
        videos = context.limit_images if vision is not None and vision.supports_video else 0
        kwargs["limit_mm_per_prompt"] = {"image": context.limit_images, "video": videos}
    return kwargs


def check_vllm_installed(engines: set[str]) -> None:
    """Before Ray starts or a model loads: a run whose engines include vLLM in an environment
    without it is one line now, not a worker's error after the cluster and the model came up.
    ``find_spec`` looks for the package without importing it (vLLM's import takes seconds)."""
    if "vllm" not in engines:
        return
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or blocked package: as absent
        found = False
    if not found:
        raise ConfigError("rollout.engine=vllm needs vLLM (not installed in this environment): pip install "
                          "'fitrl[vllm]' on a CUDA machine, or `make .venv-vllm` for the CPU build (docs/vllm.md); "
                          "or set rollout.engine=hf")


def check_tensor_parallel(layout: EngineLayout, text_cfg, model_path: str, *, cuda: bool) -> None:
    """One line for what ``rollout.tensor_parallel_size`` > 1 cannot run, naming the fix."""
    tp = layout.tp
    for what, n in (("attention heads", text_cfg.num_attention_heads),
                    ("intermediate size", getattr(text_cfg, "intermediate_size", None))):
        if isinstance(n, int) and n % tp:
            divisors = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 64)
            raise ConfigError(f"rollout.tensor_parallel_size={tp}: {model_path}'s {n} {what} do not split into {tp} "
                              f"shards; use one of {divisors}")
    kv = getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads
    if kv % tp and tp % kv:  # vLLM shards KV heads, or replicates them over a multiple of their count
        raise ConfigError(f"rollout.tensor_parallel_size={tp}: {model_path}'s {kv} key/value heads neither split "
                          f"into {tp} shards nor divide {tp}; use a divisor or a multiple of {kv}")
    if layout.mode == "shared":
        return  # one shard per policy rank: its GPU, or its cores
    if cuda and tp > torch.cuda.device_count():
        raise ConfigError(f"rollout.tensor_parallel_size={tp}: this process sees {torch.cuda.device_count()} GPU(s) "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}) and each TP worker "
                          "takes one; make more visible or lower rollout.tensor_parallel_size")
    if not cuda and tp > len(os.sched_getaffinity(0)):
        raise ConfigError(f"rollout.tensor_parallel_size={tp}: this process may run on "
                          f"{len(os.sched_getaffinity(0))} CPU core(s) and each TP worker needs one at least; "
                          "lower rollout.tensor_parallel_size")


def bind_cpu_workers(tp: int) -> None:
    """vLLM binds each CPU TP worker's OpenMP threads to one NUMA node of its own and refuses
    more workers than nodes (``utils/ompmultiprocessing.py``). Where the machine has fewer nodes
    and ``VLLM_CPU_OMP_THREADS_BIND`` is unset, the cores this process may use are split into
    ``tp`` contiguous groups instead (``0,1|2,3``), one per worker."""
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    global _cpu_binding
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", _cpu_binding) != _cpu_binding:  # the user's own
        return
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # an earlier engine's split, for another tp
    if len(get_visible_memory_node()) >= tp:
        return
    cores = sorted(os.sched_getaffinity(0))
    groups = [cores[i * len(cores) // tp:(i + 1) * len(cores) // tp] for i in range(tp)]
    _cpu_binding = os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)


_cpu_binding = None  # the split bind_cpu_workers last set


@contextmanager
def trainer_process_kept():
    """Undo what building an in-process engine does to the trainer's process: vLLM seeds the
    global RNGs (Python, NumPy, torch) with its own seed, and its CPU worker drops torch to one
    thread and replaces ``torch.set_num_threads`` with a no-op. The trainer's RNG streams (part of
    exact resume) and its thread count (``trainer.num_threads``) are restored afterwards."""
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        torch.set_num_threads = set_threads
        set_threads(threads)


@contextmanager
def device_rank_for_vllm(layout: EngineLayout, cuda: bool):
    """``shared`` on a GPU: vLLM's ``external_launcher`` worker takes ``cuda:LOCAL_RANK``. A rank
    that sees only its own GPU (Ray sets ``CUDA_VISIBLE_DEVICES`` per actor) has it as device 0
    whatever its local rank, so LOCAL_RANK is the device this process uses while vLLM builds."""
    if layout.mode != "shared" or not cuda:
        yield
        return
    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(torch.cuda.current_device())
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved


@contextmanager
def trainer_group_kept():
    """Shutting an engine down makes vLLM tear down its distributed state, ending with
    ``torch.distributed.destroy_process_group()``: the trainer's own group, which vLLM did not
    create (it found it initialised and built its groups inside it). Around a shutdown only
    vLLM's groups are destroyed."""
    from vllm.distributed import parallel_state

    original = parallel_state.destroy_distributed_environment

    def destroy_vllm_groups_only():
        if parallel_state._WORLD:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None

    parallel_state.destroy_distributed_environment = destroy_vllm_groups_only
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = original


def vllm_version() -> str:
    try:
        import vllm

        return vllm.__version__
    except ImportError:
        return "not installed"
