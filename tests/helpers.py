"""Helpers shared by integration tests (pytest puts tests/ on sys.path)."""

import json
from pathlib import Path

from fitrl.config import load_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "arith.yaml")
DATA = ROOT / "examples" / "data"


def toy_config(model_dir, run_dir, *overrides):
    """The shipped toy-task config pointed at a test model and run directory. The memory plan is
    off (it costs ~0.7 s per new config; tests/test_preflight.py turns it on)."""
    return load_config(EXAMPLE, [
        f"actor.model.path={model_dir}", f"trainer.run_dir={run_dir}",
        f"data.train_files=[{DATA / 'arith_train.jsonl'}]", f"data.val_files=[{DATA / 'arith_val.jsonl'}]",
        "trainer.progress_bar=false", 'memory.plan=off', *overrides])


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
