"""The five failure stories (examples/failure_stories/, docs/failure-stories.md): each a
user's report (public threads, linked in docs/failure-stories.md) as a config with the report's numbers. ``bench/failure_stories.py``
plans them with the change each reporter applied and writes the docs' table; these tests hold
the mechanism (resource, phase, step, the fix fits), not figures, and the docs to the planner.
Where the plan differs from a report docs/failure-stories.md says why, and the test of that aspect is a strict
xfail naming it: it fails the day the planner agrees, so the docs and this file are updated."""

from pathlib import Path

import pytest
import yaml
from helpers import load_bench

from fitrl.config import load_config
from fitrl.memory.calibration import GPU_RESERVED_FACTORS
from fitrl.planner import Hardware, plan_config
from fitrl.planner.recommend import recommend

UPDATE_RESERVE = GPU_RESERVED_FACTORS["update"]

pytestmark = pytest.mark.slow  # full-size plans, seconds each: not in the fast tier

ROOT = Path(__file__).resolve().parent.parent
STORY_MODELS = ROOT / "examples" / "failure_stories" / "models"


fs = load_bench("failure_stories")
STORY = {s.key: s for s in fs.STORIES}


@pytest.fixture(scope="module")
def outcomes():
    """Every story planned once, with its fix and the other changes it tries (~12 plans)."""
    return {s.key: fs.outcome(s) for s in fs.STORIES}


def story_plan(key, *overrides):
    return fs.plan_story(STORY[key], overrides)


def test_readme_section_is_current(outcomes):
    """The docs' story section is what bench/failure_stories.py writes from today's planner, and
    every aspect where a plan differs from its report is explained (and no explanation is stale)."""
    for o in outcomes.values():
        fs.check_gaps(o)
    readme = fs.DOC.read_text()
    assert fs.splice(readme, fs.render(list(outcomes.values()))) == readme, \
        "docs/failure-stories.md's failure-story section is stale: run .venv/bin/python bench/failure_stories.py"


# (story, aspect) pairs where the plan is known to differ from the report; the docs say why
KNOWN = {("1", "fails"): "story 1: the plan fits on the 2 TB node (mechanism of the report's host OOM unknown)",
         ("2", "phase"): "story 2: the plan's host OOM is after the first rollout, not while loading",
         ("4", "phase"): "story 4: the plan's GPU peak is in the log-prob/update phases, not the generation",
         ("4", "step"): "story 4: no per-step GPU growth in the planner",
         ("3", "fix"): "story 3: the awake engine (rollout.sleep_level=0) leaves no GPU room at the caps"}


def _cases(aspects):
    return [pytest.param(s.key, a, id=f"{s.key}-{a}",
                         marks=[pytest.mark.xfail(strict=True, reason=KNOWN[(s.key, a)])] if (s.key, a) in KNOWN else [])
            for s in fs.STORIES for a in aspects]


@pytest.mark.parametrize("key,aspect", _cases(("fails", "resource", "phase", "step")))
def test_story_fails_as_reported(outcomes, key, aspect):
    """The plan does not fit, on the report's resource, in the report's phase, at its step."""
    o = outcomes[key]
    if aspect != "fails" and (key, "fails") in KNOWN:
        pytest.skip("the plan fits: resource, phase and step have nothing to compare")
    assert o.matches()[aspect], (aspect, STORY[key].failure, fs.predicted(o.plan))


@pytest.mark.parametrize("key,aspect", _cases(("fix",)))
def test_reporters_fix_fits(outcomes, key, aspect):
    """The change the reporter applied (in keys a run reads) makes the plan fit."""
    o = outcomes[key]
    assert o.fixed.fits, fs.predicted(o.fixed)
    assert not any(k.startswith("plan.") for k in STORY[key].fix.overrides)


def test_fixes_are_keys_a_run_reads():
    for s in fs.STORIES:
        for change in (s.fix, *s.tried):
            assert not any(x.startswith("plan.") for x in change.overrides), (s.key, change)
            load_config(str(s.path), list(change.overrides))  # every key exists and validates


def test_story_1_reference_offload_off_keeps_gpu_room(outcomes):
    """The report's fix: the reference's weights move onto the devices, which keep their margin,
    and the node's host memory falls."""
    o = outcomes["1"]
    assert fs.peak(o.fixed, "gpu")[1] > fs.peak(o.plan, "gpu")[1]
    assert fs.peak(o.fixed, "gpu")[1] < o.fixed.gpu_limit
    assert fs.peak(o.fixed, "host")[1] < fs.peak(o.plan, "host")[1]


def test_story_2_advice_alone_is_short_sleep_level_2_fits(outcomes):
    """The report's advice (the actor's offload off, no validation before training, 1 MP images)
    still leaves the node over: the engines' sleeping weights pinned on the host are what
    rollout.sleep_level=2 removes."""
    o = outcomes["2"]
    (advice,) = o.tried
    assert not advice.fits and all(p.resource == "host" for p in advice.problems())
    assert o.fixed.fits
    assert o.plan.node_host("update").get("engine weights (asleep)", 0) > 0
    assert o.fixed.node_host("update").get("engine weights (asleep)", 0) == 0


def test_story_3_host_grows_every_step_until_ray_kills_the_third_rollout(outcomes):
    """The emulated free_cache_engine adds the engines' pinned blocks at every rebuild: host memory
    in the rollout grows step by step, past the plan's margin and, at the third rollout, past Ray's
    kill threshold (95 % of the node), where the report's run died."""
    o = outcomes["3"]
    assert o.plan.growth_per_step > 0
    ((resource, phase, step),) = [(p.resource, p.phase, p.step) for p in o.plan.problems()]
    assert (resource, phase) == ("host", "rollout") and 1 < step <= 3
    assert fs._ray_kill_step(o.plan) == "step 3"


def test_story_3_engine_that_keeps_its_cache_does_not_grow(outcomes):
    """free_cache_engine=False (rollout.sleep_level=0): an engine that never frees its cache never
    rebuilds it, so nothing accumulates."""
    assert outcomes["3"].fixed.growth_per_step == 0


def test_story_4_offload_off_does_not_help_the_device(outcomes):
    """The report's first step (offload off) moves the states onto the devices; the prompt length is
    what fits, or, keeping the 22,000-token prompts, Ulysses over 2 ranks: each rank's log-prob and
    update activations halve."""
    o = outcomes["4"]
    offload_off, ulysses = o.tried
    assert not offload_off.fits
    assert fs.peak(offload_off, "gpu")[1] > fs.peak(o.plan, "gpu")[1]
    assert {p.resource for p in o.plan.problems()} == {"gpu"}
    assert ulysses.cfg.actor.ulysses_size == 2 and ulysses.cfg.data.max_prompt_length == 22000 and ulysses.fits
    for phase in ("old_logprob", "update"):
        assert ulysses.peaks()[phase][0] < 0.75 * o.plan.peaks()[phase][0], phase


def test_story_5_every_rank_loads_onto_its_gpu_rank0_init_one_host_copy(outcomes):
    """EasyR1 without rank-0 init (plan.emulate.load_on_device): every rank holds the whole fp32
    model on its own device at load, more than the 96 GB part: a GPU OOM at load, with no host
    copy. The fix, rank 0 init: rank 0 alone reads, into host memory, and the devices stay free."""
    o = outcomes["5"]
    copy = 73_405_560_320 * 4  # Qwen2-VL-72B in fp32
    assert o.plan.cfg.plan.emulate.load_on_device and o.fixed.cfg.plan.emulate.load_on_device
    assert o.plan.device("load")["checkpoint copy"] == copy          # each rank's own, on its device
    assert "checkpoint copy" not in o.plan.node_host("load")
    assert [(p.resource, p.phase) for p in o.plan.problems()] == [("gpu", "load")]
    assert o.fixed.node_host("load")["checkpoint copy"] == copy      # rank 0 only
    assert "checkpoint copy" not in o.fixed.device("load")
    assert fs.checkpoint_copies(o.plan) == 8 and fs.checkpoint_copies(o.fixed) == 1


@pytest.mark.parametrize("story,tp,engines", [("1", 2, 4), ("4", 2, 4), ("5", 8, 1)])
def test_sleeping_engines_hold_every_workers_weight_shard(outcomes, story, tp, engines):
    """rollout.sleep_level=1 with tensor parallelism: each of an engine's tp workers keeps its own
    pinned copy of its 1/tp bf16 shard, so an engine holds the full weights on the host and a node
    its 8 GPUs' shards (stories 1 and 4: 4 engines of 2; story 5: one engine of 8 per node), not
    one shard per engine (a factor of tp less)."""
    from fitrl.memory.states import full_weights

    plan = outcomes[story].plan
    shard = full_weights(plan.shape, "bfloat16", tp, pinned=True)
    engine = plan.process("engine")
    assert engine.per_node == engines
    for phase in ("old_logprob", "update"):
        assert engine.phases[phase].host["engine weights (asleep)"] == tp * shard
        assert plan.node_host(phase)["engine weights (asleep)"] == 8 * shard


def test_gradients_are_held_only_in_the_update():
    """Actor.update frees the gradients after its last step: no phase but the update holds them,
    on the device or offloaded. FSDP2 CPU offload's gradients are pinned host tensors whose
    freed blocks stay in PyTorch's pinned host cache: counted on the host in every other phase."""
    grads = 7_615_616_512 * 4 // 8  # story 4's 7B, fp32, rank 0's shard of 8
    for overrides in ((), ("actor.fsdp.cpu_offload=true",)):
        phases = story_plan("4", *overrides).process("trainer").phases
        held = {ph: sum(v for k, v in {**u.gpu, **u.host}.items() if k.endswith("grads")) for ph, u in phases.items()}
        in_update = held.pop("update")
        assert in_update >= grads if overrides else in_update == pytest.approx(grads, rel=0.01)
        assert not any(held.values()), (overrides, held)
    update = phases["update"].host["offloaded grads"]  # pinned: each tensor rounded up to a power of two
    assert all(phases[ph].host["pinned cache (grads)"] == update for ph in phases if ph not in ("load", "update"))


# ------------------------------------------------------------------------------------ images
# The image accounting at two fixed configurations, the stories' earlier shapes (1,024 prompts x 8
# samples at 4 MP on 8 x H100 with 2 TB; 128 x 5 on a 251 GB node): formula checks of the planner,
# kept apart from the stories, whose configs follow their reports.

VL = STORY_MODELS / "qwen2.5-vl-7b-instruct"
IMAGES_1 = {
    "data": {"train_files": ["data/geometry/train.parquet"], "val_files": ["data/geometry/test.parquet"],
             "max_prompt_length": 8192, "rollout_batch_size": 1024, "val_batch_size": 1024,
             "max_pixels": 4194304, "limit_images": 1},
    "algorithm": {"use_kl_loss": True, "kl_coef": 1.0e-2},
    "actor": {"model": {"path": str(VL), "gradient_checkpointing": True}, "mini_batch_size": 64,
              "micro_batch_size": 4, "logprob_micro_batch_size": 16,
              "fsdp": {"mixed_precision": True, "offload_params": True, "offload_optimizer": True}},
    "ref": {"logprob_micro_batch_size": 16, "fsdp": {"mixed_precision": True, "cpu_offload": True}},
    "rollout": {"engine": "vllm", "gpu_memory_utilization": 0.6, "tensor_parallel_size": 2, "sleep_level": 1,
                "n": 8, "max_response_length": 2048, "top_p": 0.99},
    "trainer": {"backend": "ray", "nnodes": 1, "devices_per_node": 8},
    "plan": {"hardware": {"nodes": 1, "gpus_per_node": 8, "gpu_memory": "80GiB", "host_memory": "2TB"}},
}
IMAGES_2 = {
    "data": {"train_files": ["data/mm/train.parquet"], "val_files": ["data/mm/test.parquet"],
             "max_prompt_length": 8192, "rollout_batch_size": 128, "val_batch_size": 512,
             "max_pixels": 4194304, "limit_images": 1},
    "algorithm": {"use_kl_loss": True},
    "actor": {"model": {"path": str(VL), "gradient_checkpointing": True}, "mini_batch_size": 32,
              "micro_batch_size": 4, "logprob_micro_batch_size": 16,
              "fsdp": {"mixed_precision": True, "offload_params": True, "offload_optimizer": True}},
    "ref": {"logprob_micro_batch_size": 16, "fsdp": {"mixed_precision": True, "cpu_offload": True}},
    "rollout": {"engine": "vllm", "gpu_memory_utilization": 0.6, "tensor_parallel_size": 1, "sleep_level": 2,
                "n": 5, "max_response_length": 2048},
    "trainer": {"backend": "ray", "devices_per_node": 8, "val_before_train": True},
    "plan": {"hardware": {"nodes": 1, "gpus_per_node": 8, "gpu_memory": "80GiB", "host_memory": "251GB"},
             "emulate": {"separate_processes": True}},
}


@pytest.fixture(scope="module")
def images_plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    paths = {}
    for name, cfg in (("1", IMAGES_1), ("2", IMAGES_2)):
        paths[name] = root / f"images_{name}.yaml"
        paths[name].write_text(yaml.safe_dump(cfg))

    def plan(name, *overrides):
        cfg = load_config(str(paths[name]), list(overrides))
        return plan_config(cfg, Hardware.for_config(cfg))
    return plan


# Qwen2.5-VL-7B's vision tower (examples/failure_stories/models/qwen2.5-vl-7b-instruct/config.json)
ROW = 3 * 2 * 14 * 14 * 4      # one patch row of pixel_values: C x temporal 2 x 14 x 14 fp32 = 4,704 bytes
PATCHES = {4_194_304: 4 * 5348,  # the largest image the processor makes: 28 x 191 LM tokens of 2 x 2 patches
           1_048_576: 5348}      # 7 x 191 LM tokens
# the vision tower's activations per patch token, checkpointed: 2e per block x 32 blocks and one
# block's 14e + 4I recomputed (e = 1280, I = 3420; measured, fitrl/memory/trainer.py), in bf16
VIT_PER_PATCH = (2 * 1280 * 32 + 14 * 1280 + 4 * 3420) * 2


def peak(plan, resource):
    """(phase, bytes) of the plan's peak: resource 0 = one device, 1 = node 0's host."""
    phase, values = max(plan.peaks().items(), key=lambda kv: kv[1][resource])
    return phase, values[resource]


def test_images_1024_prompts_max_pixels_4mp_vs_1mp(images_plan):
    """data.max_pixels moves the host and GPU peaks by what the image formulas give: per prompt (not
    per sample) on the host, per sequence of a micro-batch on the device."""
    big, small = images_plan("1"), images_plan("1", "data.max_pixels=1048576")
    prompts, ranks, images = 1024, 8, 1   # data.rollout_batch_size, 8 ranks on the node, data.limit_images
    shard = min(prompts * 8 // ranks, prompts)  # a rank's 1,024 sequences touch up to every prompt
    assert (big.cfg.data.rollout_batch_size, big.cfg.data.limit_images, big.cfg.rollout.n) == (prompts, images, 8)
    pv = {px: images * PATCHES[px] * ROW for px in PATCHES}  # pixel values per prompt: 96 MiB at 4 MP
    d_pv = pv[4_194_304] - pv[1_048_576]

    # host, node 0, in ref_logprob (the host peak of both plans): the driver's copy of the step's
    # prompts, each rank's unpickled copy of the prompts its shard touches plus one micro-batch's
    # concatenation (ref.logprob_micro_batch_size=16), and the object store's copy of the shards,
    # capped at 30% of the node's RAM (Ray spills beyond)
    tokens = 2 * prompts * 8 * ((8192 + 2048) * 24 + 2048 * 48)  # two copies of the token batch
    cap = int(0.30 * 2 * 10**12)
    store = {px: min(tokens + ranks * shard * pv[px], cap) for px in pv}
    host = prompts * d_pv + ranks * (shard + 16) * d_pv + store[4_194_304] - store[1_048_576]
    assert store[4_194_304] == cap and store[1_048_576] < cap
    (phase_big, host_big), (phase_small, host_small) = peak(big, 1), peak(small, 1)
    assert phase_big == phase_small == "ref_logprob"
    assert host_big - host_small == pytest.approx(host, abs=8)
    assert host / 2**30 == pytest.approx(1018.4, abs=0.1)
    # the driver in the rollout: the prompts' copy and the one generate returns (unpickled), and one
    # prompt being decoded (7 B per source pixel: PIL's RGBX and the processor's uint8 copy; sources
    # at the budget) and processed (36 B per resized pixel of working copies, measured): 784 x 5348
    # and 196 x 5348 pixels
    driver = [p.process("driver").phases["rollout"].host["image buffers"] for p in (big, small)]
    work = images * (7 * (4_194_304 - 1_048_576) + 36 * (784 - 196) * 5348)
    assert driver[0] - driver[1] == 2 * prompts * d_pv + work

    # GPU, one device, in the update: actor.micro_batch_size=4 sequences, each with its prompt's
    # pixel values, and the vision tower's activations over their patches
    micro = 4
    # (and the caching allocator's reserve over them: a measured factor of what it holds in an update)
    gpu = UPDATE_RESERVE * (micro * d_pv + micro * images * (PATCHES[4_194_304] - PATCHES[1_048_576]) * VIT_PER_PATCH)
    update = [p.peaks()["update"][0] for p in (big, small)]
    assert update[0] - update[1] == pytest.approx(gpu, abs=2)
    assert gpu / 2**30 == pytest.approx(15.24, abs=0.01)
    # the device's peak: the update at both budgets. At 1 MP the rollout, where the vLLM engine
    # takes rollout.gpu_memory_utilization=0.6 of each of its tensor_parallel_size=2 devices, comes
    # close but the update holds more: the sleeping engine's residue and its TP group's NCCL
    # buffers beside the trainer's own (assumed terms, fitrl/memory/gpu_terms.py)
    (phase_big, gpu_big), (phase_small, gpu_small) = peak(big, 0), peak(small, 0)
    assert (phase_big, gpu_big) == ("update", update[0])
    assert small.device("rollout")["engine (weights, kv cache)"] == int(0.6 * 80 * 2**30)
    assert phase_small == "update" and gpu_small == update[1]
    # a frozen tower saves nothing for backward: one block's working set (4e + 2I) instead
    frozen = images_plan("1", "actor.model.freeze_vision_tower=true").process("trainer").phases["update"].gpu
    saved = micro * images * PATCHES[4_194_304] * (VIT_PER_PATCH - (4 * 1280 + 2 * 3420) * 2)
    assert big.process("trainer").phases["update"].gpu["activations"] - frozen["activations"] == pytest.approx(saved, abs=2)
    # and a fix the plan recommends among others (a key the run applies): at 4 MP the node's host is
    # within the plan's band of the limit (1,752 GiB against 1,732 usable), at 1 MP it fits
    assert big.verdict == "tight" and small.verdict == "fits"
    singles, _ = recommend(big, limit=30)
    rec = next(r for r in singles if r.change.overrides == [("data.max_pixels", 1_048_576)])
    assert rec.fits and (rec.gpu_delta, rec.host_delta) == (gpu_small - gpu_big, host_small - host_big)


def test_images_128_prompts_max_pixels_4mp_vs_1mp(images_plan):
    """A smaller data.max_pixels buys host memory by the same formulas (128 prompts x 5 samples over
    8 ranks: a rank's 80 sequences touch up to 80 prompts)."""
    big, small = images_plan("2"), images_plan("2", "data.max_pixels=1048576")
    prompts, ranks, shard, images = 128, 8, 80, 1
    d_pv = images * (PATCHES[4_194_304] - PATCHES[1_048_576]) * ROW
    # ref_logprob: driver + each rank (shard + a micro-batch of 16) + the object store (under its cap here)
    host = prompts * d_pv + ranks * (shard + 16) * d_pv + ranks * shard * d_pv
    ref = [p.peaks()["ref_logprob"][1] for p in (big, small)]
    assert ref[0] - ref[1] == pytest.approx(host, abs=8)
    assert host / 2**30 == pytest.approx(107.96, abs=0.01)
    # the host peak: validation at 4 MP (512 prompts, twice on the driver: sent and returned), the
    # reference log-probs at 1 MP; it falls by more than the reference phase does
    assert peak(big, 1)[0] == "validation" and peak(small, 1) == ("ref_logprob", ref[1])
    assert peak(big, 1)[1] - peak(small, 1)[1] > host
    # the device: the update (micro-batch 4) is the peak at 4 MP; at 1 MP the vLLM engine's fixed
    # share of the device (rollout) is
    update = [p.peaks()["update"][0] for p in (big, small)]
    gpu = UPDATE_RESERVE * (4 * d_pv + 4 * images * (PATCHES[4_194_304] - PATCHES[1_048_576]) * VIT_PER_PATCH)
    assert update[0] - update[1] == pytest.approx(gpu, abs=2)
    assert peak(big, 0) == ("update", update[0])
    assert peak(small, 0)[0] == "rollout" and peak(small, 0)[1] < update[0]
