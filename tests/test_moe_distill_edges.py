"""Where on-policy distillation's teacher and a mixture-of-experts policy meet the rest of fitrl:
the teacher's FLOPs in ``perf/*`` (fitrl/trainer/perf.py), the report's distillation charts beside
the moe/* ones (fitrl/report/keys.py), a teacher's Hub id resolved only when the teacher is built
(fitrl/models/hub.py), and the teacher scoring a rollout worker's batches (rollout.workers).
The API's side is in tests/test_python_api.py, the importer's in tests/test_import_moe_distill.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fitrl.core import hub
from fitrl.core.errors import ModelDirError
from fitrl.models.flops import FlopsShape
from helpers import read_metrics, toy_config
from test_flops import TINY, _rollout_batch

TEACHER = {**TINY, "hidden_size": 96, "num_hidden_layers": 3, "intermediate_size": 384, "head_dim": 24}
"""A teacher wider and deeper than the tiny student, its tokenizer's vocabulary."""


def distill(teacher, weight: float = 0.5, *extra: str) -> list[str]:
    return [f"algorithm.distill.weight={weight}", f"teacher.model.path={teacher}", *extra]


# ------------------------------------------------------------------------------ perf/*: the teacher's FLOPs

@pytest.fixture
def teacher_config_dir(tmp_path) -> Path:
    path = tmp_path / "teacher"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TEACHER))
    return path


def test_the_teacher_s_forward_flops_are_counted_when_its_pass_ran(tiny_model_dir, teacher_config_dir):
    """The teacher's pass is a forward of its own model over the step's sequences: counted with its
    shape in the log-prob phase (its skipped prompt copies subtracted), in step FLOPs and MFU."""
    from fitrl.trainer.perf import StepPerf

    batch = _rollout_batch([4, 2], [3, 1])
    generated = {"rollout": [([4, 2], [3, 1])]}
    common = ["trainer.peak_flops=1e9", "algorithm.fold_old_logprob=false"]
    times = {"rollout": 0.5, "old_logprob": 0.25, "teacher_logprob": 0.5, "update": 1.0}
    on = StepPerf(toy_config(tiny_model_dir, "unused", *common, *distill(teacher_config_dir)))
    plain = StepPerf(toy_config(tiny_model_dir, "unused", *common))
    m = on.metrics(batch, generated, times, {"teacher_logprob": [4]})  # (row 0's prompt copy shared)
    without = plain.metrics(batch, generated, {k: v for k, v in times.items() if k != "teacher_logprob"})
    student, teacher = FlopsShape.from_config(TINY), FlopsShape.from_config(TEACHER)
    forward = student.forward_flops(4, 3) + student.forward_flops(2, 1)
    scored = teacher.forward_flops(4, 3) + teacher.forward_flops(2, 1) - teacher.forward_flops(4, 0)
    assert scored > forward  # (its own, larger shape: not the policy's)
    assert m["perf/step_flops"] - without["perf/step_flops"] == pytest.approx(scored)
    assert m["perf/logprob_mfu"] == pytest.approx((forward + scored) / (0.25 + 0.5) / 1e9)
    assert m["perf/logprob_tokens_per_s"] == pytest.approx(2 * 10 / 0.75)  # old log-probs + teacher
    assert m["perf/mfu"] == pytest.approx(m["perf/step_flops"] / sum(times.values()) / 1e9)


def test_no_teacher_flops_with_distillation_off(tiny_model_dir, teacher_config_dir):
    """weight 0 builds no teacher (a path left in the config included): nothing of it is read or
    counted, even where a teacher_logprob time were present."""
    from fitrl.trainer.perf import StepPerf

    batch, generated = _rollout_batch([4, 2], [3, 1]), {"rollout": [([4, 2], [3, 1])]}
    times = {"rollout": 0.5, "old_logprob": 0.25, "update": 1.0}
    off = StepPerf(toy_config(tiny_model_dir, "unused", "trainer.peak_flops=1e9", "algorithm.fold_old_logprob=false",
                              *distill(teacher_config_dir, 0.0)))
    plain = StepPerf(toy_config(tiny_model_dir, "unused", "trainer.peak_flops=1e9", "algorithm.fold_old_logprob=false"))
    assert off.teacher_shape is None
    assert off.metrics(batch, generated, times) == plain.metrics(batch, generated, times)
    stray = off.metrics(batch, generated, {**times, "teacher_logprob": 0.5})
    same = plain.metrics(batch, generated, times)
    assert (stray["perf/step_flops"], stray["perf/logprob_mfu"], stray["perf/logprob_tokens_per_s"]) == \
        (same["perf/step_flops"], same["perf/logprob_mfu"], same["perf/logprob_tokens_per_s"])


# ------------------------------------------------------------------------------ the report's charts

DISTILL_KEYS = ["distill/loss", "distill/reverse_kl", "distill/reverse_kl_abs", "distill/forward_kl_topk",
                "distill/forward_kl_tail", "distill/teacher_topk_mass", "distill/student_topk_mass",
                "distill/teacher_logprob", "distill/teacher_agreement"]


def test_the_report_charts_the_distillation_metrics_beside_the_moe_ones():
    from fitrl.report.keys import training_charts

    keys = ["actor/kl_loss", "actor/router_aux_loss", "moe/expert_load_entropy", "moe/routing_mismatch",
            *DISTILL_KEYS, "distill/new_kl_term", "distill/new_thing"]
    charts = {c.title: c for c in training_charts(keys, [])}
    titles = list(charts)
    assert charts["KL"].keys == ["actor/kl_loss"]  # the reference's; the teacher's are their own chart
    loss = charts["Distillation: loss and KL to the teacher"]
    assert loss.keys == ["distill/loss", "distill/reverse_kl", "distill/reverse_kl_abs", "distill/forward_kl_topk",
                         "distill/forward_kl_tail", "distill/new_kl_term"]
    agreement = charts["Teacher agreement"]
    assert agreement.keys == ["distill/teacher_topk_mass", "distill/student_topk_mass", "distill/teacher_agreement",
                              "distill/new_thing"]
    assert agreement.secondary == ["distill/teacher_logprob"]
    assert titles.index("Routing mismatch (engine vs trainer)") < titles.index(loss.title)  # after the moe/* charts
    assert not any(t.startswith(("Distillation", "Teacher")) for t in
                   (c.title for c in training_charts(["actor/kl_loss", "moe/routing_mismatch"], [])))


def test_a_distillation_run_s_page_draws_its_charts_per_step(tmp_path):
    from fitrl.report.load import load_run
    from fitrl.report.page import build_sections, render

    run = tmp_path / "run"
    run.mkdir()
    steps = [{"step": s, "reward/mean": 0.1 * s, "time/step": 1.0, "distill/loss": 1.0 / s,
              "distill/reverse_kl": 1.0 / s, "distill/teacher_logprob": -2.0 + 0.1 * s,
              "distill/teacher_agreement": 0.1 * s, "moe/routing_mismatch": 0.0} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    loaded = load_run(run)
    training = next(s for s in build_sections(loaded) if s.anchor == "training")
    titles = [f.title for f in training.figures]
    assert "Distillation: loss and KL to the teacher" in titles and "Teacher agreement" in titles
    assert "Routing mismatch (engine vs trainer)" in titles
    other = [s for s in build_sections(loaded) if s.anchor == "other"]
    assert not other or not any("distill" in f.title for f in other[0].figures)  # none left over
    assert loaded.series("distill/teacher_agreement") == ([1, 2, 3], [0.1, 0.2, pytest.approx(0.3)])
    assert "Teacher agreement" in render(loaded)


# ------------------------------------------------------------------------------ a teacher's Hub id

@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty, offline Hugging Face cache of this test's own (as tests/test_hub.py builds)."""
    for name in ("HF_TOKEN", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def test_a_teacher_s_hub_id_is_left_alone_while_distillation_is_off(cache, tiny_model_dir, tmp_path):
    """weight 0: no teacher is built or planned, so a teacher the cache has never seen neither
    fails the run's resolution nor the plan's, and stays as written."""
    from fitrl.models.hub import RECORD, resolve_plan_refs, resolve_run_refs

    cfg = toy_config(tiny_model_dir, tmp_path / "run", *distill("nobody/absent-teacher", 0.0))
    assert resolve_run_refs(cfg, tmp_path) == {} and not (tmp_path / RECORD).exists()
    resolve_plan_refs(cfg)
    assert cfg.teacher.model.path == "nobody/absent-teacher"
    on = toy_config(tiny_model_dir, tmp_path / "run", *distill("nobody/absent-teacher"))
    with pytest.raises(ModelDirError, match=r"^teacher.model.path='nobody/absent-teacher': .*not in the Hugging "
                                            r"Face cache"):
        resolve_run_refs(on, tmp_path)
    with pytest.raises(ModelDirError, match=r"^teacher.model.path='nobody/absent-teacher'"):
        resolve_plan_refs(toy_config(tiny_model_dir, tmp_path / "run", *distill("nobody/absent-teacher")))


def test_a_built_teacher_s_hub_id_is_resolved_with_its_weights(cache, tiny_model_dir, tmp_path):
    from fitrl.models.hub import RECORD, resolve_plan_refs, resolve_run_refs

    files = {p.name: p for p in Path(tiny_model_dir).iterdir() if p.is_file()}
    snap = hub.cache_repo("teacher-org/tiny", files)
    cfg = toy_config(tiny_model_dir, tmp_path / "run", *distill("teacher-org/tiny"))
    records = resolve_run_refs(cfg, tmp_path)
    assert cfg.teacher.model.path == str(snap.path) and records["teacher.model.path"]["commit"] == snap.commit
    assert json.loads((tmp_path / RECORD).read_text()) == records
    plan = toy_config(tiny_model_dir, tmp_path / "run", *distill("teacher-org/tiny"))
    resolve_plan_refs(plan)
    assert plan.teacher.model.path == str(snap.path)
    hub.cache_repo("teacher-org/config-only", {"config.json": files["config.json"]})
    only = toy_config(tiny_model_dir, tmp_path / "run", *distill("teacher-org/config-only"))
    with pytest.raises(ModelDirError, match=r"^teacher.model.path='teacher-org/config-only': .* without its weights"):
        resolve_run_refs(only, None)  # (built: its weights are needed, not just what the plan reads)


# ------------------------------------------------------------------------------ a rollout worker's batches

def test_the_teacher_scores_the_rollout_worker_s_batches(tiny_model_dir, tmp_path, monkeypatch):
    """rollout.workers=1: the teacher's pass runs on the batch the worker generated (each row
    tagged with the weights version it was sampled under), every step, and its metrics are logged."""
    from fitrl.roles.rollout_worker import RolloutWorker
    from fitrl.roles.teacher import TeacherWorker
    from fitrl.trainer.run import train

    def responses(batch) -> list[tuple[int, ...]]:
        return sorted(tuple(r[m.bool()].tolist()) for r, m in zip(batch["responses"], batch["response_mask"]))

    generated, scored = [], []
    for cls, method, seen in ((RolloutWorker, "generate", generated), (TeacherWorker, "compute_teacher_logprob", scored)):
        original = getattr(cls, method)

        def recorded(self, batch, *args, _original=original, _seen=seen, _in=method != "generate", **kwargs):
            out = _original(self, batch, *args, **kwargs)
            _seen.append(batch if _in else out)
            return out
        recorded._fitrl_dispatch = original._fitrl_dispatch
        monkeypatch.setattr(cls, method, recorded)
    run = tmp_path / "run"
    train(toy_config(tiny_model_dir, run, "rollout.workers=1", "trainer.max_steps=2", "rollout.n=2",
                     "data.rollout_batch_size=4", "actor.mini_batch_size=4", "trainer.val_before_train=false",
                     "trainer.val_freq=0", "data.val_files=[]", "reward.num_workers=0", "checkpoint.save_final=false",
                     "trainer.num_threads=1", *distill(tiny_model_dir, 0.5, "algorithm.distill.top_k=2")))
    assert len(scored) == 2 and len(generated) >= 2
    for batch in scored:
        assert "rollout_version" in batch  # (set by the worker: RolloutWorker.generate)
        assert responses(batch) in [responses(g) for g in generated]
    steps = [r for r in read_metrics(run) if "reward/mean" in r and "event" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["time/teacher_logprob"] > 0 and r["distill/teacher_logprob"] < 0 and "rollout/staleness_max" in r
        assert torch.isfinite(torch.tensor(r["distill/loss"]))
