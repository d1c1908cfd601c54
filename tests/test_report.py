"""``fitrl report``: reading a run directory (finished, still writing, died), the page's content
and escaping, bad input, and the page opened in a real headless Chromium: every chart drawn, no
script error, a screenshot kept under ``.artifacts/``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from browser import check_page_in_browser
from helpers import ROOT, toy_config

from fitrl.cli import main
from fitrl.report.keys import at_n, by_source, other_groups, reward_components
from fitrl.report.load import PlanPredictions, load_run, read_jsonl
from fitrl.report.page import render, write_report

XSS = "<img src=x onerror=\"fitrlError('xss-{}')\">"  # would show in the page's error box if it ran


# ------------------------------------------------------------------------------ run directories

@pytest.fixture(scope="module")
def real_run(tmp_path_factory, tiny_model_dir):
    """A short real run with the memory plan on (so plan.json is written) and two validations."""
    from fitrl.trainer.run import train

    run_dir = tmp_path_factory.mktemp("report") / "run"
    train(toy_config(tiny_model_dir, run_dir, "trainer.max_steps=4", "trainer.val_freq=2", "memory.plan=warn",
                     "trainer.log_freq=100"))
    return run_dir


def _step(s: int) -> dict:
    """One training step of a hand-made run: every chart's keys, a GPU phase and two Ray-style ranks."""
    m = {"step": s, "reward/mean": 0.1 * s, "reward/std": 0.05, "reward/max": 0.2 * s, "reward/exact": 0.05 * s,
         "reward/timeouts": 0.0, "response/length_mean": 5.0 + s, "response/length_max": 9.0,
         "response/clip_ratio": 0.1, "actor/entropy": 2 - 0.1 * s, "actor/kl_loss": 0.01 * s,
         "actor/clip_frac": 0.02, "actor/clip_frac_low": 0.01, "actor/grad_norm": 1.0 + 0.1 * s, "actor/lr": 1e-5,
         "time/rollout": 1.0, "time/old_logprob": 0.2, "time/update": 0.5, "time/step": 1.8,
         "perf/rollout_tokens_per_s": 1000.0 + s, "perf/mfu": 0.3, "advantage/mean": 0.0,
         "mem/host_peak_gib": 1.0 + 0.05 * s, "mem/node_available_min_gib": 20.0, "mem/gpu_peak_gib": 3.0}
    for process in ("driver", "policy.rank0", "ref.rank0"):
        for phase in ("rollout", "update") if process != "ref.rank0" else ("ref",):
            m[f"mem/{process}/{phase}/host_peak_gib"] = 1.0 + 0.05 * s
            m[f"mem/{process}/{phase}/host_rss_gib"] = 0.9 + 0.05 * s
            if process == "policy.rank0":
                m.update({f"mem/{process}/{phase}/gpu_peak_gib": 3.0, f"mem/{process}/{phase}/gpu_allocated_gib": 2.0,
                          f"mem/{process}/{phase}/gpu_reserved_gib": 3.5})
    return m


def _val(s: int) -> dict:
    return {"step": s, "val/reward/mean": 0.1 * s, "val/reward/exact": 0.05 * s, "val/response/length_mean": 6.0,
            "val/by_source/gsm8k/reward/mean": 0.05 * s, "val/by_source/gsm8k/prompts": 10, f"val/by_source/{XSS.format('source')}/reward/mean": 0.02 * s,
            "val/reward/mean@4": 0.1 * s, "val/reward/best@4": 0.2 * s, "val/time": 2.0}


def make_died_run(run_dir: Path) -> Path:
    """A Ray run that died at step 8: a leak warning at 6, a guard stop at 8, no checkpoint, the
    last line of metrics.jsonl cut mid-write; a plan, samples and a config with HTML in them."""
    run_dir.mkdir(parents=True)
    records = [_val(0)]
    for s in range(1, 8):
        records.append(_step(s))
        if s % 4 == 0:
            records.append(_val(s))
        if s == 6:
            records.append({"step": 6, "event": "memory_leak", "process": "policy.rank0", "phase": "rollout",
                            "kind": "host", "rate_mib_per_step": 50.0, "message": "memory leak? <grows> & more"})
    records.append({"step": 8, "event": "memory_guard_stop", "kind": "host", "phase": "update", "process": "driver",
                    "available_gib": 0.4, "checkpoint": None})
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"step": 9, "reward/me'
    (run_dir / "metrics.jsonl").write_text(text)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"trainer": {"max_steps": 20,
                                                                     "experiment_name": XSS.format("config")}}))
    plan = {"fits": True, "hardware": {"device": "cuda", "nodes": 1, "gpus_per_node": 1, "gpu_memory_gib": 80.0,
                                       "host_memory_gib": 64.0},
            "processes": {"trainer": {"per_node": 1, "phases": {"rollout": {"gpu_gib": 3.2, "host_gib": 1.4},
                                                                "update": {"gpu_gib": 3.6, "host_gib": 1.5}}},
                          "driver": {"per_node": 1, "phases": {"update": {"gpu_gib": 0.0, "host_gib": 1.2}}}}}
    (run_dir / "plan.json").write_text(json.dumps(plan))
    samples = [{"step": 4, "split": "val", "origin": "val.jsonl:3", "prompt": f"What is 1 + 2? {XSS.format('sample')}",
                "response": "<script>fitrlError('xss-script')</script> 3", "answer": 3, "reward": 1.0,
                "reward_components": {"exact": 1.0}},
               {"step": 7, "split": "train", "source": "gsm8k", "prompt": "What is 2 + 2?", "response": "4 & <b>more</b>",
                "answer": "4", "reward": 0.5, "components": {"exact": 0.0}, "judge": "ok"}]
    (run_dir / "generations.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return run_dir


@pytest.fixture
def died_run(tmp_path):
    return make_died_run(tmp_path / "died")


# ------------------------------------------------------------------------------ reading

def test_read_jsonl_leaves_out_the_line_being_written_and_bad_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\nnot json\n[1, 2]\n{"step": 2}\n{"step": 3, "x": ')
    read = read_jsonl(path)
    assert [r["step"] for r in read.records] == [1, 2]
    assert read.bad_lines == 2 and read.partial_last
    tail = read_jsonl(path, tail_bytes=len('{"step": 2}\n{"step": 3, "x": ') + 3)  # starts inside "[1, 2]"
    assert [r["step"] for r in tail.records] == [2]


def test_load_died_run(died_run):
    run = load_run(died_run)
    assert sorted(run.steps) == list(range(1, 8))
    assert sorted(run.validation) == [0, 4]
    assert [e["event"] for e in run.events] == ["memory_leak", "memory_guard_stop"]
    assert run.partial_last and any("incomplete" in n for n in run.notes)
    assert run.checkpoints == []
    assert run.status().startswith("stopped by the memory guard at step 8") and "no complete checkpoint" in run.status()
    assert run.max_steps == 20 and len(run.samples) == 2


def test_a_hung_run_is_marked(tmp_path):
    from fitrl.report.figures import memory_overview_figure

    records = [{"step": s, "reward/mean": 0.1 * s, "mem/host_peak_gib": 1.0} for s in range(1, 4)]
    records.append({"step": 4, "event": "hang", "phase": "update", "limit_s": 15,
                    "ranks": {"policy.rank0": 16.0, "policy.rank1": 16.0}})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = load_run(tmp_path)
    assert run.status().startswith("stopped by the hang watchdog at step 4 (phase update, no progress for 15 s")
    fig = memory_overview_figure(run)
    assert any("hang in update" in (a.text or "") for a in fig.layout.annotations)


def test_restarts_are_marked_where_the_run_resumed(tmp_path):
    from fitrl.report.figures import memory_overview_figure

    records = [{"step": s, "reward/mean": 0.1 * s, "mem/host_peak_gib": 1.0} for s in range(1, 3)]
    records.append({"step": 2, "event": "restart", "restart": 1,
                    "cause": "WorkerFailed: policy rank 1 on node 10.0.0.2 died during 'update': crashed"})
    records += [{"step": s, "reward/mean": 0.1 * s, "mem/host_peak_gib": 1.0} for s in range(3, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"trainer": {"max_steps": 4}}))
    run = load_run(tmp_path)
    assert run.status().startswith("finished: 4 of 4 steps after 1 restart (trainer.max_restarts)"), run.status()
    fig = memory_overview_figure(run)
    assert any((a.text or "") == "restart 1: WorkerFailed" for a in fig.layout.annotations)


def test_a_resumed_step_recorded_twice_keeps_the_later_record(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.1}) + "\n"
                                            + json.dumps({"step": 1, "reward/mean": 0.3}) + "\n")
    assert load_run(tmp_path).series("reward/mean") == ([1], [0.3])


def test_keys_matched_by_pattern():
    keys = ["val/reward/mean", "val/by_source/gsm8k/reward/mean", "val/math/reward/mean", "val/reward/mean/aime",
            "val/reward/mean@4", "val/reward/exact", "val/reward/timeouts"]
    assert by_source(keys, "val/") == {"gsm8k": "val/by_source/gsm8k/reward/mean", "math": "val/math/reward/mean",
                                       "aime": "val/reward/mean/aime"}
    assert by_source(["reward/mean", "reward/by_source/a/mean", "val/x/reward/mean"], "") == {"a": "reward/by_source/a/mean"}
    assert at_n(keys) == ["val/reward/mean@4"]
    assert reward_components(keys, "val/") == ["val/reward/exact"]
    groups = other_groups(["advantage/mean", "lonely"], ["val/by_source/a b/prompts", "val/by_source/c/response/length_mean",
                                                         "val/time", "val/reward/std"], shown={"val/time"})
    assert groups == {"advantage": ["advantage/mean"], "misc": ["lonely"], "val/by_source/a b": ["val/by_source/a b/prompts"],
                      "val/by_source/c": ["val/by_source/c/response/length_mean"], "val/reward": ["val/reward/std"]}


def test_plan_predictions_follow_the_process_labels():
    plan = PlanPredictions({"processes": {
        "trainer": {"phases": {"update": {"gpu_gib": 3.0, "host_gib": 1.0}, "ref_logprob": {"gpu_gib": 2.0, "host_gib": 0.5}}},
        "rank0": {"phases": {"update": {"gpu_gib": 0.0, "host_gib": 0.25}}},
        "driver": {"phases": {"update": {"gpu_gib": 0.0, "host_gib": 0.125}}}}})
    assert plan.peak("policy.rank1", "update", "host") == 1.0
    assert plan.peak("policy.rank0", "update", "host") == 1.25         # rank 0's load/save copies on top
    assert plan.peak("rank0", "update", "host") == 1.375               # in-process: the driver is rank 0
    assert plan.peak("rank0", "ref", "gpu") == 2.0                     # the run's "ref" is the plan's ref_logprob
    assert plan.peak("driver", "update", "gpu") is None                # no GPU: no line
    assert plan.peak("ref.rank0", "update", "host") is None            # counted inside the trainer kind
    assert plan.peak("policy.rank0", "rollout", "host") is None        # no prediction for that phase


def test_plan_json_is_what_the_report_reads(tiny_model_dir, tmp_path):
    """The trainer's plan.json (fitrl.trainer.preflight.plan_record) looked up with the run's labels."""
    from fitrl.planner.plan import plan_config
    from fitrl.models.shape import ModelShape
    from fitrl.trainer.preflight import detect_hardware, plan_record

    cfg = toy_config(tiny_model_dir, tmp_path / "run")
    plan = plan_config(cfg, detect_hardware(cfg), shape=ModelShape.from_path(tiny_model_dir))
    record = json.loads(json.dumps(plan_record(plan)))
    assert plan.expected is not None  # the toy task's prompts are shorter than its cap

    def update(p, kind: str) -> float:
        return sum(p.process(kind).phases["update"].host.values()) / 2**30

    caps, expected = (update(p, "trainer") + update(p, "driver") for p in (plan, plan.expected))
    assert expected < caps
    assert PlanPredictions(record).peak("rank0", "update", "host") == pytest.approx(expected)  # by default
    assert PlanPredictions(record).peak("rank0", "update", "host", at="caps") == pytest.approx(caps)
    assert record["phases"] == plan.phases and record["fits"] is True
    # a plan.json written before it kept the expected plan: the caps' figures
    del record["expected_processes"]
    assert PlanPredictions(record).peak("rank0", "update", "host") == pytest.approx(caps)


@pytest.mark.slow  # two short trainings
def test_a_run_without_a_plan_leaves_no_stale_plan_json(tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    run_dir = tmp_path / "run"
    steps = ("trainer.max_steps=1", "trainer.val_before_train=false", "data.val_files=[]")
    train(toy_config(tiny_model_dir, run_dir, *steps, "memory.plan=warn"))
    assert (run_dir / "plan.json").is_file()
    train(toy_config(tiny_model_dir, run_dir, *steps, "memory.plan=off"))  # resumes: nothing to train
    assert not (run_dir / "plan.json").exists()


# ------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing", "no such directory"),
    (lambda d: d, "is not a run directory: it has no metrics.jsonl"),
    (lambda d: (d / "metrics.jsonl").write_text('{"step": 1, "rew') and d, "holds no complete record yet"),
], ids=["missing", "no-metrics", "only-a-partial-line"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, make, message):
    target = make(tmp_path)
    assert main(["report", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fitrl: report: ") and message in err, err


def test_missing_plotly_names_the_extra(died_run, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "plotly", None)  # import plotly -> ImportError
    assert main(["report", str(died_run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'fitrl[report]'" in err, err


# ------------------------------------------------------------------------------ the page

def test_page_of_a_died_run(died_run, capsys):
    assert main(["report", str(died_run)]) == 0
    assert "report.html" in capsys.readouterr().out
    html = (died_run / "report.html").read_text()
    assert html.count("* plotly.js v") == 1  # the library inlined once for the whole page
    assert html.count('class="fitrl-figure') == html.count("Plotly.newPlot(") > 10  # one call per figure
    assert "<script src=" not in html and "<link" not in html  # nothing to fetch
    for where in ("sample", "config", "script"):  # the run's text is escaped, never markup
        assert f"fitrlError('xss-{where}')</script>" not in html and f"<img src=x onerror=\"fitrlError('xss-{where}')" not in html
    assert "&lt;script&gt;fitrlError(&#39;xss-script&#39;)&lt;/script&gt;" in html
    assert "memory leak? &lt;grows&gt; &amp; more" in html
    assert "stopped by the memory guard at step 8" in html
    assert "plan's predicted peak" in html  # the plan's line, in the figures' JSON
    assert "judge: ok" in html and "val.jsonl:3" in html  # fields without a column of their own still show
    # validation accuracy (the exact component) leads the training charts and the summary says where it went
    assert "Validation accuracy (exact): 0.000 \u2192 0.200" in html or "Validation accuracy (exact): 0.000 → 0.200" in html
    assert "0.000 at step 0 → 0.200 at step 4 (best 0.200)" in html


def test_report_path_option_and_live_rewrite(died_run, tmp_path):
    out = write_report(died_run, tmp_path / "sub" / "page.html", samples=1)
    assert out.is_file() and not (died_run / "report.html").exists()
    with open(died_run / "metrics.jsonl", "a") as f:  # the run goes on: the cut line completes, more come
        f.write('an": 0.9}\n' + json.dumps(_step(9)) + "\n")
    run = load_run(died_run)
    assert run.last_step == 9 and not run.partial_last
    assert "stopped by the memory guard at step 8" in render(run)  # the stop stays the run's story


def test_status_of_a_run_still_going(tmp_path):
    (tmp_path / "config.yaml").write_text("trainer:\n  max_steps: 50\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_step(1)) + "\n" + json.dumps(_step(2)) + "\n")
    assert load_run(tmp_path).status().startswith("at step 2 of 50: still running, or stopped early")


# ------------------------------------------------------------------------------ in a real browser

@pytest.mark.slow  # a training run, then Chromium twice (DOM, screenshot)
def test_real_run_page_renders_in_chromium(real_run, tmp_path):
    assert json.loads((real_run / "plan.json").read_text())["processes"]["trainer"]["phases"]["update"]["host_gib"] > 0
    page = write_report(real_run)
    check = check_page_in_browser(page, tmp_path, "report.png", window="1400,9000")
    titles = [f.title for f in check.figures]
    for title in ("Reward (train and validation)", "Entropy", "Clip fractions", "Gradient norm", "Learning rate",
                  "Time per phase (stacked per step)"):
        assert title in titles, titles
    assert any(t.startswith("rank0: host memory") for t in titles), titles
    assert any("plan" in t and "GiB" in t for t in check.texts), "no subplot names the plan's predicted peak"


@pytest.mark.slow  # Chromium twice (DOM, screenshot)
def test_died_run_page_renders_in_chromium(died_run, tmp_path):
    page = write_report(died_run)
    check = check_page_in_browser(page, tmp_path, "report-died.png", window="1400,7000")
    titles = [f.title for f in check.figures]
    assert any(t.startswith("policy.rank0: GPU memory") for t in titles), titles
    assert "Throughput" in titles and "MFU" in titles and any(t.startswith("Validation @n") for t in titles)
    assert any(t.startswith("leak? policy.rank0 rollout") for t in check.texts), "leak warning not marked"
    assert sum(t.startswith("guard stop: host memory in update") for t in check.texts) >= 2, "guard stop not marked"
    assert any("fitrlError('xss-source')" in t for t in check.texts), "the source's name is shown as text"
