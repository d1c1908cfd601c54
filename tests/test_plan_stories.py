"""The five failure stories (docs/architecture.md, "Failure stories") at full size: `fitrl plan`
predicts each failure and recommends a change that it then says fits (examples/failure_stories/)."""

from pathlib import Path

import pytest

from fitrl.config import load_config
from fitrl.memory import Hardware, plan_config
from fitrl.memory.recommend import recommend

pytestmark = pytest.mark.slow  # full-size plans with recommendations, seconds each: not in the fast tier

ROOT = Path(__file__).resolve().parent.parent
STORIES = ROOT / "examples" / "failure_stories"


def story_plan(name, *overrides):
    path = next(STORIES.glob(f"{name}_*.yaml"))
    model = ROOT / load_config(str(path), overrides).actor.model.path
    cfg = load_config(str(path), [*overrides, f"actor.model.path={model}"])
    return plan_config(cfg, Hardware.for_config(cfg))


# story, the failure (resource, phase, step), the change expected among the fixes
CASES = [
    ("1", ("host", "ref_logprob", 0), "actor.fsdp.offload_params"),
    ("2", ("host", "validation", 0), "actor.fsdp.offload_params"),
    ("3", ("host", "rollout", 3), "plan.emulate.free_cache_engine"),
    ("4", ("gpu", "old_logprob", 0), "actor.logprob_chunk_size"),
    ("5", ("host", "load", 0), "actor.fsdp.init"),
]


@pytest.mark.parametrize("story,failure,fix", CASES, ids=[c[0] for c in CASES])
def test_story_is_predicted_and_fixed(story, failure, fix):
    plan = story_plan(story)
    problems = {(p.resource, p.phase, p.step) for p in plan.problems()}
    assert failure in problems, problems
    singles, combo = recommend(plan, first_fit=story != "2")
    best = next((r for r in singles if r.fits), combo)
    assert best is not None and best.fits
    assert fix in [key for key, _ in best.change.overrides], best.change.text
    # the recommended change is itself a plan that fits
    assert not best.plan.problems()


def test_story_1_offload_off_is_faster_and_fits_with_gpu_room():
    """The story's own fix: with the offload off the GPUs still have room."""
    plan = story_plan("1", "actor.fsdp.offload_params=false", "actor.fsdp.offload_optimizer=false",
                      "ref.fsdp.cpu_offload=false")
    assert plan.fits
    gpu = max(g for g, _ in plan.peaks().values())
    assert gpu < plan.gpu_limit


def test_story_5_rank0_init_holds_one_copy_per_node():
    every = story_plan("5").node_host("load")
    rank0 = story_plan("5", "actor.fsdp.init=rank0").node_host("load")
    copy = 73_405_560_320 * 4
    assert every["checkpoint copy"] == 8 * copy   # every rank of node 0 holds the fp32 model
    assert rank0["checkpoint copy"] == copy       # rank 0 only


@pytest.mark.parametrize("story,tp,engines", [("1", 2, 4), ("4", 2, 4), ("5", 8, 1)])
def test_sleeping_engines_hold_every_workers_weight_shard(story, tp, engines):
    """rollout.sleep_level=1 with tensor parallelism: each of an engine's tp workers keeps its own
    pinned copy of its 1/tp bf16 shard, so an engine holds the full weights on the host and a node
    its 8 GPUs' shards (stories 1 and 4: 4 engines of 2; story 5: one engine of 8 per node), not
    one shard per engine (a factor of tp less)."""
    from fitrl.memory.states import full_weights

    plan = story_plan(story)
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


def test_story_1_max_pixels_4mp_vs_1mp():
    """data.max_pixels moves the host and GPU peaks by what the image formulas give: per prompt (not
    per sample) on the host, per sequence of a micro-batch on the device."""
    big, small = story_plan("1"), story_plan("1", "data.max_pixels=1048576")
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
    gpu = micro * d_pv + 1.10 * micro * images * (PATCHES[4_194_304] - PATCHES[1_048_576]) * VIT_PER_PATCH
    update = [p.peaks()["update"][0] for p in (big, small)]
    assert update[0] - update[1] == pytest.approx(gpu, abs=2)
    assert gpu / 2**30 == pytest.approx(15.21, abs=0.01)
    # the device's peak: the update at 4 MP; at 1 MP the rollout, where the vLLM engine takes
    # rollout.gpu_memory_utilization=0.6 of each of its tensor_parallel_size=2 devices
    (phase_big, gpu_big), (phase_small, gpu_small) = peak(big, 0), peak(small, 0)
    assert (phase_big, gpu_big) == ("update", update[0])
    assert phase_small == "rollout" and small.device("rollout")["engine (weights, kv cache)"] == int(0.6 * 80 * 2**30)
    # a frozen tower saves nothing for backward: one block's working set (4e + 2I) instead
    frozen = story_plan("1", "actor.model.freeze_vision_tower=true").process("trainer").phases["update"].gpu
    saved = 1.10 * micro * images * PATCHES[4_194_304] * (VIT_PER_PATCH - (4 * 1280 + 2 * 3420) * 2)
    assert big.process("trainer").phases["update"].gpu["activations"] - frozen["activations"] == pytest.approx(saved, abs=2)
    # and a fix the plan recommends among others (a key the run applies): 4 MP does not fit, 1 MP does
    assert not big.fits and small.fits
    singles, _ = recommend(big, limit=30)
    rec = next(r for r in singles if r.change.overrides == [("data.max_pixels", 1_048_576)])
    assert rec.fits and (rec.gpu_delta, rec.host_delta) == (gpu_small - gpu_big, host_small - host_big)


def test_story_2_max_pixels_4mp_vs_1mp():
    """The multimodal start-up story: a smaller data.max_pixels buys host memory by the same formulas
    (128 prompts x 5 samples over 8 ranks: a rank's 80 sequences touch up to 80 prompts)."""
    big, small = story_plan("2"), story_plan("2", "data.max_pixels=1048576")
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
    gpu = 4 * d_pv + 1.10 * 4 * images * (PATCHES[4_194_304] - PATCHES[1_048_576]) * VIT_PER_PATCH
    assert update[0] - update[1] == pytest.approx(gpu, abs=2)
    assert peak(big, 0) == ("update", update[0])
    assert peak(small, 0)[0] == "rollout" and peak(small, 0)[1] < update[0]
