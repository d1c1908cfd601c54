"""Helpers shared by integration tests (pytest puts tests/ on sys.path)."""

import importlib.util
import json
import sys
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


def tiny_rollout(model_dir):
    """A tiny policy (fp32, CPU) and its 8-sequence rollout of four chat prompts, 2 samples each,
    at most 6 tokens (seeded): the batch the actor tests add log-probs and advantages to."""
    import torch

    from fitrl.config.schema import FSDPConfig, ModelConfig, SamplingConfig
    from fitrl.data.batch import Batch
    from fitrl.models.loading import build_model, load_tokenizer
    from fitrl.rollout.hf import HFRollout

    mcfg = ModelConfig(path=str(model_dir))
    tok = load_tokenizer(mcfg)
    model = build_model("causal_lm", mcfg, FSDPConfig(), torch.device("cpu"))
    texts = ["What is 1 + 2?", "What is 7 + 5? Answer with a number.", "Hi", "What is 0 + 0?"]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"] for t in texts]
    torch.manual_seed(0)
    return model, HFRollout(model, tok).generate(Batch(fields={"prompt_ids": ids}), SamplingConfig(n=2, max_tokens=6))


def load_bench(name: str):
    """``bench/<name>.py`` as a module (bench/ is scripts, not a package)."""
    path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module
