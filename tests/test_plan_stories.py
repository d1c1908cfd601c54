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
    ("3", ("host", "rollout", 3), "plan.rollout.free_cache_engine"),
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
