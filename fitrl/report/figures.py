"""The report's plotly figures, built from :class:`~fitrl.report.load.RunData` (no file access).

Conventions on every chart: x is the RL step; validation series are drawn with markers (they are
sparse); the plan's predicted peak is a dashed red line; leak warnings are orange and guard stops
black vertical lines. Axis ranges are plotly's own, except a left axis whose values span more than
three decades (log) or are one constant (zero to twice it: plotly would pad it by +-1).
"""

from __future__ import annotations

import math
from typing import Optional

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from fitrl.report.keys import ChartKeys, by_source, reward_components
from fitrl.report.load import RunData

PALETTE = qualitative.Plotly + qualitative.D3
PLAN_COLOR = "#d62728"
LEAK_COLOR = "#ff7f0e"
GUARD_COLOR = "#111111"
RESTART_COLOR = "#1f77b4"
HEIGHT = 330
MANY_POINTS = 60  # above this a line has no markers (they would hide it)


def _layout(fig: go.Figure, title: str, height: int = HEIGHT, y_title: str = "") -> go.Figure:
    fig.update_layout(title=dict(text=title, x=0.01, font=dict(size=15)), template="plotly_white", height=height,
                      margin=dict(l=55, r=20, t=45, b=40), hovermode="x unified",
                      legend=dict(orientation="h", yanchor="top", y=-0.15, x=0, font=dict(size=11)))
    fig.update_xaxes(title_text="step", title_standoff=4)
    if y_title:
        fig.update_yaxes(title_text=y_title)
    return fig


def _line(run: RunData, key: str, name: Optional[str] = None, color: Optional[str] = None, dash: str = "solid",
          **kwargs) -> Optional[go.Scatter]:
    xs, ys = run.series(key)
    if not xs:
        return None
    val = key.startswith("val/")
    mode = "lines+markers" if val or len(xs) <= MANY_POINTS else "lines"
    return go.Scatter(x=xs, y=ys, name=name or key, mode=mode, line=dict(color=color, dash=dash),
                      marker=dict(size=7 if val else 4, symbol="diamond" if val else "circle"), **kwargs)


def _add(fig: go.Figure, trace: Optional[go.Scatter], **kwargs) -> None:
    if trace is not None:
        fig.add_trace(trace, **kwargs)


def line_chart(run: RunData, chart: ChartKeys) -> go.Figure:
    """``chart.keys`` on the left axis and ``chart.secondary`` (dotted) on a right axis."""
    fig = make_subplots(specs=[[{"secondary_y": bool(chart.secondary)}]])
    for i, key in enumerate(chart.keys):
        _add(fig, _line(run, key, color=PALETTE[i % len(PALETTE)]), secondary_y=False)
    for i, key in enumerate(chart.secondary):
        _add(fig, _line(run, key, color=PALETTE[(len(chart.keys) + i) % len(PALETTE)], dash="dot"), secondary_y=True)
    _layout(fig, chart.title)
    left = [y for t in fig.data if t.yaxis in (None, "y") for y in t.y or () if y is not None]
    if _spans_decades(left):
        fig.update_yaxes(type="log", secondary_y=False)  # e.g. FLOPs beside tokens/s: linear would flatten all but one
    elif left and min(left) == max(left) != 0:
        # plotly pads a constant to +-1, which shows a learning rate of 1e-5 as 0: from zero to twice it instead
        fig.update_yaxes(range=sorted([0, 2 * left[0]]), secondary_y=False)
    if chart.y_title:
        fig.update_yaxes(title_text=chart.y_title, secondary_y=False)
    if chart.secondary:
        fig.update_yaxes(title_text=chart.secondary_title, secondary_y=True, showgrid=False, rangemode="tozero",
                         tickmode="auto")
    return fig


def _spans_decades(values: list[float], decades: int = 3) -> bool:
    """All positive and the largest over 10^decades times the smallest."""
    values = [v for v in values if v is not None]
    return bool(values) and min(values) > 0 and max(values) > 10**decades * min(values)


def reward_figure(run: RunData) -> Optional[go.Figure]:
    """Training reward (mean with a ±1 std band across the step's samples), validation reward,
    and validation (and training) reward by data source when the run logs it."""
    fig = go.Figure()
    xs, mean = run.series("reward/mean")
    sx, std = run.series("reward/std")
    if xs and sx == xs:
        fig.add_trace(go.Scatter(x=xs + xs[::-1], y=[m + s for m, s in zip(mean, std)] + [m - s for m, s in
                                 zip(mean, std)][::-1], fill="toself", fillcolor="rgba(31,119,180,0.12)",
                                 line=dict(width=0), hoverinfo="skip", name="train ±1 std"))
    _add(fig, _line(run, "reward/mean", "train (reward/mean)", PALETTE[0]))
    _add(fig, _line(run, "val/reward/mean", "validation (val/reward/mean)", PALETTE[1]))
    color = 2
    for prefix, label in (("val/", "validation"), ("", "train")):
        sources = by_source(run.val_keys() if prefix else run.step_keys(), prefix)
        for source, key in sorted(sources.items()):
            _add(fig, _line(run, key, f"{label} {source}", PALETTE[color % len(PALETTE)],
                            dash="solid" if prefix else "dash"))
            color += 1
    if not fig.data:
        return None
    return _layout(fig, "Reward (train and validation" + (", by source)" if color > 2 else ")"), y_title="reward")


def accuracy_figure(run: RunData, key: str) -> Optional[go.Figure]:
    """Validation accuracy at each validation, its first and last values in the title: what
    training did to the policy, the figure a reader looks for first."""
    xs, ys = run.series(key)
    if not xs:
        return None
    fig = go.Figure()
    _add(fig, _line(run, key, name=key, color=PALETTE[2]))
    title = f"Validation accuracy ({key.split('/')[-1]})"
    if len(xs) > 1:  # short: the chart's toolbar covers the title's right end
        title += f": {ys[0]:.3f} → {ys[-1]:.3f}"
    fig.update_yaxes(rangemode="tozero")
    return _layout(fig, title, y_title="fraction correct")


def components_figure(run: RunData) -> Optional[go.Figure]:
    """The reward function's components (train solid, validation with markers), one colour each."""
    train = reward_components(run.step_keys(), "")
    val = reward_components(run.val_keys(), "val/")
    if not train and not val:
        return None
    names = list(dict.fromkeys(k.split("/")[-1] for k in train + val))
    fig = go.Figure()
    for key in train + val:
        color = PALETTE[names.index(key.split("/")[-1]) % len(PALETTE)]
        _add(fig, _line(run, key, color=color, dash="solid" if key in train else "dot"))
    return _layout(fig, "Reward components", y_title="mean")


def plain_figure(run: RunData, title: str, keys: list[str], y_title: str = "") -> go.Figure:
    return line_chart(run, ChartKeys(title, keys, y_title=y_title))


def phase_time_figure(run: RunData, phase_keys: list[str]) -> Optional[go.Figure]:
    """Seconds per phase, stacked per step; ``untimed`` is what ``time/step`` has beyond its phases,
    and validation (outside ``time/step``) is stacked on the steps that ran one."""
    if not phase_keys and "time/step" not in run.step_keys():
        return None
    steps = sorted(run.steps)
    fig = go.Figure()
    for i, key in enumerate(phase_keys):
        xs, ys = run.series(key)
        fig.add_trace(go.Bar(x=xs, y=ys, name=key[5:], marker_color=PALETTE[i % len(PALETTE)]))
    untimed = [(s, run.steps[s]["time/step"] - sum(run.steps[s].get(k, 0.0) for k in phase_keys))
               for s in steps if "time/step" in run.steps[s]]
    if any(v > 1e-3 for _, v in untimed):
        fig.add_trace(go.Bar(x=[s for s, _ in untimed], y=[max(v, 0.0) for _, v in untimed], name="untimed",
                             marker_color="#c7c7c7"))
    xs, ys = run.series("val/time")
    if xs:
        fig.add_trace(go.Bar(x=xs, y=ys, name="validation (val/time)", marker_color="#8c564b"))
    fig.update_layout(barmode="stack", bargap=0.1)
    return _layout(fig, "Time per phase (stacked per step)", y_title="seconds")


# ------------------------------------------------------------------------------------ memory

def _event_lines(fig: go.Figure, run: RunData, process: Optional[str] = None, resource: Optional[str] = None,
                 cells: Optional[dict[str, tuple[int, int]]] = None) -> None:
    """Vertical lines at leak warnings (of ``process`` and ``resource``; every one with None), at
    every guard stop, hang and restart. With ``cells`` (a subplot grid: phase -> (row, col)) the lines cross every
    subplot and a leak is labelled in its phase's subplot (else the first); the whole figure otherwise."""
    span = {"row": "all", "col": "all"} if cells else {}
    first = next(iter(cells.values())) if cells else None

    def label(text: str, step, color: str, xanchor: str, cell, y: float) -> None:
        where = {"row": cell[0], "col": cell[1]} if cell else {}
        fig.add_annotation(x=step, y=y, yref="y domain", text=text, showarrow=False, xanchor=xanchor, yanchor="top",
                           font=dict(color=color, size=11), bgcolor="rgba(255,255,255,0.85)", **where)

    for e in run.leak_warnings():
        if process is not None and (e.get("process") != process or e.get("kind") != resource):
            continue
        step, rate = e.get("step"), e.get("rate_mib_per_step")
        fig.add_vline(x=step, line=dict(color=LEAK_COLOR, width=2, dash="dash"), **span)
        text = f"leak? {e.get('process')} {e.get('phase')}" + (
            f" +{rate:.1f} MiB/step" if isinstance(rate, (int, float)) else "")
        label(text, step, LEAK_COLOR, "left", (cells or {}).get(e.get("phase"), first), y=1.0)
    for e in run.guard_stops():
        step = e.get("step")
        fig.add_vline(x=step, line=dict(color=GUARD_COLOR, width=2), **span)
        text = f"guard stop: {e.get('kind') or ''} memory" + (f" in {e['phase']}" if e.get("phase") else "")
        label(text, step, GUARD_COLOR, "right", first, y=0.88)  # below a leak label near it
    for e in run.hangs():
        step = e.get("step")
        fig.add_vline(x=step, line=dict(color=GUARD_COLOR, width=2, dash="dot"), **span)
        label(f"hang in {e.get('phase')}", step, GUARD_COLOR, "right", first, y=0.76)
    for e in run.restarts():  # at the checkpoint resumed from; the cause's kind (WorkerFailed, Hung, EngineBroken)
        step = e.get("step")
        fig.add_vline(x=step, line=dict(color=RESTART_COLOR, width=2, dash="dashdot"), **span)
        cause = str(e.get("cause", "")).split(":")[0]
        label(f"restart {e.get('restart')}" + (f": {cause}" if cause else ""), step, RESTART_COLOR, "left", first,
              y=0.64)


def memory_overview_figure(run: RunData) -> Optional[go.Figure]:
    """Run-wide memory per step: the largest process peak (host, GPU), and the node's lowest
    available memory on the right axis; every leak warning and guard stop marked."""
    keys = run.step_keys()
    left = [k for k in ("mem/host_peak_gib", "mem/host_rss_gib", "mem/gpu_peak_gib") if k in keys]
    right = [k for k in ("mem/node_available_min_gib",) if k in keys]
    if not left and not right:
        return None
    fig = line_chart(run, ChartKeys("Memory, whole run (largest process; node available on the right)", left, right,
                                    y_title="GiB", secondary_title="node available GiB"))
    _event_lines(fig, run)
    return fig


FIELDS = {  # resource -> (field, legend label, dash) drawn per phase
    # (host_uss_gib is left out: it is read every memory.uss_every steps, on a step's last phase: scattered points)
    "host": [("host_peak_gib", "peak RSS in phase", "solid"), ("host_rss_gib", "RSS at phase end", "dot")],
    "gpu": [("gpu_peak_gib", "peak allocated in phase", "solid"), ("gpu_allocated_gib", "allocated at phase end", "dot"),
            ("gpu_reserved_gib", "reserved at phase end", "dashdot"),
            ("gpu_peak_reserved_gib", "peak reserved in phase", "longdash"),
            ("gpu_device_used_gib", "device used at phase end (context included)", "longdashdot")],
}


def process_memory_figure(run: RunData, process: str, phases: dict[str, set[str]], resource: str) -> Optional[go.Figure]:
    """One subplot per phase of ``process``: measured ``resource`` memory (``host`` or ``gpu``)
    per step and, where the plan predicts this process and phase, its peak as a dashed line."""
    fields = [f for f in FIELDS[resource] if any(f[0] in have for have in phases.values())]
    names = [ph for ph, have in phases.items() if any(f[0] in have for f in fields)]
    if not names:
        return None
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    # the plan at the expected lengths (a typical step's), and at the caps where that differs
    predicted = {ph: run.plan.peak(process, ph, resource) if run.plan else None for ph in names}
    caps = {ph: run.plan.peak(process, ph, resource, at="caps") if run.plan else None for ph in names}

    def title(ph: str) -> str:
        if predicted[ph] is None:
            return ph
        at_caps = f", caps {caps[ph]:.2f}" if caps[ph] is not None and abs(caps[ph] - predicted[ph]) >= 0.005 else ""
        return f"{ph} · plan {predicted[ph]:.2f} GiB{at_caps}"

    titles = [title(ph) for ph in names]
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=titles, vertical_spacing=min(0.12, 0.45 / rows),
                        horizontal_spacing=0.06)
    cells = {}
    first_x, last_x = min(run.steps, default=0), max(run.steps, default=0)
    for i, phase in enumerate(names):
        row, col = i // cols + 1, i % cols + 1
        cells[phase] = (row, col)
        for j, (field, label, dash) in enumerate(fields):
            trace = _line(run, f"mem/{process}/{phase}/{field}", label, PALETTE[j], dash, legendgroup=field,
                          showlegend=i == 0)
            _add(fig, trace, row=row, col=col)
        if predicted[phase] is not None:
            fig.add_trace(go.Scatter(x=[first_x, last_x], y=[predicted[phase]] * 2, mode="lines",
                                     name="plan's predicted peak", legendgroup="plan",
                                     showlegend=not any(predicted[p] is not None for p in names[:i]),
                                     line=dict(color=PLAN_COLOR, dash="dash", width=2)), row=row, col=col)
    fig.update_xaxes(matches="x")
    what = "host memory (RSS of the process)" if resource == "host" else "GPU memory (torch allocator)"
    _layout(fig, f"{process}: {what} per phase, GiB", height=90 + 230 * rows)
    fig.update_annotations(font_size=12)  # the subplot titles
    _event_lines(fig, run, process, resource, cells)
    return fig
