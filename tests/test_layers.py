"""The layering contract (pyproject.toml ``[tool.importlinter]``, docs/architecture.md "Layers"),
checked with import-linter: a module that imports from a layer above its own fails here."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    return subprocess.run([exe, "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(cwd)})


def test_layers_are_kept():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The contract can fail: a copy of the package where the ground floor imports the trainer."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "fitrl", copy / "fitrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    errors = copy / "fitrl" / "core" / "errors.py"
    errors.write_text(errors.read_text() + "\nfrom fitrl.trainer import loop  # noqa\n")
    result = lint_imports(copy)
    assert result.returncode != 0
    assert "fitrl.core.errors -> fitrl.trainer.loop" in result.stdout, result.stdout


def test_no_import_circle():
    """No circle between fitrl's modules (bench/import_cycles.py), counting function-level and
    ``TYPE_CHECKING`` imports: e.g. the plan's vocabulary (fitrl/memory/model.py) asks no planner,
    a Run (fitrl/memory/run.py) is below the role and engine planners that take it, and
    config.json is read below the validator and the families (fitrl/models/config_json.py)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from import_cycles import arrows, circles
    finally:
        sys.path.remove(str(ROOT / "bench"))
    found = circles()
    assert found == [], "\n".join(a for group in found for a in ["circle:"] + arrows(group))
