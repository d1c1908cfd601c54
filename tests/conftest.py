"""Shared fixtures: tiny models are built once per session (random weights, local tokenizer)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from fitrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", arch="qwen2", size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from fitrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama", size="tiny", seed=0)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
