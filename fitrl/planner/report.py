"""Printing a plan with rich tables: per phase the device and node peaks, the breakdown of the
worst phase, the verdict, and the recommendations with their predicted effect."""

from __future__ import annotations

import sys
from typing import Optional

from rich.console import Console
from rich.table import Table

from fitrl.memory import calibration as C
from fitrl.memory.model import Plan
from fitrl.memory.roles import ROLE_PLANNERS
from fitrl.planner.recommend import Recommendation, as_overrides


def gib(n: float) -> str:
    return f"{n / C.GIB:,.1f}"


def signed(n: float) -> str:
    return f"{'+' if n >= 0 else '−'}{abs(n) / C.GIB:,.1f} GiB"


def count_text(n: int) -> str:
    """A parameter count people read: 7.62B, 494M, 156K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}" if unit == "B" else f"{n / size:.0f}{unit}"
    return str(n)


def describe_run(plan: Plan) -> str:
    hw, s, cfg = plan.hardware, plan.shape, plan.cfg
    where = (f"{hw.nodes} node(s) x {hw.gpus_per_node} GPU(s) of {gib(hw.gpu_memory)} GiB, "
             if hw.device == "cuda" else f"CPU, {hw.gpus_per_node} rank(s), ")
    return (f"{s.model_type} {count_text(s.num_params)} params ({s.layers} layers, hidden {s.hidden}, vocab {s.vocab:,}) "
            f"on {where}{gib(hw.host_memory)} GiB host per node; {cfg.data.rollout_batch_size} prompts x "
            f"{cfg.rollout.n} samples, prompt <= {cfg.data.max_prompt_length:,}, response <= "
            f"{cfg.rollout.max_response_length:,} tokens" + _expected_text(plan))


def _expected_text(plan: Plan) -> str:
    """``; expected: prompt 180 (the longest of 1,000 prompts read from ...), response 400 (plan....) tokens``."""
    if plan.lengths is None or plan.lengths.at_caps(plan.cfg):
        return "; expected lengths: the caps"
    return f"; expected: {plan.lengths.describe()}"


def phase_table(plan: Plan) -> Table:
    """Per phase the peaks at the caps with their largest parts, and, with expected lengths
    shorter than the caps, the peaks at those lengths beside them (the verdict reads both)."""
    cuda, exp = plan.hardware.device == "cuda", plan.expected
    t = Table(title="peak memory per phase (steady state; at the caps" + (", and at expected lengths" if exp else "")
              + ")", title_justify="left")
    t.add_column("phase")
    if cuda:
        t.add_column("GPU / device GiB", justify="right")
        if exp:
            t.add_column("expected", justify="right")
        t.add_column("largest GPU parts")
    t.add_column("host / node GiB", justify="right")
    if exp:
        t.add_column("expected", justify="right")
    t.add_column("largest host parts")
    for ph in plan.phases:
        dev, host = plan.device(ph), plan.node_host(ph)
        gd, hd = sum(dev.values()), sum(host.values())
        row = [ph]
        if cuda:
            row += [_mark(gd, plan.gpu_limit)] + ([_mark(sum(exp.device(ph).values()), exp.gpu_limit)] if exp else [])
            row += [_top(dev)]
        row += [_mark(hd, plan.host_limit)] + ([_mark(sum(exp.node_host(ph).values()), exp.host_limit)] if exp else [])
        row += [_top(host)]
        t.add_row(*row)
    return t


def _mark(n: int, limit: int) -> str:
    return f"[bold red]{gib(n)}[/]" if n > limit else gib(n)


def _top(parts: dict[str, int], k: int = 4) -> str:
    items = sorted(parts.items(), key=lambda kv: -kv[1])[:k]
    return ", ".join(f"{name} {gib(v)}" for name, v in items if v >= C.GIB // 100)


def process_table(plan: Plan) -> Table:
    cuda = plan.hardware.device == "cuda"
    t = Table(title="per process (peak over phases)", title_justify="left")
    for col in ("process", "per node", *(("GPU GiB",) if cuda else ()), "host GiB", "host peak phase"):
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
            t.add_row(names.get(p.kind, p.kind), str(p.per_node), *((gib(gpu),) if cuda else ()), gib(host), peak_phase)
    return t


def verdict(plan: Plan) -> str:
    """The verdict by :class:`~fitrl.memory.model.Plan`'s rule, with what decided it."""
    hw = plan.hardware
    within = (f"every device <= {C.GPU_MARGIN:.0%} of {gib(hw.gpu_memory)} GiB, every node <= {C.HOST_MARGIN:.0%} "
              f"of {gib(hw.host_memory)} GiB" if hw.device == "cuda"
              else f"host <= {C.HOST_MARGIN:.0%} of {gib(hw.host_memory)} GiB")
    problems = plan.problems()
    if not problems and plan.verdict == "fits":
        return f"[bold green]fits[/]: {within}" + (" at the caps" if plan.expected else "")
    if not problems:
        lines = [f"[bold yellow]fits at expected lengths[/]: {within} at {plan.lengths.describe()}; at the caps "
                 f"within the whole device and node, but over the margin:"]
        problems = plan.over(plan.gpu_limit, plan.host_limit)
    else:
        lines = ["[bold red]does not fit[/]:"]
    for p in problems:
        what = "GPU memory per device" if p.resource == "gpu" else "host memory on node 0"
        when = f" from step {p.step}" if p.step else ""
        at = (" at expected lengths" if p.at == "expected" else " at the caps") if plan.expected else ""
        total = hw.gpu_memory if p.resource == "gpu" else hw.host_memory
        limit = "all of the memory" if p.limit == total else "limit"
        lines.append(f"  {what} in {p.phase}{when}{at}: {gib(p.need)} GiB > {gib(p.limit)} GiB {limit}")
    return "\n".join(lines)


def recommendation_table(recs: list[Recommendation], combo: Optional[Recommendation],
                         fits: bool = False) -> Optional[Table]:
    if not recs and not combo:
        return None
    title = ("speed-ups that still fit (the plan fits as it is)" if fits
             else "recommendations (cheapest in speed first; those that lower the deciding peak before the rest)")
    t = Table(title=title, title_justify="left")
    for col in ("change", "GPU / device", "host / node", "then", "cost"):
        t.add_column(col)
    for r in recs:
        t.add_row(r.change.text, signed(r.gpu_delta), _host_effect(r),
                  "[green]fits[/]" if r.fits else "still short", r.change.cost)
    if combo:
        t.add_row(f"[bold]{combo.change.text}[/]", signed(combo.gpu_delta), _host_effect(combo),
                  "[green]fits[/]" if combo.fits else "still short", "together")
    return t


def _host_effect(r: Recommendation) -> str:
    text = signed(r.host_delta)
    if r.plan.growth_per_step == 0 and r.base_growth:
        text += f" (no growth: was +{gib(r.base_growth)} GiB/step)"
    return text


def print_plan(plan: Plan, recs: list[Recommendation], combo: Optional[Recommendation],
               console: Optional[Console] = None) -> None:
    if console is None:  # wide tables when piped (rich would wrap them at 80 columns)
        console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(describe_run(plan), highlight=False)
    console.print(phase_table(plan))
    console.print(process_table(plan))
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)
    console.print(verdict(plan))
    table = recommendation_table(recs, combo, fits=plan.fits)
    if table is not None:
        console.print(table)
        best = next((r for r in recs if r.fits), combo)
        if best is not None and not plan.fits:
            console.print("to apply: " + " ".join(as_overrides(best.change)), highlight=False)
