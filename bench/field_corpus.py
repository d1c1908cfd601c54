"""The field corpus (bench/field_corpus/): publicly reported RL runs, planned by fitrl's planner.

Each case (``bench/field_corpus/cases/*.yaml``) is one configuration someone reported with a known
outcome (it ran, or it ran out of GPU or host memory), translated into fitrl's keys. This script
plans every case through the same code ``fitrl plan`` uses (``load``-equivalent config building,
:func:`fitrl.models.check.read_model_config`, :class:`~fitrl.memory.ModelShape`,
:meth:`Hardware.for_config`, :func:`~fitrl.memory.plan_config`) for the reported hardware, and
prints the verdict table (reported outcome, predicted verdict, right or wrong) and every reported
figure next to the planner's figure for the same quantity, with the error.

Scoring (bench/field_corpus/README.md, "Scoring"):

- verdict (the rule of ``fitrl.memory.model.Plan``, with each case's ``plan.expected_*`` keys):
  right when the plan says ``fits`` and the run ran, or ``does not fit`` and the run ran out of
  memory. A *false fit* is a reported OOM the plan calls ``fits`` (the costly error); a *false
  does-not-fit* is a run that worked and the plan refuses. ``tight`` (the limit inside the plan's
  band) is neither: it is counted, and its share of the corpus is the price of the band.
- figures: ``peak`` figures (a measured use) are within tolerance at |error| <= 15 %;
  ``at_kill`` figures (what a node or process held when it was killed: the need was at least
  that) are within tolerance when the prediction is at least 85 % of the figure.

Nothing here changes the planner: the table is the baseline it is measured against.

    .venv/bin/python bench/field_corpus.py                  # every case
    .venv/bin/python bench/field_corpus.py --only easyr1     # ids containing "easyr1"
    .venv/bin/python bench/field_corpus.py --phases          # also each case's per-phase peaks
    .venv/bin/python bench/field_corpus.py --json out.json   # the rows, for a later comparison
    .venv/bin/python bench/field_corpus.py --markdown        # also README.md's tables, as markdown
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from fitrl.config.schema import AlgorithmConfig  # noqa: E402
from fitrl.config.loader import config_from_dict  # noqa: E402
from fitrl.config.plan import parse_bytes  # noqa: E402
from fitrl.planner import Hardware, ModelShape, plan_config  # noqa: E402
from fitrl.config.run import MemoryConfig  # noqa: E402
from fitrl.planner.cli import check_hardware  # noqa: E402
from fitrl.memory.model import Plan  # noqa: E402
from fitrl.rollout.vllm_plan import engines_per_node  # noqa: E402
from fitrl.models.check import read_model_config  # noqa: E402

CORPUS = ROOT / "bench" / "field_corpus"
GIB = 1024**3
TOLERANCE = 0.15
USABLE = MemoryConfig().guard_gpu_max_fraction  # what a device may hold: the verdict's limit (97 %)
UNITS = {"GiB": GIB, "GB": 1e9, "MiB": 1024**2}

# What every case gets underneath its own fitrl_config: the data file does not exist here (so
# plan.expected_prompt_length=auto keeps the cap: a case sets the lengths its workload implies),
# and every reported run here is a multi-process (Ray) run unless the case says otherwise.
BASE = {"data": {"train_files": ["field_corpus_train.parquet"]}, "trainer": {"backend": "ray"}}


@dataclass
class FigureRow:
    name: str
    reported: float          # GiB
    predicted: Optional[float]
    kind: str                # peak | at_kill
    where: str               # e.g. "host/node in rollout"

    @property
    def error(self) -> Optional[float]:
        return None if self.predicted is None else (self.predicted - self.reported) / self.reported

    @property
    def within(self) -> Optional[bool]:
        if self.error is None:
            return None
        if self.kind == "at_kill":  # the need was at least the reported figure
            return self.predicted >= (1 - TOLERANCE) * self.reported
        return abs(self.error) <= TOLERANCE


@dataclass
class CaseRow:
    id: str
    source: str
    reported: str            # "runs" | "oom"
    resource: Optional[str]  # reported resource: gpu | host | unknown | None
    predicted: str = "-"     # "fits" | "tight" | "does not fit" | "error"
    lengths: str = ""        # the expected lengths planned beside the caps ("" at the caps)
    problems: list[str] = field(default_factory=list)
    right: Optional[bool] = None
    resource_match: Optional[bool] = None
    figures: list[FigureRow] = field(default_factory=list)
    peaks: dict[str, tuple[float, float]] = field(default_factory=dict)  # phase -> (GPU GiB, host GiB)
    expected_peaks: dict[str, tuple[float, float]] = field(default_factory=dict)  # the same at expected lengths
    error: str = ""
    seconds: float = 0.0


# ----------------------------------------------------------------------------- loading

def load_models() -> dict[str, dict[str, Any]]:
    return yaml.safe_load((CORPUS / "models.yaml").read_text())


def load_cases(only: Optional[list[str]] = None) -> list[dict[str, Any]]:
    cases = []
    for path in sorted((CORPUS / "cases").glob("*.yaml")):
        case = yaml.safe_load(path.read_text())
        if case.get("id") != path.stem:
            raise SystemExit(f"{path}: id {case.get('id')!r} must equal the file name {path.stem!r}")
        if not only or any(o in case["id"] for o in only):
            cases.append(case)
    return cases


def _merge(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)
    return dst


def case_config(case: dict[str, Any], model_dir: Path):
    """The case's fitrl config: BASE, then its ``fitrl_config``, the model directory (also the
    reference's when the case sets ``ref.model`` without a path: the same checkpoint in another
    dtype), and the trainer's world taken from ``plan.hardware`` (the batch-size checks need it)
    unless set."""
    data = _merge(copy.deepcopy(BASE), case["fitrl_config"])
    data.setdefault("actor", {}).setdefault("model", {})["path"] = str(model_dir)
    ref_model = data.get("ref", {}).get("model")
    if isinstance(ref_model, dict) and not ref_model.get("path"):
        ref_model["path"] = str(model_dir)
    # veRL and its forks run the old-log-prob pass before every update; where fitrl can fold it
    # into the update (algorithm.fold_old_logprob, newer schemas), the case says which it was
    fold = {"pass": False, "fold": True}[case.get("old_logprob", "pass")]
    if "fold_old_logprob" in {f.name for f in dataclasses.fields(AlgorithmConfig)}:
        data.setdefault("algorithm", {}).setdefault("fold_old_logprob", fold)
    hw = data.get("plan", {}).get("hardware", {})
    trainer = data.setdefault("trainer", {})
    if trainer.get("backend") == "ray":
        trainer.setdefault("nnodes", hw.get("nodes", 1))
        trainer.setdefault("devices_per_node", hw.get("gpus_per_node", 1))
    return config_from_dict(data, source=f"bench/field_corpus/cases/{case['id']}.yaml")


def write_model(models: dict, name: str, root: Path) -> Path:
    if name not in models:
        raise SystemExit(f"model {name!r} is not in bench/field_corpus/models.yaml")
    d = root / name
    if not d.exists():
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(models[name]["config"], indent=1))
    return d


# ----------------------------------------------------------------------------- planning

def plan_case(case: dict[str, Any], model_dir: Path) -> Plan:
    """What ``fitrl plan`` does (fitrl/planner/cli.py, ``cmd_plan`` and ``run_plan``) without printing."""
    cfg = case_config(case, model_dir)
    hardware = Hardware.for_config(cfg)
    check_hardware(hardware, gpu_source="plan.hardware.gpu_memory", host_source="plan.hardware.host_memory")
    shape = ModelShape.from_dict(read_model_config(cfg.actor.model.path, "actor.model.path"))
    return plan_config(cfg, hardware, shape=shape)


def predicted_figure(plan: Plan, fig: dict[str, Any]) -> Optional[float]:
    """The planner's number for a reported figure, in GiB.

    ``scope``: ``device`` (one GPU: everything on it), ``node`` (node 0's host memory, every
    process), ``worker`` (one trainer rank's host memory together with its share of a vLLM
    engine: the process RSS that veRL's and EasyR1's colocated workers show in Ray's memory
    report). ``phase``: a phase of the plan, or ``peak`` (the largest over phases)."""
    resource, scope, phase = fig["resource"], fig["scope"], fig.get("phase", "peak")
    phases = plan.phases if phase == "peak" else [phase]
    if phase != "peak" and phase not in plan.phases:
        return None

    def one(ph: str) -> float:
        if scope == "device":
            return sum(plan.device(ph).values())
        if scope == "node":
            return sum(plan.node_host(ph).values())
        if scope == "worker":
            # veRL's and EasyR1's worker holds every role of its rank in one process; fitrl's
            # reference and critic ranks are processes of their own: their states without a
            # second runtime and CUDA context
            total = 0
            for p in plan.processes:
                if p.kind in ("trainer", "ref", "critic"):
                    usage = p.phases[ph].host if resource == "host" else p.phases[ph].gpu
                    total += sum(v for k, v in usage.items()
                                 if p.kind == "trainer" or k not in ("runtime", "cuda context"))
            engine = next((p for p in plan.processes if p.kind == "engine"), None)
            if engine is not None and resource == "host":
                _, workers = engines_per_node(plan.cfg.rollout.tensor_parallel_size, plan.hardware)
                total += sum(engine.phases[ph].host.values()) / workers
            return total
        raise SystemExit(f"unknown figure scope {scope!r} (device, node, worker)")

    return max(one(ph) for ph in phases) / GIB


def evaluate(case: dict[str, Any], models: dict, tmp: Path) -> CaseRow:
    out = case["outcome"]
    row = CaseRow(id=case["id"], source=case["source"]["url"], reported=out["result"], resource=out.get("resource"))
    t0 = time.perf_counter()
    try:
        plan = plan_case(case, write_model(models, case["reported"]["model"], tmp))
    except Exception as e:  # a case the planner cannot plan is a finding, not a crash of the bench
        row.predicted, row.error = "error", f"{type(e).__name__}: {e}"
        row.seconds = time.perf_counter() - t0
        return row
    row.seconds = time.perf_counter() - t0
    problems = plan.problems()
    row.predicted = plan.verdict  # the rule of fitrl/memory/model.py, Plan
    row.problems = [f"{p.resource} {p.phase}" + (f"@step{p.step}" if p.step else "")
                    + (" (expected)" if p.at == "expected" else "") for p in problems]
    row.right = None if row.predicted == "tight" else (row.predicted == "fits") == (row.reported == "runs")
    if row.reported == "oom" and problems and row.resource in ("gpu", "host"):
        row.resource_match = any(p.resource == row.resource for p in problems)
    row.peaks = {ph: (g / GIB, h / GIB) for ph, (g, h) in plan.peaks().items()}
    if plan.expected is not None:
        row.lengths = f"{plan.lengths.prompt}+{plan.lengths.response}"
        row.expected_peaks = {ph: (g / GIB, h / GIB) for ph, (g, h) in plan.expected.peaks().items()}
    # a figure was measured in the real run, at its real lengths: the plan at expected lengths when there is one
    measured = plan.expected or plan
    for fig in out.get("figures") or []:
        value = fig["value"] * UNITS[fig.get("unit", "GiB")] / GIB
        where = f"{fig['resource']}/{fig['scope']} {fig.get('phase', 'peak')}" + (" (expected)" if plan.expected else "")
        row.figures.append(FigureRow(fig["name"], value, predicted_figure(measured, fig), fig.get("kind", "peak"),
                                     where))
    return row


# ----------------------------------------------------------------------------- search edges

def gpu_peak(peaks: dict[str, tuple[float, float]]) -> float:
    """The largest per-device GiB over a row's phases (``CaseRow.peaks`` or ``expected_peaks``)."""
    return max(g for g, _ in peaks.values())


def search_edges(cases: list[dict[str, Any]], rows: list[CaseRow]) -> list[dict[str, Any]]:
    """What a search record says of a run that is its largest size (``outcome.search``: the batch
    sizes a contributor tried, which ran, which failed). The next size up failed, so if it failed
    for GPU memory (each such case's assumption) the run that worked needed more than the device
    less one size step's increment. The increment per knob unit is the plan's own: the device
    peak of the search's OOM case minus the run's, over their size difference, the larger of the
    caps' and the expected lengths' (the real lengths lie between: the lower floor). A run whose
    floor is over the GPU margin is refused by any plan accurate to within the difference,
    whatever its lengths. Under the three-valued verdict such a run can be ``fits`` only where the
    plan predicts it that far low; an accurate plan calls it ``tight``."""
    by_id = {r.id: r for r in rows}
    out = []
    for c in cases:
        s, r = c["outcome"].get("search"), by_id.get(c["id"])
        if not s or c["outcome"]["result"] != "runs" or r is None or not r.peaks:
            continue
        partner = next((by_id[o["id"]] for o in cases if o["outcome"]["result"] == "oom" and o["id"] in by_id
                        and (o["outcome"].get("search") or {}).get("failed") == s["failed"]), None)
        if partner is None or not partner.peaks:
            continue
        other = next(o for o in cases if o["id"] == partner.id)["outcome"]["search"]["size"]
        rises = [gpu_peak(partner.peaks) - gpu_peak(r.peaks)]
        if r.expected_peaks and partner.expected_peaks:
            rises.append(gpu_peak(partner.expected_peaks) - gpu_peak(r.expected_peaks))
        per_unit = max(rises) / (other - s["size"])
        first_failed = min(f for f in s["failed"] if f > s["size"])
        device = parse_bytes(c["fitrl_config"]["plan"]["hardware"]["gpu_memory"], "plan.hardware.gpu_memory") / GIB
        floor = device - per_unit * (first_failed - s["size"])
        out.append({"id": c["id"], "size": s["size"], "first_failed": first_failed, "per_unit": per_unit,
                    "device": device, "floor": floor, "over_margin": floor > USABLE * device,
                    "under_to_pass": max(0.0, 1 - USABLE * device / floor),
                    # how many times the plan's step the real one must be for the floor to reach the limit
                    "step_slack": (1 - USABLE) * device / (per_unit * (first_failed - s["size"])),
                    "predicted": r.predicted})
    return out


# ----------------------------------------------------------------------------- report

def source_label(url: str) -> str:
    """``owner/repo#N`` for an issue, ``owner/repo doc`` for a document."""
    parts = url.split("github.com/")[-1].split("/")
    if len(parts) >= 4 and parts[2] in ("issues", "pull"):
        return f"{parts[0]}/{parts[1]}#{parts[3]}"
    return f"{parts[0]}/{parts[1]} doc" if len(parts) >= 2 else url


def print_report(rows: list[CaseRow], show_phases: bool = False,
                 edges: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=220) if not sys.stdout.isatty() else Console()
    t = Table(title="field corpus: reported outcome vs fitrl's plan", title_justify="left")
    for col in ("case", "source", "reported", "expected lengths", "predicted", "", "plan's problems"):
        t.add_column(col)
    for r in rows:
        reported = r.reported if r.reported == "runs" else f"OOM ({r.resource or '?'})"
        mark = "tight" if r.predicted == "tight" else "?" if r.right is None else ("right" if r.right else "WRONG")
        problems = ", ".join(r.problems[:3]) + (" ..." if len(r.problems) > 3 else "") if r.problems else ""
        if r.error:
            problems = r.error[:90]
        if r.resource_match is False:
            problems += "  [reported resource not among them]"
        t.add_row(r.id, source_label(r.source), reported, r.lengths or "caps", r.predicted, mark, problems)
    console.print(t)

    f = Table(title="reported figures vs predicted (GiB)", title_justify="left")
    for col in ("case", "figure", "where", "kind", "reported", "predicted", "error", "±15%"):
        f.add_column(col, justify="right" if col in ("reported", "predicted", "error") else "left")
    for r in rows:
        for fig in r.figures:
            err = "-" if fig.error is None else f"{fig.error:+.0%}"
            pred = "-" if fig.predicted is None else f"{fig.predicted:,.1f}"
            ok = "-" if fig.within is None else ("yes" if fig.within else "no")
            f.add_row(r.id, fig.name, fig.where, fig.kind, f"{fig.reported:,.1f}", pred, err, ok)
    console.print(f)

    if edges:
        e = Table(title="runs at a search's edge: the next size failed (GPU GiB)", title_justify="left")
        for col in ("case", "ran at", "first failed", "per unit (plan)", "needed more than", "of the device",
                    "usable", "a fit needs a plan this low", "holds unless the real step is", "verdict"):
            e.add_column(col, justify="left" if col == "case" else "right")
        for x in edges:
            e.add_row(x["id"], str(x["size"]), str(x["first_failed"]), f"{x['per_unit']:.2f}", f"{x['floor']:.1f}",
                      f"{x['floor'] / x['device']:.1%}", f"{USABLE:.0%}", f"-{x['under_to_pass']:.1%}",
                      f">= {x['step_slack']:.1f}x the plan's", x["predicted"])
        console.print(e)

    if show_phases:
        for r in rows:
            if r.peaks:
                text = "  ".join(f"{ph} {g:,.1f}/{h:,.0f}" for ph, (g, h) in r.peaks.items())
                console.print(f"{r.id}: GPU/host GiB per phase: {text}", highlight=False)
                if r.expected_peaks:
                    text = "  ".join(f"{ph} {g:,.1f}/{h:,.0f}" for ph, (g, h) in r.expected_peaks.items())
                    console.print(f"{r.id}: at expected lengths {r.lengths}: {text}", highlight=False)

    planned = [r for r in rows if r.predicted != "error"]
    figs = [fig for r in rows for fig in r.figures if fig.within is not None]
    totals = {
        "cases": len(rows),
        "planned": len(planned),
        "errors": sum(r.predicted == "error" for r in rows),
        "verdict_right": sum(bool(r.right) for r in planned),
        "false_fits": sum(r.reported == "oom" and r.predicted == "fits" for r in planned),
        "false_does_not_fit": sum(r.reported == "runs" and r.predicted == "does not fit" for r in planned),
        "tight": sum(r.predicted == "tight" for r in planned),
        "oom_cases_resource_matched": sum(bool(r.resource_match) for r in planned),
        "oom_cases_with_resource": sum(r.resource_match is not None for r in planned),
        "figures": len(figs),
        "figures_within": sum(fig.within for fig in figs),
        "edge_runs_over_margin": sum(x["over_margin"] for x in edges or []),
        "edge_runs_refused": sum(x["predicted"] == "does not fit" for x in edges or []),
    }
    n = max(1, totals["planned"])
    console.print(
        f"verdict right on {totals['verdict_right']} of {totals['planned']} planned cases, tight on "
        f"{totals['tight']} ({totals['tight'] / n:.0%}; hold: <= 25%), false fits {totals['false_fits']} (hold: 0), "
        f"false does-not-fit {totals['false_does_not_fit']} (hold: <= 2), planner errors {totals['errors']}; "
        f"search-edge runs refused {totals['edge_runs_refused']} of {len(edges or [])} (hold: 0); "
        f"OOM cases whose reported resource the plan names: {totals['oom_cases_resource_matched']} of "
        f"{totals['oom_cases_with_resource']}; figures within tolerance: {totals['figures_within']} of "
        f"{totals['figures']} (hold: every one within ±15%)", highlight=False)
    if totals["edge_runs_over_margin"]:
        k = totals["edge_runs_over_margin"]
        low = min(x["under_to_pass"] for x in edges if x["over_margin"])
        console.print(
            f"{k} runs at a search's edge needed more than the usable {USABLE:.0%} of their device: a plan calls "
            f"them fits only by predicting at least {low:.1%} below what they needed; an accurate one calls them "
            f"tight", highlight=False)
    return totals


def markdown(rows: list[CaseRow], edges: list[dict[str, Any]]) -> str:
    """The verdict table and the search edges as README.md's markdown ("Baseline")."""
    def gpu(peaks: dict) -> str:
        return f"{gpu_peak(peaks):.1f}" if peaks else ""

    out = ["| case | reported | expected lengths | GPU caps | GPU expected | predicted | |",
           "|---|---|---|---:|---:|---|---|"]
    for r in rows:
        reported = r.reported if r.reported == "runs" else f"OOM ({r.resource or '?'})"
        mark = "tight" if r.predicted == "tight" else "?" if r.right is None else ("right" if r.right else "**wrong**")
        out.append(f"| `{r.id}` | {reported} | {r.lengths or 'caps'} | {gpu(r.peaks)} | {gpu(r.expected_peaks)} "
                   f"| {r.predicted} | {mark} |")
    if edges:
        out += ["", "| run at a search's edge | ran at | first failed | GiB per unit | needed more than | "
                    "of the device | a fit needs a plan this low | holds unless the real step is | verdict |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        out += [f"| `{x['id']}` | {x['size']} | {x['first_failed']} | {x['per_unit']:.2f} | {x['floor']:.1f} "
                f"| {x['floor'] / x['device']:.1%} | -{x['under_to_pass']:.1%} | >= {x['step_slack']:.1f}x the plan's "
                f"| {x['predicted']} |" for x in edges]
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="plan only the cases whose id contains one of these strings")
    p.add_argument("--phases", action="store_true", help="print each case's per-phase GPU and host peaks")
    p.add_argument("--json", help="write the rows and totals to this file")
    p.add_argument("--markdown", action="store_true", help="also print the tables as README.md's markdown")
    args = p.parse_args(argv)
    models, cases = load_models(), load_cases(args.only)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fitrl-field-corpus-") as tmp:
        for case in cases:
            row = evaluate(case, models, Path(tmp))
            print(f"planned {row.id} in {row.seconds:.1f}s: {row.predicted}", file=sys.stderr)
            rows.append(row)
    edges = search_edges(cases, rows)
    totals = print_report(rows, args.phases, edges)
    if args.markdown:
        print(markdown(rows, edges))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [asdict(r) for r in rows], "edges": edges, "totals": totals},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
