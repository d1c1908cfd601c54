"""The five failure stories (examples/failure_stories/), planned beside the reports they come from.

Each story is a config with the numbers of a user's report (its public thread linked in the table): the hardware, the
batch, the lengths, the images, and an assumption comment for everything the report does not
give. This script plans every story as `fitrl plan` does, and the change its reporter applied (or
a better one, said so), and writes docs/failure-stories.md's story section between the markers
``<!-- stories:begin -->`` and ``<!-- stories:end -->``: what the report says failed (resource,
phase, step) next to what the plan predicts, whether they agree, the report's figures next to the
plan's, and the plan with each change. Where the plan differs from the report on some aspect, the
story says why (:attr:`Story.gaps`); the script refuses to write a story whose plan differs
without a reason, or whose reason no longer applies, so the section cannot drift from the planner.

    .venv/bin/python bench/failure_stories.py            # plan the stories, rewrite the story section
    .venv/bin/python bench/failure_stories.py --check    # exit 1 when the story section is stale
    .venv/bin/python bench/failure_stories.py --print    # print the section, write nothing

About 12 plans: a few minutes on 2 cores. ``tests/test_plan_stories.py`` runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "bench"):  # run as a script from anywhere, or loaded by path (tests)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from fitrl.config import load_config  # noqa: E402
from fitrl.planner import Hardware, plan_config  # noqa: E402
from fitrl.memory.model import Plan  # noqa: E402
import doc_section  # noqa: E402
from story_model import (ASPECTS, Change, Failure, Figure, Outcome, Story,  # noqa: E402
                         checkpoint_copies, gib, peak, per_gpu_at, _peak_text)

DOC = ROOT / "docs" / "failure-stories.md"
BEGIN, END = "<!-- stories:begin -->", "<!-- stories:end -->"
RAY_KILL_THRESHOLD = 0.95  # documented (Ray): the memory monitor kills a worker above 95 % of a node's RAM


STORIES = (
    Story(
        "1", "1_offload_hurts.yaml", "Offload that hurts",
        "[hiyouga/EasyR1#260](https://github.com/hiyouga/EasyR1/issues/260)",
        "Qwen2.5-VL-7B, EasyR1 (vLLM 0.8.3), 8 × H100 80GB, 2 TB RAM; batch not given: EasyR1's "
        "example of the date (512 prompts × 5, 2048 + 2048 tokens, 1 image ≤ 4 MP), offload on",
        Failure("host", ("old_logprob", "ref_logprob", "update"), None,
                "host OOM after a rollout (Ray killed a worker; \"keepalive watchdog timeout\")"),
        Change(("ref.fsdp.cpu_offload=false",),
               "the reporter's: reference CPU offload off (EasyR1 `ref.fsdp.enable_cpu_offload`, "
               "`ref.offload.offload_params`)"),
        figures=(
            Figure("device in use when generation ends (vLLM awake)", "66.48 GiB",
                   lambda o: f"{gib(o.plan.peaks()['rollout'][0])} GiB (rollout)"),
            Figure("node host memory", "ran out (2 TB)",
                   lambda o: f"peak {_peak_text(o, 'host')}, limit {gib(o.plan.host_limit)} GiB"),
            Figure("device peak with the reference's offload off", "fit (\"the GPUs had room\")",
                   lambda o: _fixed_gpu(o)),
        ),
        gaps={"fails": "Not reproduced. With EasyR1's example batch the plan stays far under the 2 TB "
                       "node, and the reference's offloaded bf16 weights are a few tens of GiB per node: "
                       "nothing the planner models comes near the host OOM the report saw, or explains why "
                       "turning that offload off cured it. The report gives neither its batch nor Ray's "
                       "list of the processes' memory at the kill; what grew is not known, and no planned "
                       "batch was chosen to make it fail. The plan does agree that the offload can go: "
                       "without it the devices keep their room."},
    ),
    Story(
        "2", "2_host_ram_at_startup.yaml", "Host RAM eaten at start-up",
        "an EasyR1 user's report; no public thread found",
        "multimodal 7B (Qwen2.5-VL-7B), EasyR1, 251.53 GiB node (GPUs not given: 8 × 80 GB), "
        "8 prompts × 5, global batch 8, micro-batch 1, ≤ 8 images ≤ 4 MP per prompt, offload on",
        Failure("host", ("load",), None,
                "host OOM early, while the workers initialised the rollout model"),
        Change(("actor.fsdp.offload_params=false", "actor.fsdp.offload_optimizer=false", "rollout.sleep_level=2"),
               "the report's first advice (the actor's offload off, the reference's kept) and "
               "`rollout.sleep_level=2`: the engines' sleeping weights leave the host (the advice alone "
               "does not fit, below)"),
        tried=(Change(("actor.fsdp.offload_params=false", "actor.fsdp.offload_optimizer=false",
                       "trainer.val_before_train=false", "data.max_pixels=1048576"),
                      "the report's advice: the actor's offload off, no validation before training, a "
                      "smaller max_pixels"),),
        figures=(
            Figure("node host memory when Ray killed", "242.92 of 251.53 GiB (96.6 %)",
                   lambda o: f"{gib(o.plan.peaks()['load'][1])} GiB at load; peak {_peak_text(o, 'host')}"),
            Figure("a worker initialising the rollout model", "~20 GB each",
                   lambda o: f"{gib(per_gpu_at(o.plan, 'load'))} GiB per GPU at load (its ranks and engine "
                             f"worker); {gib(per_gpu_at(o.plan, peak(o.plan, 'host')[0]))} GiB at the peak"),
            Figure("a process of the main task", "~12 GB each",
                   lambda o: _process_peak(o.plan, "driver")),
        ),
        gaps={"phase": "The report's node filled while the workers initialised the rollout model, ~20 GB "
                       "each. fitrl's engine starts from the policy's weights (nothing is read for it) and "
                       "the plan's load phase is well under the node; what took ~20 GB per worker while "
                       "loading (not in the report: vLLM's start-up profiling with up to 8 images per "
                       "prompt is a candidate) is not modelled. The plan's failure comes after the first "
                       "rollout: the engines' weights asleep, pinned on the host, beside the offloaded "
                       "states and the step's images."},
    ),
    Story(
        "3", "3_host_grows_each_rollout.yaml", "Host memory growing each rollout",
        "[hkust-nlp/simpleRL-reason#84](https://github.com/hkust-nlp/simpleRL-reason/issues/84)",
        "Qwen2.5-7B, simpleRL-reason (veRL fork, vLLM 0.6.3), 8 × A100, 1 TB RAM, 256 prompts × 8, "
        "responses ≤ 8,192, rollout micro-batch 1,024, swap space 40 GiB, `free_cache_engine=True`",
        Failure("host", ("rollout",), 3, "CPU OOM at the third generation, memory rising each rollout"),
        Change(("rollout.sleep_level=0",),
               "the maintainers': `free_cache_engine=False` (the engine keeps its cache: fitrl's "
               "`rollout.sleep_level=0`)"),
        figures=(
            Figure("the generation that ran out (the plan: past the guard's limit at its band's low end)", "3rd",
                   lambda o: _growth_step(o.plan)),
            Figure("the rollout that crosses Ray's kill threshold (95 % of the node)", "3rd",
                   lambda o: _ray_kill_step(o.plan)),
            Figure("host growth per step", "\"rising fast\"",
                   lambda o: f"{gib(o.plan.growth_per_step)} GiB per step; with the fix "
                             f"{gib(o.fixed.growth_per_step)} GiB"),
        ),
        gaps={"fix": "The maintainers' fix stops the growth in the plan too (an engine that never frees "
                     "its cache never rebuilds it), but the plan does not show it fitting: with the engine "
                     "awake through training at `gpu_memory_utilization` 0.6, the log-prob and update phases "
                     "at the 8,192-token cap exceed the device, beyond its whole memory, so expected lengths "
                     "cannot pass the verdict rule either; the real run's responses were far shorter than "
                     "the cap. No key a "
                     "run reads was found to make this plan fit (the plan's recommendations offer only the "
                     "emulation's own switch, a planner-only key)."},
    ),
    Story(
        "4", "4_crash_at_step_4.yaml", "Crash at step 4",
        "[hiyouga/EasyR1#261](https://github.com/hiyouga/EasyR1/issues/261)",
        "EasyR1, `max_prompt_length` 22,000, 1,280 sequences per step (256 prompts × 5), too much "
        "offload; model and GPUs not given: Qwen2.5-7B, 8 × A100 80GB, 1 TiB",
        Failure("gpu", ("rollout",), 4,
                "GPU memory rising step by step; out of memory at ~1,100 of the 4th step's 1,280 "
                "generations, the actor gone"),
        Change(("data.max_prompt_length=8192",), "the report's: `max_prompt_length` 8192 (its response 2048 "
                                                 "and 256 prompts are the config's already)"),
        tried=(Change(("actor.fsdp.offload_params=false", "actor.fsdp.offload_optimizer=false",
                       "ref.fsdp.cpu_offload=false"), "the report's first step: offload off"),
               Change(("actor.ulysses_size=2",), "what a fitrl user would now try first: keep the 22,000-token "
                                                 "prompts, split each sequence over 2 ranks (Ulysses)")),
        figures=(
            Figure("sequences per step", "1,280",
                   lambda o: f"{o.plan.cfg.data.rollout_batch_size * o.plan.cfg.rollout.n:,}"),
            Figure("device", "rising each step to the crash at step 4",
                   lambda o: f"peak {_peak_text(o, 'gpu')}, the same every step; limit {gib(o.plan.gpu_limit)} GiB"),
        ),
        gaps={"phase": "fitrl's vLLM engine takes a fixed share of the device while it generates "
                       "(`gpu_memory_utilization`), whatever the prompts: the plan cannot run out in the "
                       "rollout. Its failure is where 22,000-token prompts meet the trainer: the log-prob "
                       "and update micro-batches at the cap.",
              "step": "The planner has no per-step GPU growth: `Plan.growth_per_step` is host memory, and "
                      "only `plan.emulate.free_cache_engine` makes it. The report's rise over steps (blamed on "
                      "shared-memory objects not released) has no mechanism in the plan, which holds every "
                      "step alike: it fails from the first step whose micro-batches hold prompts at the cap."},
    ),
    Story(
        "5", "5_every_rank_reads_checkpoint.yaml", "Checkpoint loading 12× slower, then OOM",
        "[hiyouga/EasyR1#123](https://github.com/hiyouga/EasyR1/issues/123)",
        "Qwen2-VL-72B, EasyR1, 8 nodes × 8 GPUs of 96 GB, an old config without `enable_rank0_init` "
        "(every rank loads the model onto its GPU: `plan.emulate.load_on_device`); host RAM not given: "
        "2 TiB per node",
        Failure("gpu", ("load",), None, "loading 4 → 48 s per shard, then CUDA OOM (236 MB of 96 GB free)"),
        Change(("actor.fsdp.init=rank0",), "the report's: rank 0 reads, then broadcasts (EasyR1 `enable_rank0_init`)"),
        figures=(
            Figure("loading the checkpoint shards", "4 s/it → 48 s/it (12×)",
                   lambda o: f"{checkpoint_copies(o.plan):.0f} full copies read per node → "
                             f"{checkpoint_copies(o.fixed):.0f} with the fix (no time model)"),
            Figure("device at load", "out of memory, 236 MB of 96 GB free",
                   lambda o: f"{gib(o.plan.peaks()['load'][0])} GiB of {gib(o.plan.hardware.gpu_memory)} GiB"),
            Figure("host at load", "not reported",
                   lambda o: f"{gib(o.plan.peaks()['load'][1])} GiB → {gib(o.fixed.peaks()['load'][1])} GiB "
                             f"with the fix; limit {gib(o.plan.host_limit)} GiB"),
        ),
    ),
)


def _fixed_gpu(o: Outcome) -> str:
    phase, value = peak(o.fixed, "gpu")
    return f"{gib(value)} GiB ({phase}) of {gib(o.fixed.gpu_limit)} GiB limit"


def _process_peak(plan: Plan, kind: str) -> str:
    p = plan.process(kind)
    phase = max((ph for ph in plan.phases if ph in p.phases), key=lambda ph: p.host_peak(ph))
    return f"the driver: {gib(p.host_peak('load'))} GiB at load, {gib(p.host_peak(phase))} GiB ({phase})"


def _ray_kill_step(plan: Plan) -> str:
    """The step whose rollout passes Ray's kill threshold, by the plan's steady rollout and its growth."""
    host, limit, growth = plan.peaks()["rollout"][1], RAY_KILL_THRESHOLD * plan.hardware.host_memory, plan.growth_per_step
    if host > limit:
        return "step 1"
    if not growth:
        return "none"
    return f"step {int((limit - host) // growth) + 2}"


def _growth_step(plan: Plan) -> str:
    steps = [p.step for p in plan.problems() if p.step]
    return f"step {min(steps)}" if steps else "none"


# ------------------------------------------------------------------------------------ planning

def story_config(story: Story, overrides=()):
    """The story's config as `fitrl plan` loads it, model paths made absolute (the stories name
    them relative to the repository)."""
    cfg = load_config(str(story.path), list(overrides))
    paths = [f"actor.model.path={ROOT / cfg.actor.model.path}"]
    if cfg.ref.model is not None and cfg.ref.model.path:
        paths.append(f"ref.model.path={ROOT / cfg.ref.model.path}")
    return load_config(str(story.path), [*overrides, *paths])


def plan_story(story: Story, overrides=()) -> Plan:
    cfg = story_config(story, overrides)
    return plan_config(cfg, Hardware.for_config(cfg))


def outcome(story: Story) -> Outcome:
    return Outcome(story, plan_story(story), plan_story(story, story.fix.overrides),
                   [plan_story(story, c.overrides) for c in story.tried])


class StaleStory(Exception):
    """A story whose plan differs from its report without a reason, or whose reason no longer applies."""


def check_gaps(o: Outcome) -> None:
    """Refuse a story whose plan differs from its report without a reason, or keeps a reason for an
    aspect it now agrees on. A plan that fits where the report failed excuses resource, phase and
    step (one reason, under "fails")."""
    m, gaps = o.matches(), o.story.gaps
    for aspect in ASPECTS:
        excused = aspect in ("resource", "phase", "step") and "fails" in gaps
        if not m[aspect] and aspect not in gaps and not excused:
            raise StaleStory(f"story {o.story.key}: the plan differs from the report on '{aspect}' and the story "
                             f"does not say why (Story.gaps in bench/failure_stories.py)")
        if m[aspect] and aspect in gaps and not excused:
            raise StaleStory(f"story {o.story.key}: the plan now agrees with the report on '{aspect}': drop "
                             f"its explanation from Story.gaps in bench/failure_stories.py")


# ------------------------------------------------------------------------------------ rendering

def predicted(plan: Plan) -> str:
    """The plan's verdict (``Plan.verdict``: fits, tight, does not fit) in one cell: each
    resource's worst problem, its other phases."""
    problems = plan.problems()
    if not problems:
        g, h = peak(plan, "gpu"), peak(plan, "host")
        return (f"fits: GPU {gib(g[1])} of {gib(plan.gpu_limit)} GiB ({g[0]}), host {gib(h[1])} of "
                f"{gib(plan.host_limit)} GiB ({h[0]})")
    out = []
    for resource in ("gpu", "host"):
        mine = [p for p in problems if p.resource == resource]
        if not mine:
            continue
        worst = max(mine, key=lambda p: (p.step == 0, p.need - p.limit))
        what = "GPU" if resource == "gpu" else "host"
        if worst.call == "tight":  # over the limit only at the top of its band
            text = f"{what} {gib(worst.need)} ±{worst.band:.0%} against {gib(worst.limit)} GiB in {worst.phase}"
        else:
            text = f"{what} {gib(worst.need)} > {gib(worst.limit)} GiB in {worst.phase}"
        if worst.step:
            text += f" at step {worst.step} (+{gib(plan.growth_per_step)} GiB per step)"
        if getattr(worst, "at", "caps") == "expected":
            text += " at expected lengths"
        others = sorted({p.phase for p in mine} - {worst.phase}, key=list(plan.phases).index)
        if others:
            text += f" (also {', '.join(others)})"
        out.append(text)
    return f"{plan.verdict}: " + "; ".join(out)  # (tight: the limit inside the band; Plan.judged)


def agreement(o: Outcome) -> str:
    m, f = o.matches(), o.story.failure
    if not m["fails"]:
        return "**no**: the plan fits"
    parts = [f"{f.resource} {'✓' if m['resource'] else '✗'}",
             f"{'/'.join(f.phases) if len(f.phases) < 3 else 'after the rollout'} {'✓' if m['phase'] else '✗'}"]
    if f.step is not None:
        parts.append(f"step {f.step} {'✓' if m['step'] else '✗'}")
    verdict = "**yes**" if all(m[a] for a in ("resource", "phase", "step")) else "**partly**"
    return f"{verdict}: " + ", ".join(parts)


def with_change(base: Plan, plan: Plan) -> str:
    verdict = "fits" if plan.verdict == "fits" else predicted(plan)
    (gp, g), (hp, h) = peak(base, "gpu"), peak(base, "host")
    (gp2, g2), (hp2, h2) = peak(plan, "gpu"), peak(plan, "host")
    return f"{verdict}; peaks GPU {gib(g)} → {gib(g2)} GiB, host {gib(h)} → {gib(h2)} GiB"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(outcomes: list[Outcome]) -> str:
    lines = ["| story | the report | its failure | the plan | as reported? | the fix → the plan |",
             "|---|---|---|---|---|---|"]
    for o in outcomes:
        s = o.story
        fix = " ".join(f"`{x}`" for x in s.fix.overrides)
        lines.append("| " + " | ".join(cell(c) for c in (
            f"{s.key} {s.title} ([config](../examples/failure_stories/{s.file}); {s.source})", s.reported,
            s.failure.text, predicted(o.plan), agreement(o), f"{fix}: {with_change(o.plan, o.fixed)}")) + " |")
    lines += ["", "The report's figures beside the plan's:", "",
              "| story | quantity | the report | the plan |", "|---|---|---|---|"]
    for o in outcomes:
        for fig in o.story.figures:
            lines.append(f"| {o.story.key} | {cell(fig.what)} | {cell(fig.reported)} | {cell(fig.planned(o))} |")
    lines += ["", "Every change planned (keys a run reads; the first of each story is its fix):", "",
              "| story | change | from | the plan |", "|---|---|---|---|"]
    for o in outcomes:
        for change, plan in ((o.story.fix, o.fixed), *zip(o.story.tried, o.tried)):
            lines.append(f"| {o.story.key} | {' '.join(f'`{x}`' for x in change.overrides)} | {cell(change.text)} | "
                         f"{cell(with_change(o.plan, plan))} |")
    gaps = [(o.story.key, a, t) for o in outcomes for a, t in o.story.gaps.items()]
    if gaps:
        lines += ["", "Where the plan differs from the report, and why:", ""]
        lines += [f"- **Story {k}, {aspect}.** {text}" for k, aspect, text in gaps]
    return "\n".join(lines)


def section(stories=STORIES) -> str:
    outcomes = [outcome(s) for s in stories]
    for o in outcomes:
        check_gaps(o)
    return render(outcomes)


def splice(readme: str, body: str) -> str:
    return doc_section.splice(readme, body, BEGIN, END, "docs/failure-stories.md")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/failure-stories.md's story section is stale")
    mode.add_argument("--print", action="store_true", help="print the section; write nothing")
    args = ap.parse_args(argv)
    try:
        body = section()
    except StaleStory as e:
        print(f"failure stories: {e}", file=sys.stderr)
        return 2
    return doc_section.write_section(DOC, body, BEGIN, END, what="failure-story", script="bench/failure_stories.py",
                                     check=args.check, show=args.print)


if __name__ == "__main__":
    sys.exit(main())
