"""``memory.host_allocator``: finding the library, preloading it in the ``fitrl`` command (which
restarts itself under it) and in the processes it starts, the plan's band for it, and one line
when the library is missing. The Ray ranks' side: tests/test_ray_group.py. And
``memory.expandable_segments``: the GPU allocator's setting each run asks for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fitrl.config import ConfigError, load_config
from fitrl.core import allocator
from fitrl.memory import calibration as C
from fitrl.memory.model import Hardware
from fitrl.planner.plan import plan_config

ROOT = Path(__file__).resolve().parent.parent
JEMALLOC = allocator.find_library("jemalloc")
needs_jemalloc = pytest.mark.skipif(JEMALLOC is None, reason="no libjemalloc.so.2 here (`make allocators`)")


def test_a_library_is_found_in_an_unpacked_package_tree(tmp_path, monkeypatch):
    lib = tmp_path / "usr" / "lib" / "x86_64-linux-gnu" / "libtcmalloc_minimal.so.4"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    monkeypatch.setattr(allocator, "search_dirs", lambda: [tmp_path])
    assert allocator.find_library("tcmalloc") == lib
    assert allocator.find_library("jemalloc") is None
    with pytest.raises(ConfigError, match=r"^memory.host_allocator=jemalloc: none of libjemalloc.so.2 in .*"
                                          r"`make allocators` unpacks it .*set memory.host_allocator=glibc$"):
        allocator.preload_env("jemalloc")


def test_the_allocator_goes_first_in_ld_preload_once(tmp_path, monkeypatch):
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    monkeypatch.setattr(allocator, "search_dirs", lambda: [tmp_path])
    monkeypatch.setattr(allocator, "_unloadable", lambda lib: "")  # (an empty file: not this test's check)
    env = allocator.preload_env("jemalloc", {"LD_PRELOAD": f"/x/libother.so {lib}", "PATH": "/bin"})
    assert env["LD_PRELOAD"] == f"{lib} /x/libother.so" and env["PATH"] == "/bin"
    assert allocator.runtime_env_vars("jemalloc") == {"LD_PRELOAD": str(lib)}
    assert allocator.runtime_env_vars("glibc") == {}


def test_this_process_runs_glibc_unless_preloaded():
    preloaded = os.environ.get("LD_PRELOAD", "")
    if any(n in preloaded for names in allocator.LIBRARIES.values() for n in names):
        pytest.skip("the test process itself runs with another allocator preloaded")
    assert allocator.loaded("glibc") and not allocator.loaded("jemalloc") and not allocator.loaded("tcmalloc")
    allocator.reexec_with("glibc")  # a no-op: nothing to restart for


def test_expandable_segments_where_the_run_allows_them():
    env, why = allocator.cuda_alloc_env("auto", vllm_sleeps=False, env={})
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} and why == "on"
    # a user's own setting is kept under auto, and merged under on
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert allocator.cuda_alloc_env("auto", False, mine) == ({}, "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512 kept as set")
    assert allocator.cuda_alloc_env("on", False, mine)[0] == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512"}
    assert allocator.cuda_alloc_env("on", False, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})[0] == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    # vLLM's sleep mode refuses them: off under auto, a config error under on
    assert allocator.cuda_alloc_env("auto", True, {}) == ({}, "off: vLLM's sleep mode (rollout.sleep_level > 0) "
                                                              "does not allow them")
    with pytest.raises(ConfigError, match="rollout.sleep_level=0 or memory.expandable_segments=auto$"):
        allocator.cuda_alloc_env("on", True, {})
    assert allocator.cuda_alloc_env("off", False, {})[0] == {}


def test_the_cpu_plan_widens_its_host_band_for_another_allocator(tiny_model_dir):
    """Under glibc each process kind has its band (measured for the trainer rank, assumed for the
    node's services); the node's peak at the top of its band is the processes' at theirs. Under
    another allocator the trainer has that allocator's measured band, and its update is planned
    at its traced live bytes, below glibc's heap."""
    hw = Hardware(nodes=1, gpus_per_node=1, gpu_memory=0, host_memory=16 * C.GIB, device="cpu")
    plans = {}
    for name in ("glibc", "jemalloc"):
        cfg = load_config(str(ROOT / "examples" / "arith.yaml"), [f"actor.model.path={tiny_model_dir}",
                                                                  "trainer.device=cpu", f"memory.host_allocator={name}"])
        plans[name] = plan_config(cfg, hw)
    glibc, jemalloc = plans["glibc"], plans["jemalloc"]
    assert (glibc.host_band("trainer"), glibc.host_band("node")) == (C.CPU_HOST_BAND, C.CPU_HOST_BAND_ASSUMED)
    assert glibc.band("host")[1].startswith("per process: ±10% measured")
    trainer, node = glibc.process("trainer"), glibc.process("node")
    host = {k: sum(p.phases["update"].host.values()) for k, p in (("trainer", trainer), ("node", node))}
    assert host["trainer"] > 0 and host["node"] > 0  # (the reward workers)
    top = host["trainer"] * 1.10 + host["node"] * 1.15 + sum(glibc.process("driver").phases["update"].host.values()) * 1.10
    assert glibc.node_host_at("update", +1) == pytest.approx(top, abs=4)
    assert jemalloc.host_band("trainer") == C.CPU_HOST_BANDS_BY_ALLOCATOR["jemalloc"]["trainer"]
    assert jemalloc.host_band("node") == C.CPU_HOST_BAND_ASSUMED
    assert jemalloc.band("host")[1].startswith("per process: ±10% measured: held-out CPU corpus under jemalloc")
    update = {name: plans[name].process("trainer").phases["update"].host for name in plans}
    assert not any(k.startswith("allocator") for k in update["jemalloc"]), update["jemalloc"]
    assert sum(update["jemalloc"].values()) < sum(update["glibc"].values())
    # the phases after it start with a share of the update's freed memory in jemalloc's caches
    from fitrl.memory.trainer import TRANSIENT

    cached = C.CPU_CACHED_AFTER_UPDATE["jemalloc"] * sum(update["jemalloc"].get(k, 0) for k in TRANSIENT)
    for phase in ("rollout", "old_logprob", "checkpoint_save"):
        host = jemalloc.process("trainer").phases[phase].host
        own = sum(host.get(k, 0) for k in TRANSIENT)
        assert own + host.get("allocator (cached)", 0) == pytest.approx(max(own, cached), abs=2), phase
    assert jemalloc.process("trainer").phases["checkpoint_save"].host["allocator (cached)"] > 0


def test_a_groups_shared_prompt_is_planned_once_where_memory_follows_live_bytes(tiny_model_dir):
    """examples/arith.yaml samples n=8 per prompt, and a micro-batch of 32 consecutive samples
    holds 4 prompts: under jemalloc the update and log-prob passes are traced with the
    shared-prompt forward (fitrl/ops/shared_prompt.py), below the same plan with
    ``actor.share_prompts=false``. Under glibc's heap, and wherever the rows' grouping is not known
    or the forward cannot share, the plan stays the plain forward's."""
    from fitrl.config.choices import algorithm_needs
    from fitrl.memory.run import Run
    from fitrl.models.shape import ModelShape

    hw = Hardware(nodes=1, gpus_per_node=1, gpu_memory=0, host_memory=16 * C.GIB, device="cpu")
    shape = ModelShape.from_path(tiny_model_dir)

    def run(*overrides: str) -> Run:
        cfg = load_config(str(ROOT / "examples" / "arith.yaml"), [f"actor.model.path={tiny_model_dir}",
                                                                  "trainer.device=cpu", *overrides])
        return Run(cfg, hw, shape, None, algorithm_needs(cfg))

    jemalloc = run("memory.host_allocator=jemalloc")
    assert jemalloc.prompt_groups(32, update=True) == 4 and jemalloc.prompt_groups(64) == 8
    assert jemalloc.prompt_groups(4, update=True) == 1
    # windows that cross a group's end: 3 samples per prompt, micro-batches of 4 (rows 4-7 hold
    # prompts 1 and 2) and log-prob micro-batches of 10 (rows 10-19: prompts 3 to 6)
    threes = run("memory.host_allocator=jemalloc", "rollout.n=3", "actor.micro_batch_size=4",
                 "actor.logprob_micro_batch_size=10")
    assert (threes.prompt_groups(4, update=True), threes.prompt_groups(10)) == (2, 4)
    for plain in (["memory.host_allocator=glibc"], ["memory.host_allocator=glibc", "plan.host_malloc=mmap"],
                  ["actor.share_prompts=false"], ["rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"],
                  ["actor.micro_batch_token_budget=512"], ["trainer.backend=ray"],
                  ["actor.model.gradient_checkpointing=true"], ["actor.shuffle_mini_batches=true"]):
        r = run("memory.host_allocator=jemalloc", *plain)
        assert r.prompt_groups(32, update=True) == 0, plain
    # the log-prob passes share under checkpointing and shuffled mini-batches (their split is consecutive)
    assert run("memory.host_allocator=jemalloc", "actor.model.gradient_checkpointing=true").prompt_groups(64) == 8

    def update_host(*overrides: str) -> float:
        cfg = load_config(str(ROOT / "examples" / "arith.yaml"), [f"actor.model.path={tiny_model_dir}",
                                                                  "trainer.device=cpu", *overrides])
        return sum(plan_config(cfg, hw).process("trainer").phases["update"].host.values())

    assert update_host("memory.host_allocator=jemalloc") < update_host("memory.host_allocator=jemalloc",
                                                                        "actor.share_prompts=false")
    assert update_host("memory.host_allocator=glibc") == update_host("memory.host_allocator=glibc",
                                                                      "actor.share_prompts=false")


def test_an_update_with_checkpointing_holds_the_allocators_multiple_of_its_transients(tiny_model_dir):
    """jemalloc's and tcmalloc's caches keep the recomputed activations freed in backward: the
    update's activations and logits are the traced live bytes (``plan.host_malloc=mmap``) times
    the allocator's measured multiple, and only with gradient checkpointing (prompts not shared
    here: the mmap plan traces every copy)."""
    hw = Hardware(nodes=1, gpus_per_node=1, gpu_memory=0, host_memory=16 * C.GIB, device="cpu")

    def transients(*overrides: str) -> int:
        cfg = load_config(str(ROOT / "examples" / "arith.yaml"), [f"actor.model.path={tiny_model_dir}",
                                                                  "trainer.device=cpu", "actor.share_prompts=false",
                                                                  *overrides])
        host = plan_config(cfg, hw).process("trainer").phases["update"].host
        return host["activations"] + host["logits"]

    for ckpt in ("true", "false"):
        live = transients("plan.host_malloc=mmap", f"actor.model.gradient_checkpointing={ckpt}")
        for name, multiple in C.CPU_RECOMPUTE_RSS_BY_ALLOCATOR.items():
            held = transients(f"memory.host_allocator={name}", f"actor.model.gradient_checkpointing={ckpt}")
            assert held == pytest.approx(live * (multiple if ckpt == "true" else 1.0), abs=4), (name, ckpt)


@pytest.mark.cli
@needs_jemalloc
def test_the_command_restarts_under_the_allocator_and_its_workers_inherit_it(tmp_path, tiny_model_dir):
    """`fitrl train` with jemalloc: the command itself (same pid, after its restart) and the
    reward worker processes it starts map the library; the run trains as under glibc."""
    probe = tmp_path / "probe.py"  # a reward function run in the reward workers: it records their allocator
    probe.write_text("import os\nfrom fitrl.core.allocator import loaded\n"
                     "def score(response, answer, **kw):\n"
                     f"    open({str(tmp_path / 'seen')!r}, 'a').write(f'{{os.getpid()}} {{loaded(\"jemalloc\")}}\\n')\n"
                     "    return 0.0\n")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fitrl.cli", "train", str(ROOT / "examples" / "arith.yaml"),
         f"actor.model.path={tiny_model_dir}", f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=1",
         "trainer.val_before_train=false", "trainer.progress_bar=false", "memory.host_allocator=jemalloc",
         f"reward.function={probe}:score", "reward.num_workers=1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert f"host allocator: jemalloc ({JEMALLOC}) in this process and the processes it starts" in out
    seen = (tmp_path / "seen").read_text().split()
    pids, flags = set(seen[::2]), set(seen[1::2])
    assert flags == {"True"} and str(proc.pid) not in pids  # scored in worker processes, each under jemalloc
