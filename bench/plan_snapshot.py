"""Every plan the repository's corpora make, written as one JSON document, so a refactor of the
planner can show that it changed no byte of any plan.

The corpora: the field corpus (bench/field_corpus.py), the five failure stories
(bench/failure_stories.py), the CPU calibration and held-out corpora (bench/plan_accuracy.py,
bench/cpu_corpus.py: planned only, nothing runs) under both allocator models, and the shipped
examples with variants (each engine, Ray, LoRA, a critic, a vision-language model, CUDA hardware).
Each plan is written with its verdict, notes, host growth, every process's per-phase device and
host bytes by component, its plan at the expected lengths, and its recommendations with their
predicted effect.

    .venv/bin/python bench/plan_snapshot.py --write /tmp/before.json     # before the change
    .venv/bin/python bench/plan_snapshot.py --compare /tmp/before.json   # after: exit 1 on any difference

CPU plans read this machine's RAM; compare snapshots made on the same machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from fitrl.config import load_config  # noqa: E402
from fitrl.planner import Hardware, plan_config  # noqa: E402
from fitrl.memory.model import Plan  # noqa: E402
from fitrl.planner.recommend import candidates, recommend  # noqa: E402

CPU_HOST = 24 * 2 ** 30  # the examples' CPU plans are made for this much RAM, whatever the machine has


def plan_dict(plan: Plan) -> dict[str, Any]:
    out = {"verdict": plan.verdict, "notes": list(plan.notes), "growth": plan.growth_per_step,
           "processes": {p.kind: {"per_node": p.per_node,
                                  "phases": {ph: {"gpu": dict(u.gpu), "host": dict(u.host)} for ph, u in p.phases.items()}}
                         for p in plan.processes}}
    if plan.expected is not None:
        out["expected"] = plan_dict(plan.expected)
    return out


def with_recommendations(plan: Plan) -> dict[str, Any]:
    def rec(r) -> Optional[dict[str, Any]]:
        return r and {"change": r.change.text, "overrides": [list(map(str, o)) for o in r.change.overrides],
                      "fits": r.fits, "gpu_delta": r.gpu_delta, "host_delta": r.host_delta}

    shown, combined = recommend(plan)
    out = plan_dict(plan)
    out["candidates"] = [c.text for c in candidates(plan)]
    out["recommendations"] = [rec(r) for r in shown] + [rec(combined)]
    return out


def field_corpus(tmp: Path) -> dict[str, Any]:
    from field_corpus import load_cases, load_models, plan_case, write_model

    models = load_models()
    return {case["id"]: plan_dict(plan_case(case, write_model(models, case["reported"]["model"], tmp)))
            for case in load_cases()}


def failure_stories() -> dict[str, Any]:
    from failure_stories import STORIES, plan_story

    return {story.key: with_recommendations(plan_story(story)) for story in STORIES}


def cpu_corpora(tmp: Path) -> dict[str, Any]:
    import cpu_corpus
    import plan_accuracy

    cases = [(f"calibration {i}", c) for i, c in enumerate(plan_accuracy.CASES)]
    cases += [(f"held-out {i}", c) for i, c in enumerate(cpu_corpus.CORPUS)]
    dirs = plan_accuracy.model_dirs([c for _, c in cases], str(tmp))
    out = {}
    for name, case in cases:
        for malloc in ("glibc", "mmap"):
            cfg = load_config(str(ROOT / "examples" / "arith.yaml"),
                              [*case.overrides(dirs[case.arch, case.size]), f"plan.host_malloc={malloc}"])
            out[f"{name} {malloc}"] = plan_dict(plan_config(cfg, Hardware.cpu(ranks_per_node=case.ranks,
                                                                               host_memory=CPU_HOST)))
    return out


EXAMPLE_VARIANTS = {
    "cpu": [],
    "cpu ray 2": ["trainer.backend=ray", "trainer.devices_per_node=2"],
    "cpu lora": ["actor.lora.rank=8"],
    "cpu kl": ["algorithm.use_kl_loss=true"],
    "cpu ppo": ["algorithm.adv_estimator=gae"],
    "cpu decode generate": ["rollout.decode=generate"],
    "cpu vllm": ["rollout.engine=vllm"],
    "cpu vllm tp2": ["rollout.engine=vllm", "rollout.tensor_parallel_size=2"],
    "cpu vllm ray 2": ["rollout.engine=vllm", "trainer.backend=ray", "trainer.devices_per_node=2"],
    "cpu vllm lora": ["rollout.engine=vllm", "actor.lora.rank=8"],
    "cuda": ["trainer.device=cuda"],
    "cuda ray 8": ["trainer.device=cuda", "trainer.backend=ray", "trainer.devices_per_node=8"],
    "cuda ray 8 vllm": ["trainer.device=cuda", "trainer.backend=ray", "trainer.devices_per_node=8",
                        "rollout.engine=vllm"],
    "cuda ray 8 vllm tp2 sleep2": ["trainer.device=cuda", "trainer.backend=ray", "trainer.devices_per_node=8",
                                   "rollout.engine=vllm", "rollout.tensor_parallel_size=2", "rollout.sleep_level=2"],
    "cuda ray 8 vllm kv": ["trainer.device=cuda", "trainer.backend=ray", "trainer.devices_per_node=8",
                           "rollout.engine=vllm", "rollout.kv_cache_memory=2GiB"],
    "cuda ray 8 offload": ["trainer.device=cuda", "trainer.backend=ray", "trainer.devices_per_node=8",
                           "actor.fsdp.cpu_offload=true", "actor.fsdp.offload_params=true",
                           "actor.fsdp.offload_optimizer=true"],
    "cuda vllm emulate": ["trainer.device=cuda", "trainer.backend=ray", "trainer.devices_per_node=8",
                          "rollout.engine=vllm", "plan.emulate.free_cache_engine=true",
                          "plan.emulate.separate_processes=true", "plan.emulate.swap_space_gib=4"],
    "cpu hf emulate": ["plan.emulate.free_cache_engine=true"],
}


def examples(tmp: Path) -> dict[str, Any]:
    from fitrl.models.tiny import make_tiny_model

    text = str(make_tiny_model(tmp / "text", arch="llama", size="small", seed=0))
    vl = str(make_tiny_model(tmp / "vl", arch="qwen2_5_vl", seed=0))
    out = {}
    for name, extra in EXAMPLE_VARIANTS.items():
        cfg = load_config(str(ROOT / "examples" / "arith.yaml"),
                          [f"actor.model.path={text}", "trainer.val_before_train=false", "actor.micro_batch_size=4", *_device(name), *extra])
        out[f"arith {name}"] = with_recommendations(plan_config(cfg, _hardware(cfg)))
    for name, extra in (("cpu", []), ("cpu ray 2", EXAMPLE_VARIANTS["cpu ray 2"]),
                        ("cuda ray 8", EXAMPLE_VARIANTS["cuda ray 8"]),
                        ("cuda ray 8 vllm", EXAMPLE_VARIANTS["cuda ray 8 vllm"]),
                        ("cpu vllm", EXAMPLE_VARIANTS["cpu vllm"])):
        cfg = load_config(str(ROOT / "examples" / "shapes_vl.yaml"),
                          [f"actor.model.path={vl}", "trainer.val_before_train=false", "actor.micro_batch_size=2", *_device(name), *extra])
        out[f"shapes_vl {name}"] = with_recommendations(plan_config(cfg, _hardware(cfg)))
    return out


def _device(name: str) -> list[str]:
    return ["trainer.device=cpu"] if name.startswith("cpu") else []


def _hardware(cfg) -> Hardware:
    if cfg.trainer.device == "cpu":
        return Hardware.for_config(cfg, host_memory=CPU_HOST)
    return Hardware.for_config(cfg)


SECTIONS = {"field corpus": field_corpus, "failure stories": failure_stories, "cpu corpora": cpu_corpora,
            "examples": examples}


def snapshot(sections: list[str]) -> dict[str, Any]:
    # one fixed directory for the tiny models: a recommendation names the model's path
    tmp = Path(tempfile.gettempdir()) / "fitrl-plan-snapshot"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        return {name: (SECTIONS[name](tmp) if name != "failure stories" else failure_stories()) for name in sections}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only before" for k in a if k not in b] + [f"{path}/{k}: only after" for k in b if k not in a]
        for k in a:
            if k in b:
                out += differences(a[k], b[k], f"{path}/{k}")
        return out
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", help="write the snapshot to this file")
    mode.add_argument("--compare", help="compare with the snapshot in this file; exit 1 on any difference")
    p.add_argument("--only", nargs="*", choices=list(SECTIONS), default=list(SECTIONS), help="these corpora only")
    args = p.parse_args(argv)
    snap = json.loads(json.dumps(snapshot(args.only)))  # tuples as lists, as a file holds them
    plans = sum(len(v) for v in snap.values())
    if args.write:
        Path(args.write).write_text(json.dumps(snap, indent=1, sort_keys=True))
        print(f"{plans} plans written to {args.write}")
        return 0
    before = json.loads(Path(args.compare).read_text())
    diff = differences({k: before[k] for k in args.only}, snap)
    for line in diff[:200]:
        print(line)
    print(f"{plans} plans: {'identical' if not diff else f'{len(diff)} differences'}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
