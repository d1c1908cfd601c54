"""`fitrl train`'s pre-flight plan is cached on disk: a repeat of a config gets the same plan and
verdict without planning; anything the plan reads changing is a miss; a damaged file is a miss."""

import io
import json
import shutil

import pytest
from rich.console import Console

import fitrl.trainer.preflight as preflight_mod
from fitrl.core.errors import RunStopped
from fitrl.memory import cache
from fitrl.trainer.preflight import detect_hardware, plan_record, preflight
from helpers import toy_config
from test_preflight import QWEN_7B, TOO_BIG


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FITRL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "plans"


@pytest.fixture
def plans(monkeypatch):
    """Counts real planner calls."""
    calls = []
    plan_config = preflight_mod.plan_config

    def counted(*args, **kwargs):
        calls.append(1)
        return plan_config(*args, **kwargs)
    monkeypatch.setattr(preflight_mod, "plan_config", counted)
    return calls


def run(cfg):
    out = io.StringIO()
    return preflight(cfg, Console(file=out, width=200)), out.getvalue()


def config(model, tmp_path, *overrides, run_dir="run"):
    return toy_config(model, tmp_path / run_dir, "memory.plan=enforce", "trainer.device=cpu", *overrides)


def test_repeat_is_a_hit_with_the_same_plan(tiny_model_dir, tmp_path, plans, cache_dir):
    first, text = run(config(tiny_model_dir, tmp_path))
    assert len(plans) == 1 and len(list(cache_dir.glob("*.pkl"))) == 1
    # another run directory, experiment name and plan mode: keys the planner does not read
    cfg = config(tiny_model_dir, tmp_path, "trainer.experiment_name=other", "memory.plan=warn", run_dir="run2")
    second, text2 = run(cfg)
    assert len(plans) == 1, "planned again"
    assert json.dumps(plan_record(second)) == json.dumps(plan_record(first))
    assert second.fits == first.fits and text2 == text and text.startswith("memory plan: fits")
    assert second.cfg is cfg  # the plan is this run's
    assert second.problems() == first.problems() and second.notes == first.notes


def test_anything_read_changing_is_a_miss(tiny_model_dir, tmp_path, plans, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    run(config(model, tmp_path))
    run(config(model, tmp_path, "rollout.max_response_length=16"))   # the config
    assert len(plans) == 2
    spec = json.loads((model / "config.json").read_text())
    spec["intermediate_size"] *= 2
    (model / "config.json").write_text(json.dumps(spec))              # the model
    run(config(model, tmp_path))
    assert len(plans) == 3
    monkeypatch.setattr(preflight_mod, "node_total_bytes", lambda: 64 * 2**30)  # the hardware
    run(config(model, tmp_path))
    assert len(plans) == 4
    monkeypatch.setattr(cache, "_CODE", {**cache._code(), "sources": "edited"})  # fitrl's code
    run(config(model, tmp_path))
    assert len(plans) == 5
    run(config(model, tmp_path))
    assert len(plans) == 5  # and each of those is cached in turn


def test_key_is_stable_and_leaves_out_only_what_is_not_read(tiny_model_dir, tmp_path):
    cfg = config(tiny_model_dir, tmp_path)
    hw = detect_hardware(cfg)
    key = cache.plan_key(cfg, hw)
    assert cache.plan_key(config(tiny_model_dir, tmp_path), detect_hardware(cfg)) == key  # new objects
    assert cache.plan_key(config(tiny_model_dir, tmp_path, "trainer.progress_bar=true", run_dir="x"), hw) == key
    assert cache.plan_key(config(tiny_model_dir, tmp_path, "trainer.seed=7", "trainer.num_threads=1"), hw) == key
    for override in ("actor.micro_batch_size=16", "trainer.max_steps=7", "plan.steps=3", "actor.optim.lr=1e-4"):
        assert cache.plan_key(config(tiny_model_dir, tmp_path, override), hw) != key, override
    assert cache.plan_key(cfg, hw, extra="other") != key


@pytest.mark.parametrize("damage", [b"", b"not a pickle", b"\x80\x05truncated"])
def test_damaged_or_foreign_file_is_a_miss(tiny_model_dir, tmp_path, plans, cache_dir, damage):
    first, _ = run(config(tiny_model_dir, tmp_path))
    (path,) = cache_dir.glob("*.pkl")
    path.write_bytes(damage)
    second, text = run(config(tiny_model_dir, tmp_path))
    assert len(plans) == 2 and text.startswith("memory plan: fits")
    assert json.dumps(plan_record(second)) == json.dumps(plan_record(first))
    # a valid file stored under another key (copied, renamed) is not taken for this one
    key = path.stem
    cache.store("0" * 64, "something else")
    shutil.copy(cache_dir / ("0" * 64 + ".pkl"), path)
    assert cache.load(key) is None
    run(config(tiny_model_dir, tmp_path))
    assert len(plans) == 3


def test_unwritable_cache_still_plans(tiny_model_dir, tmp_path, plans, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FITRL_CACHE_DIR", str(blocker))  # plans/ cannot be made under a file
    for _ in range(2):
        plan, text = run(config(tiny_model_dir, tmp_path))
        assert plan.fits and text.startswith("memory plan: fits")
    assert len(plans) == 2


def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FITRL_CACHE_DIR", str(tmp_path / "a"))
    assert cache.cache_dir() == tmp_path / "a" / "plans"
    monkeypatch.delenv("FITRL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "fitrl" / "plans"


@pytest.mark.slow
def test_a_cached_plan_that_does_not_fit_stops_the_same_way(tmp_path, plans, monkeypatch):
    monkeypatch.setattr(preflight_mod, "node_total_bytes", lambda: 256 * 1024**3)
    outcomes = []
    for _ in range(2):
        out = io.StringIO()
        with pytest.raises(RunStopped) as err:
            preflight(toy_config(QWEN_7B, tmp_path / "run", *TOO_BIG, "memory.plan=enforce"),
                      Console(file=out, width=200))
        outcomes.append((str(err.value), out.getvalue()))
    assert len(plans) == 1  # the recommendations' re-plans call plan_config in fitrl.planner.recommend
    assert outcomes[0] == outcomes[1]
    assert "cheapest change that fits: actor.model.gradient_checkpointing=true" in outcomes[1][0]


@pytest.fixture
def traces(monkeypatch):
    """Counts real traces, with this process's in-memory trace caches emptied."""
    from fitrl.memory import trace

    trace._stored.cache_clear()
    trace._traced.cache_clear()
    calls = []
    traced = trace._traced.__wrapped__

    def counted(spec, layers):
        calls.append((spec, layers))
        return traced(spec, layers)
    monkeypatch.setattr(trace, "_traced", counted)
    yield calls
    trace._stored.cache_clear()


def test_a_config_edited_where_no_trace_reads_plans_from_the_stored_traces(tiny_model_dir, tmp_path, plans,
                                                                           traces, cache_dir):
    from fitrl.memory import trace

    first, _ = run(config(tiny_model_dir, tmp_path))
    assert len(plans) == 1 and traces, "the cold plan traced nothing"
    stored = len(list(cache.trace_dir().glob("*.pkl")))
    assert stored == len(set(traces))
    traces.clear()
    trace._stored.cache_clear()  # as a new process
    second, _ = run(config(tiny_model_dir, tmp_path, "actor.optim.lr=3e-4", "trainer.max_steps=7"))
    assert len(plans) == 2, "a changed learning rate must miss the plan cache"
    assert traces == [], "traced again"
    assert json.dumps(plan_record(second)["phases"]) == json.dumps(plan_record(first)["phases"])
    # a damaged trace file is a miss, traced again and rewritten
    victim = sorted(cache.trace_dir().glob("*.pkl"))[0]
    victim.write_bytes(b"not a pickle")
    trace._stored.cache_clear()
    third, _ = run(config(tiny_model_dir, tmp_path, "actor.optim.lr=1e-4"))
    assert len(traces) == 1 and json.dumps(plan_record(third)["phases"]) == json.dumps(plan_record(first)["phases"])
    assert len(list(cache.trace_dir().glob("*.pkl"))) == stored


def test_a_cold_plan_traces_only_the_phases_the_run_has(tiny_model_dir, tmp_path, traces):
    """Start-up: a phase the run does not have (no reference without KL, no separate old-log-prob
    pass when the update folds it, no validation without validation files) costs no trace."""
    folded, _ = run(config(tiny_model_dir, tmp_path, "algorithm.use_kl_loss=false", "data.val_files=[]",
                           "actor.mini_batch_size=8", "actor.ppo_epochs=1",
                           "checkpoint.save_freq=0", "checkpoint.save_final=false"))
    assert folded.phases == ["load", "rollout", "update"]
    assert {s.phase for s, _ in traces} == {"prefill", "update"}
    assert {p.kind: sorted(p.phases) for p in folded.processes}["trainer"] == ["load", "rollout", "update"]
    traces.clear()
    full, _ = run(config(tiny_model_dir, tmp_path, "algorithm.use_kl_loss=true", "algorithm.fold_old_logprob=false"))
    assert {"ref_logprob", "old_logprob", "validation"} <= set(full.phases)
    assert "logprob" in {s.phase for s, _ in traces}
