"""`fitrl demo --distill` (examples/arith_distill.yaml): the teacher made when missing
(examples/arith_teacher.yaml: the demo's warm start and GRPO under the teacher's seed, exported),
then the warm-started student trained toward it. Shortened here; the learning figures are
bench/distill.py's (bench/RESULTS.md, "On-policy distillation")."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from helpers import ROOT


def _short_load(steps: int, output_dir: Path):
    """The CLI's config loader with every run cut to ``steps`` steps, no validation, and the
    timestamped run directories under ``output_dir``."""
    from fitrl.cli import _load

    def load(config, overrides):
        return _load(config, [*overrides, f"trainer.max_steps={steps}", "trainer.val_freq=0",
                              "trainer.val_before_train=false", "trainer.progress_bar=false",
                              f"trainer.output_dir={output_dir}"])
    return load


@pytest.mark.slow
def test_the_teacher_is_made_once_from_its_seed_and_shares_the_students_tokenizer(tmp_path, tiny_model_dir,
                                                                                    monkeypatch):
    from transformers import AutoTokenizer

    from fitrl.models.teacher_check import tokenizer_difference
    from fitrl.trainer.demo import TEACHERS, make_teacher

    monkeypatch.chdir(ROOT)  # the examples' data paths are relative to the repository root
    load = _short_load(2, tmp_path / "runs")
    cfg = load("examples/arith_distill.yaml", [f"actor.model.path={tiny_model_dir}",
                                                f"teacher.model.path={tmp_path / 'teacher'}"])
    args = argparse.Namespace(overrides=["trainer.seed=3", "trainer.num_threads=1"])
    out = Console(file=open(tmp_path / "console.txt", "w"), soft_wrap=True)
    make_teacher(cfg, *TEACHERS["distill"], args, out, load)
    said = (tmp_path / "console.txt").read_text()
    assert (tmp_path / "teacher" / "model.safetensors").is_file(), said
    assert "teacher's warm start: 2 supervised steps" in said and "then 2 GRPO steps" in said
    # the teacher config's seed (5), not the student's (3): one teacher for every student
    runs = {p.name: p for p in tmp_path.glob("runs/*") if (p / "config.yaml").is_file()}
    import yaml

    seeds = {yaml.safe_load((p / "config.yaml").read_text())["trainer"]["seed"] for p in runs.values()}
    assert seeds == {5}, runs
    assert tokenizer_difference(AutoTokenizer.from_pretrained(tiny_model_dir),
                                AutoTokenizer.from_pretrained(tmp_path / "teacher")) == ""
    stamp = (tmp_path / "teacher" / "model.safetensors").stat().st_mtime_ns
    make_teacher(cfg, *TEACHERS["distill"], args, out, load)  # present: left alone
    assert (tmp_path / "teacher" / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_the_distill_demo_trains_the_student_toward_the_teacher(tmp_path, tiny_model_dir):
    teacher, model, run = tmp_path / "teacher", tmp_path / "model", tmp_path / "grpo"
    shutil.copytree(tiny_model_dir, teacher)  # present, so the demo does not make it
    proc = subprocess.run([sys.executable, "-m", "fitrl.cli", "demo", "--distill", "--warm-start-steps", "2",
                           f"actor.model.path={model}", f"teacher.model.path={teacher}", f"trainer.run_dir={run}",
                           "trainer.max_steps=2", "trainer.val_freq=2", "trainer.num_threads=1",
                           "trainer.progress_bar=false"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "warm start: 2 supervised steps" in proc.stdout
    assert "distillation with GRPO" in proc.stdout  # the accuracy verdict names what trained the policy
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "distill/loss" in r]
    assert len(steps) == 2, (run / "metrics.jsonl").read_text()[-2000:]
    assert all("distill/teacher_agreement" in r for r in steps)  # top_k 4 in the example
    assert Path(f"{run}-sft", "hf", "config.json").is_file()
