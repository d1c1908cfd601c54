"""Printing a plan in an 80-column terminal: a table per resource (a device's peak per phase, a
node's), each phase's largest parts a line each, the processes, the verdict with the plan's error
bands, and the recommendations with their predicted effect."""

from __future__ import annotations

from typing import Optional

from rich.console import Console
from rich.table import Table

from fitrl.memory import calibration as C
from fitrl.memory.gpu_terms import assumed_parts
from fitrl.memory.model import Plan
from fitrl.memory.roles import ROLE_PLANNERS
from fitrl.planner.recommend import Recommendation, as_overrides


def gib(n: float) -> str:
    return f"{n / C.GIB:,.1f}"


def count_text(n: int) -> str:
    """A parameter count people read: 7.62B, 494M, 156K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}" if unit == "B" else f"{n / size:.0f}{unit}"
    return str(n)


def describe_run(plan: Plan) -> str:
    """What is planned, a line per subject (the model, the hardware, the batch, the lengths), each
    short enough for an 80-column terminal except where a path is long."""
    hw, s, cfg = plan.hardware, plan.shape, plan.cfg
    where = (f"{hw.nodes} node(s) x {hw.gpus_per_node} GPU(s) of {gib(hw.gpu_memory)} GiB"
             if hw.device == "cuda" else f"CPU, {hw.gpus_per_node} rank(s)")
    return "\n".join([
        f"{s.model_type} {count_text(s.num_params)} params ({s.layers} layers, hidden {s.hidden}, vocab {s.vocab:,})",
        f"on {where}, {gib(hw.host_memory)} GiB host per node",
        f"{cfg.data.rollout_batch_size} prompts x {cfg.rollout.n} samples, prompt <= {cfg.data.max_prompt_length:,}, "
        f"response <= {cfg.rollout.max_response_length:,} tokens",
        _expected_text(plan)])


def _expected_text(plan: Plan) -> str:
    """``expected: prompt 180 (the longest of 1,000 prompts read from ...), response 400 (plan....) tokens``."""
    if plan.lengths is None or plan.lengths.at_caps(plan.cfg):
        return "expected lengths: the caps"
    return f"expected: {plan.lengths.describe()}"


def phase_tables(plan: Plan) -> list[Table]:
    """Per resource (GPU per device on a CUDA plan, then host per node), per phase the peak at the
    caps with its largest parts, and, with expected lengths shorter than the caps, the peak at those
    lengths beside it (the verdict reads both). A table per resource keeps each within 80 columns."""
    cuda, exp = plan.hardware.device == "cuda", plan.expected
    tables = []
    for resource in (("gpu", "host") if cuda else ("host",)):
        title = ("peak GPU memory per device" if resource == "gpu" else "peak host memory per node") + \
            ", GiB (steady state)"
        t = Table(title=title, title_justify="left")
        t.add_column("phase")
        t.add_column("at caps" if exp else "peak", justify="right")
        if exp:
            t.add_column("expected", justify="right")
        t.add_column("largest parts (at the caps)" if exp else "largest parts")
        limit = plan.gpu_limit if resource == "gpu" else plan.host_limit  # (the expected plan's: the same)
        for ph in plan.phases:
            parts = plan.device(ph) if resource == "gpu" else plan.node_host(ph)
            row = [ph, _mark(sum(parts.values()), limit)]
            if exp:
                exp_parts = exp.device(ph) if resource == "gpu" else exp.node_host(ph)
                row.append(_mark(sum(exp_parts.values()), limit))
            t.add_row(*row, _top(parts))
        tables.append(t)
    return tables


def _mark(n: int, limit: int) -> str:
    return f"[bold red]{gib(n)}[/]" if n > limit else gib(n)


def _top(parts: dict[str, int], k: int = 3) -> str:
    """The ``k`` largest parts, a line each; those that round to 0.0 GiB left out (the largest kept)."""
    items = sorted(parts.items(), key=lambda kv: -kv[1])[:k]
    shown = [(name, v) for i, (name, v) in enumerate(items) if i == 0 or v >= C.GIB // 20]
    return "\n".join(f"{name} {gib(v)}" for name, v in shown if v > 0)


def process_table(plan: Plan) -> Table:
    cuda = plan.hardware.device == "cuda"
    t = Table(title="per process (peak over phases)", title_justify="left")
    # each kind's host band where they differ (a CPU node under glibc: fitrl/memory/calibration.py)
    bands = {p.kind: f"±{plan.host_band(p.kind):.0%}" for p in plan.processes if p.host_peak() > 0}
    banded = len(set(bands.values())) > 1
    for col in ("process", "per node", *(("GPU GiB",) if cuda else ()), "host GiB", *(("band",) if banded else ()),
                "host peak phase"):
        t.add_column(col, justify="left" if col.startswith("process") else "right")
    names = {"trainer": "trainer rank", "engine": "rollout engine (vLLM)", "driver": "driver",
             **{p.name: p.title for p in ROLE_PLANNERS.in_order() if p.own_process},
             "node": "node services (Ray, object store, reward workers)", "rank0": "rank 0 extra (load, save)"}
    for p in plan.processes:
        phases = [ph for ph in plan.phases if ph in p.phases]
        peak_phase = max(phases, key=lambda ph: sum(p.phases[ph].host.values()))
        gpu = max(sum(p.phases[ph].gpu.values()) for ph in phases)
        host = max(sum(p.phases[ph].host.values()) for ph in phases)
        if gpu or host:
            t.add_row(names.get(p.kind, p.kind), str(p.per_node), *((gib(gpu),) if cuda else ()), gib(host),
                      *((bands.get(p.kind, ""),) if banded else ()), peak_phase)
    return t


def assumed_table(plan: Plan) -> Optional[Table]:
    """The plan's assumed terms (fitrl/memory/gpu_terms.py: NCCL's buffers, a sleeping engine's
    residue, pinned host blocks, the driver's context), each at its largest over the phases on a
    device and on node 0; None on a plan without them (every CPU plan)."""
    gpu: dict[str, int] = {}
    host: dict[str, int] = {}
    for ph in plan.phases:
        for out, parts in ((gpu, plan.device(ph)), (host, plan.node_host(ph))):
            for k, v in assumed_parts(parts).items():
                out[k] = max(out.get(k, 0), v)
    if not gpu and not host:
        return None
    t = Table(title="assumed (constants no GPU has measured yet: `make gpu-check` measures them)",
              title_justify="left")
    for col in ("term", "GPU GiB per device", "host GiB per node"):
        t.add_column(col, justify="left" if col == "term" else "right")
    for k in sorted(set(gpu) | set(host)):
        t.add_row(k, gib(gpu[k]) if k in gpu else "", gib(host[k]) if k in host else "")
    return t


def limits_text(plan: Plan) -> str:
    """``usable: a device 76.7 of 79.1 GiB (band ±12 %, assumed: ...); a node ...``: the limits
    the verdict holds the peaks against (the guard's thresholds) and the plan's bands."""
    hw = plan.hardware
    parts = []
    if hw.device == "cuda":
        band, why = plan.band("gpu")
        parts.append(f"a device {gib(plan.gpu_limit)} of {gib(hw.gpu_memory)} GiB (band ±{band:.0%}, {why})")
    band, why = plan.band("host")
    bands = why if why.startswith("per process") else f"±{band:.0%}, {why}"  # (per process: each kind's)
    parts.append(f"a node {gib(plan.host_limit)} of {gib(hw.host_memory)} GiB (band {bands})")
    return "usable: " + "; ".join(parts)


def problem_line(plan: Plan, p) -> str:
    """``GPU per device in update at expected lengths: 72.4 GiB ±12% against 76.7 usable``."""
    what = "GPU per device" if p.resource == "gpu" else "host on node 0"
    when = f" from step {p.step}" if p.step else ""
    at = (" at expected lengths" if p.at == "expected" else " at the caps") if plan.expected else ""
    return f"{what} in {p.phase}{when}{at}: {gib(p.need)} GiB ±{p.band:.0%} against {gib(p.limit)} usable"


def verdict(plan: Plan) -> str:
    """The verdict by :class:`~fitrl.memory.model.Plan`'s rule, what decided it, and the limits."""
    call, problems = plan.judged()
    if call == "fits":
        at = " at the caps and at the expected lengths" if plan.expected is not None else ""
        head = f"[bold green]fits[/]{at}, peaks taken at the top of the plan's band:"
    elif call == "tight":
        head = ("[bold yellow]tight[/]: the limit is inside the plan's band (`fitrl train` goes on; the guard stops "
                "it cleanly if memory runs out):")
    else:
        head = "[bold red]does not fit[/], even at the low end of the plan's band:"
    return "\n".join([head, *(f"  {problem_line(plan, p)}" for p in problems), limits_text(plan)])


RECOMMENDATION_TITLES = {
    # fits: recommend() offers only faster changes that keep it fitting
    "fits": "speed-ups that still fit (the plan fits as it is)",
    # tight and does not fit: changes that lower a peak, slow-downs among them (planner/recommend.py)
    "tight": "changes that lower the peaks (cheapest in speed first, slower ones among them; tight: the run "
             "starts as it is)",
    "does not fit": "recommendations (cheapest in speed first; those that lower the deciding peak before the rest)",
}
"""The recommendation table's title by the plan's verdict: what :func:`recommend` lists for it."""


def recommendation_table(recs: list[Recommendation], combo: Optional[Recommendation],
                         verdict: str = "does not fit", cuda: bool = True) -> Optional[Table]:
    """A row per change: the change and, under it, its cost; the predicted change of the peak per
    GPU and per node; whether it then fits. Titled by what it lists for ``verdict``
    (:data:`RECOMMENDATION_TITLES`). Keys are folded, never cut, at 80 columns."""
    if not recs and not combo:
        return None
    title = RECOMMENDATION_TITLES[verdict]
    t = Table(title=title, title_justify="left")
    t.add_column("change (cost)", overflow="fold")
    if cuda:
        t.add_column("GPU GiB", justify="right")
    t.add_column("host GiB", justify="right")
    t.add_column("then")
    rows = [(r, r.change.cost) for r in recs] + ([(combo, "together")] if combo else [])
    for r, cost in rows:
        change = f"[bold]{r.change.text}[/]" if r is combo else r.change.text
        cells = [f"{change}\n[dim]{cost}{_growth_note(r)}[/]"] + ([_delta(r.gpu_delta)] if cuda else [])
        cells.append(_delta(r.host_delta))
        t.add_row(*cells, "[green]fits[/]" if r.fits else "[yellow]tight[/]" if r.plan.fits else "still short")
    return t


def _delta(n: float) -> str:
    return f"{'+' if n >= 0 else '−'}{abs(n) / C.GIB:,.1f}"


def _growth_note(r: Recommendation) -> str:
    """``; no growth (was +427.9 GiB/step)`` for a change that stops the host's growth per step."""
    if r.plan.growth_per_step == 0 and r.base_growth:
        return f"; no growth (was +{gib(r.base_growth)} GiB/step)"
    return ""


def print_plan(plan: Plan, recs: list[Recommendation], combo: Optional[Recommendation],
               console: Optional[Console] = None) -> None:
    if console is None:
        console = Console()
    console.print(describe_run(plan), highlight=False, soft_wrap=False)
    for table in phase_tables(plan):
        console.print(table)
    console.print(process_table(plan))
    assumed = assumed_table(plan)
    if assumed is not None:
        console.print(assumed)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=False)
    console.print(verdict(plan), soft_wrap=False)
    table = recommendation_table(recs, combo, verdict=plan.verdict, cuda=plan.hardware.device == "cuda")
    if table is not None:
        console.print(table)
        best = next((r for r in recs if r.fits), combo)
        if best is not None and plan.verdict != "fits":
            console.print("to apply: " + " ".join(as_overrides(best.change)), highlight=False, soft_wrap=False)
