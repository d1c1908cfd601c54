"""`fitrl --version`: fitrl's version and the torch it runs with, exit status 0."""

from __future__ import annotations

import pytest

import fitrl
from fitrl.cli import main


def test_version_names_fitrl_and_torch(capsys):
    import torch

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"fitrl {fitrl.__version__} (torch {torch.__version__})"
