"""The report page: sections of figures, the run's summary and samples, rendered with Jinja2 into
one HTML file that opens without a network (plotly.js is inlined once, in the head; each figure
is a ``div`` and a ``Plotly.newPlot`` call)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from jinja2 import Environment, FileSystemLoader

from fitrl.report import keys as K
from fitrl.report.load import ReportError, RunData, load_run

FIGURE_CONFIG = {"displaylogo": False, "responsive": True}


@dataclass
class Figure:
    title: str
    html: str
    wide: bool = False


@dataclass
class Section:
    title: str
    anchor: str
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)


def _figures_module():
    """:mod:`fitrl.report.figures`, or a one-line error naming the extra when plotly is missing."""
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise ReportError("fitrl report needs plotly: pip install 'fitrl[report]'") from None
    from fitrl.report import figures

    return figures


class _Figures:
    """Turns plotly figures into page figures with ids unique on the page."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, fig, wide: bool = False) -> Optional[Figure]:
        if fig is None:
            return None
        self.count += 1
        title = fig.layout.title.text or f"figure {self.count}"
        html = fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"fig-{self.count}",
                           default_height=f"{fig.layout.height}px", config=FIGURE_CONFIG)
        return Figure(title, html, wide)


def build_sections(run: RunData) -> list[Section]:
    F = _figures_module()
    make = _Figures()
    step_keys, val_keys = run.step_keys(), run.val_keys()
    shown: set[str] = set()

    training = Section("Training", "training")
    training.figures.append(make(F.reward_figure(run)))
    shown |= {"reward/mean", "reward/std", "val/reward/mean", *K.by_source(step_keys, "").values(),
              *K.by_source(val_keys, "val/").values()}
    accuracy = K.validation_accuracy(val_keys)
    if accuracy is not None:
        training.figures.append(make(F.accuracy_figure(run, accuracy)))
        shown.add(accuracy)
    components = F.components_figure(run)
    if components is not None:
        training.figures.append(make(components))
        shown |= {*K.reward_components(step_keys, ""), *K.reward_components(val_keys, "val/")}
    for chart in K.training_charts(step_keys, val_keys):
        training.figures.append(make(F.line_chart(run, chart)))
        shown |= {*chart.keys, *chart.secondary}
    at_n = K.at_n(val_keys)
    if at_n:
        training.figures.append(make(F.plain_figure(run, "Validation @n (mean, best, majority vote)", at_n)))
        shown |= set(at_n)

    speed = Section("Time and throughput", "time")
    phases = K.phase_times(step_keys)
    speed.figures.append(make(F.phase_time_figure(run, phases)))
    shown |= {*phases, "time/step", "val/time"}
    perf = K.perf_charts(step_keys)
    for chart in perf:
        speed.figures.append(make(F.line_chart(run, chart)))
        shown |= set(chart.keys)
    if not perf:
        speed.notes.append("no perf/* metrics (tokens/s, MFU) in this run's metrics.jsonl")

    memory = memory_section(run, F, make)
    shown |= {k for k in step_keys if k.startswith(K.MEMORY_PREFIX)}

    other = Section("Other metrics", "other")
    for name, group in K.other_groups(step_keys, val_keys, shown).items():
        other.figures.append(make(F.plain_figure(run, name, group)))

    sections = [training, speed, memory, other]
    for section in sections:
        section.figures = [f for f in section.figures if f is not None]
    return [s for s in sections if s.figures or s.notes or s.events]


def memory_section(run: RunData, F, make: _Figures) -> Section:
    section = Section("Memory per process and phase", "memory")
    section.figures.append(make(F.memory_overview_figure(run), wide=True))
    if run.plan is not None:
        p = run.plan.record
        hw = p.get("hardware", {})
        section.notes.append(
            f"memory plan: {'fits' if p.get('fits') else 'predicted NOT to fit'} on {hw.get('device', '?')} "
            f"({hw.get('nodes', '?')} node(s) x {hw.get('gpus_per_node', '?')}, host {hw.get('host_memory_gib', 0):.1f} GiB"
            + (f", GPU {hw['gpu_memory_gib']:.1f} GiB" if hw.get("gpu_memory_gib") else "")
            + "); its predicted peak per process and phase is the dashed red line")
    for e in run.events:
        if e.get("event") == "memory":  # (the load's and the end's readings: numbers, not something that happened)
            continue
        text = e.get("message") or ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("step", "event"))
        section.events.append({"step": e.get("step"), "event": e.get("event"), "text": text})
    for process, phases in K.memory_processes(run.step_keys()).items():
        for resource in ("host", "gpu"):
            section.figures.append(make(F.process_memory_figure(run, process, phases, resource), wide=True))
    if not any(f for f in section.figures):
        section.notes.append("no mem/* metrics in this run's metrics.jsonl (memory.telemetry off?)")
    return section


def summary_rows(run: RunData) -> list[tuple[str, str]]:
    cfg = run.config
    rows = []
    model = cfg.get("actor", {}).get("model", {}).get("path") if isinstance(cfg.get("actor"), dict) else None
    if model:
        rows.append(("model", str(model)))
    algo = cfg.get("algorithm", {})
    if isinstance(algo, dict) and algo.get("adv_estimator"):
        rows.append(("algorithm", f"{algo.get('adv_estimator')} / {algo.get('policy_loss', '')}"))
    rows.append(("steps recorded", f"{len(run.steps)} (last {run.last_step}"
                 + (f" of {run.max_steps})" if run.max_steps is not None else ")")))
    _, rewards = run.series("reward/mean")
    if rewards:
        rows.append(("train reward/mean", f"first {rewards[0]:.3f}, last {rewards[-1]:.3f}, best {max(rewards):.3f}"))
    steps, val = run.series("val/reward/mean")
    if val:
        rows.append(("validation reward/mean", f"{val[-1]:.3f} at step {steps[-1]} (best {max(val):.3f})"))
    accuracy = K.validation_accuracy(run.val_keys())
    steps, values = run.series(accuracy) if accuracy else ([], [])
    if len(values) > 1:
        rows.append((f"validation accuracy ({accuracy.split('/')[-1]})",
                     f"{values[0]:.3f} at step {steps[0]} → {values[-1]:.3f} at step {steps[-1]} (best {max(values):.3f})"))
    _, times = run.series("time/step")
    if times:
        rows.append(("training time", f"{sum(times):.1f} s over {len(times)} steps ({sum(times) / len(times):.2f} s/step)"))
    events = len(run.leak_warnings()), len(run.guard_stops())
    rows.append(("memory events", f"{events[0]} leak warning(s), {events[1]} guard stop(s)"))
    return rows


def render(run: RunData) -> str:
    sections = build_sections(run)
    from plotly.offline import get_plotlyjs

    env = Environment(loader=FileSystemLoader(Path(__file__).parent / "templates"), autoescape=True,
                      trim_blocks=True, lstrip_blocks=True)
    return env.get_template("report.html.j2").render(
        run_name=run.run_dir.resolve().name, run_dir=str(run.run_dir), status=run.status(),
        generated=time.strftime("%Y-%m-%d %H:%M:%S"), summary=summary_rows(run), notes=run.notes,
        sections=sections, samples=[sample_row(s) for s in reversed(run.samples)], config_text=run.config_text,
        plan_text=json.dumps(run.plan.record, indent=1) if run.plan else None, plotlyjs=get_plotlyjs())


def sample_row(sample: dict) -> dict:
    """A generations.jsonl record (fitrl/trainer/generations.py) as table cells: text, which the
    template escapes. Fields the table has no column for are listed under the components."""
    def text(value) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            return f"{value:.4g}"
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    components = sample.get("reward_components", sample.get("components"))
    lines = [f"{k}: {text(v)}" for k, v in components.items()] if isinstance(components, dict) else \
        ([text(components)] if components is not None else [])
    known = {"step", "split", "reward", "prompt", "response", "answer", "components", "reward_components", "source",
             "origin", "conversation", "agent"}
    lines += [f"{k}: {text(v)}" for k, v in sample.items() if k not in known]
    response = text(sample.get("response"))
    if isinstance(sample.get("conversation"), list):  # a multi-turn episode: every turn after the prompt
        response = conversation_text(sample["conversation"])
    if isinstance(sample.get("agent"), dict):
        a = sample["agent"]
        lines.append(f"episode: {text(a.get('turns'))} turns, {text(a.get('tool_calls'))} tool calls, "
                     f"{text(a.get('tool_errors'))} errors, {text(a.get('tool_timeouts'))} timeouts"
                     + (f", cut by {a['cut']}" if a.get("cut") else ""))
    return {"step": text(sample.get("step")), "split": text(sample.get("split")), "reward": text(sample.get("reward")),
            "source": "\n".join(text(sample[k]) for k in ("source", "origin") if sample.get(k) is not None),
            "prompt": text(sample.get("prompt")), "response": response,
            "answer": text(sample.get("answer")), "components": "\n".join(lines)}


def conversation_text(messages: list) -> str:
    """An episode's turns after its prompt (from the first assistant turn on), one block each:
    ``[assistant]``, ``[tool calculator]``, ``[user]`` and the text, as the model wrote or read it."""
    start = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
                 len(messages))
    blocks = []
    for m in messages[start:]:
        if not isinstance(m, dict):
            continue
        who = m.get("role", "?") + (f" {m['name']}" if m.get("role") == "tool" and m.get("name") else "")
        blocks.append(f"[{who}] {m.get('content', '')}")
    return "\n".join(blocks)


def write_report(run_dir: Path | str, out: Optional[Path | str] = None, samples: int = 20) -> Path:
    """Read ``run_dir`` and write its page to ``out`` (default ``run_dir/report.html``); returns the path."""
    run = load_run(run_dir, samples=samples)
    html = render(run)
    out = Path(out) if out is not None else Path(run_dir) / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(out)  # a browser reloading the page never sees half of it
    return out
