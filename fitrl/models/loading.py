"""Loading real Hugging Face checkpoints from local directories.

The demo's tiny models and a user's Qwen2.5-7B go through exactly this code; nothing here
reaches a hub (``local_files_only``), so a wrong path fails fast with a clear message.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fitrl.config.schema import ModelConfig
from fitrl.core.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_dir(path: str, what: str = "actor.model.path") -> Path:
    p = Path(path)
    if not path:
        raise ConfigError(f"{what} is empty: point it at a local Hugging Face model directory "
                          "(make one with `fitrl make-tiny-model DIR`)")
    if not (p / "config.json").is_file():
        raise ConfigError(f"{what}={path!r} is not a model directory (no config.json there); "
                          "fitrl loads local checkpoints only")
    return p


def load_tokenizer(model: ModelConfig):
    from transformers import AutoTokenizer

    path = model.tokenizer_path or model.path
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    # Left padding keeps every prompt's last token at the same column for batched generate.
    tok.padding_side = "left"
    return tok


def load_causal_lm(model: ModelConfig, device: torch.device, *, what: str = "actor.model.path") -> torch.nn.Module:
    """A causal LM on ``device`` without sharding (see :mod:`fitrl.models.parallelize` for FSDP2)."""
    from fitrl.config.schema import FSDPConfig
    from fitrl.models.parallelize import build_model

    return build_model("causal_lm", model, FSDPConfig(), device, what=what)
