"""The README and docs/ say what the code does today: every block of command output is what its
command prints now (bench/doc_outputs.py), every doc is reachable from the README, every local
link resolves, the README's config loads and its test command is CI's, and the README stays one
screenful per idea."""

from __future__ import annotations

import re

import pytest

from helpers import ROOT, load_bench

doc_outputs = load_bench("doc_outputs")

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_at_most_300_lines():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move detail to docs/"


def test_every_output_fence_is_marked_and_every_marker_is_a_block():
    assert doc_outputs.unmarked_output_fences() == []
    assert set(doc_outputs.documented()) == set(doc_outputs.BLOCKS)
    for name, (path, _, _) in doc_outputs.documented().items():
        assert path == ROOT / doc_outputs.BLOCKS[name].file, (name, path)


def test_local_links_resolve_and_every_doc_is_reachable_from_the_readme():
    reached, todo = set(), [ROOT / "README.md"]
    while todo:
        doc = todo.pop()
        if doc in reached:
            continue
        reached.add(doc)
        for target in LINK.findall(doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = (doc.parent / target).resolve()
            assert path.exists(), f"{doc.relative_to(ROOT)} links to {target}, which does not exist"
            if path.suffix == ".md" and path.parent == ROOT / "docs":
                todo.append(path)
    unreached = [d.name for d in DOCS if d not in reached]
    assert not unreached, f"docs not reachable from README.md by links: {unreached}"


def test_nothing_cites_a_path_outside_the_repository():
    for doc in DOCS:
        assert "../shared" not in doc.read_text(), doc


def test_the_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^make test\b", readme, re.M)
    assert re.search(r"^\s*make test\s*$", (ROOT / ".ci" / "run").read_text(), re.M)


def test_the_readme_config_loads(tmp_path):
    """The README's `my.yaml` is a valid config: every key exists and has the right type."""
    from fitrl.config import load_config

    block = re.search(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    path = tmp_path / "my.yaml"
    path.write_text(block)
    cfg = load_config(str(path), [])
    assert cfg.rollout.n == 8 and cfg.actor.micro_batch_size == 8 and cfg.reward.function == "math"


FAST = [n for n, b in doc_outputs.BLOCKS.items() if not b.slow]
SLOW = [n for n, b in doc_outputs.BLOCKS.items() if b.slow and n != "demo"]


@pytest.mark.parametrize("name", FAST)
def test_documented_output_is_what_the_command_prints(name, tmp_path):
    diff = doc_outputs.check(doc_outputs.BLOCKS[name], tmp_path)
    assert diff is None, diff


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_documented_output_of_training_is_what_the_command_prints(name, tmp_path):
    diff = doc_outputs.check(doc_outputs.BLOCKS[name], tmp_path)
    assert diff is None, diff


def test_the_check_fails_on_a_stale_block(tmp_path, monkeypatch):
    """A block whose shown text differs from its command's output is reported (masks aside)."""
    block = doc_outputs.Block("x", "README.md", lambda _: "reward 0.500 in 1.2 s", trained=True)
    shown = {"x": (ROOT / "README.md", "reward 0.600 in 3.4 s", None)}
    monkeypatch.setattr(doc_outputs, "documented", lambda: shown)
    assert "reward 0.600" in doc_outputs.check(block, tmp_path)  # a figure differs
    shown["x"] = (ROOT / "README.md", "reward 0.500 in 3.4 s", None)
    assert doc_outputs.check(block, tmp_path) is None             # a time does not
    shown["x"] = (ROOT / "README.md", "reward 0.600 in 3.4 s", "another CPU, avx512, torch 0")
    assert doc_outputs.check(block, tmp_path) is None             # recorded elsewhere: the shape only


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """``fitrl demo`` run once as the README shows it: (the check's diff, GRPO's run directory)."""
    scratch = tmp_path_factory.mktemp("demo")
    return doc_outputs.check(doc_outputs.BLOCKS["demo"], scratch), scratch / "arith-grpo"


@pytest.mark.slow
def test_the_readme_demo_output_is_what_fitrl_demo_prints(demo):
    diff, _ = demo
    assert diff is None, diff


@pytest.mark.slow  # the demo (shared with the test above), then Chromium twice (DOM, screenshot)
def test_the_demo_report_shows_validation_accuracy_rising(demo, tmp_path):
    """The report page of the README's demo run leads with validation accuracy, raised by GRPO
    (by how much against noise varies with the CPU's rounding; the demo prints it:
    fitrl/trainer/verdict.py); its screenshot is kept as .artifacts/report-demo.png
    (docs/report.png is one)."""
    from browser import check_page_in_browser

    from fitrl.report.page import write_report

    page = write_report(demo[1])
    check = check_page_in_browser(page, tmp_path, "report-demo.png", window="1400,2200")
    titles = [f.title for f in check.figures]
    accuracy = next((t for t in titles if t.startswith("Validation accuracy")), None)
    assert accuracy is not None and titles.index(accuracy) == 1, titles  # right after the reward
    before, after = map(float, re.findall(r"\d\.\d{3}", accuracy))
    assert after > before > 0, accuracy  # the demo's own rule for its exit status (fitrl/trainer/demo.py)


def test_the_readme_recipe_fits_the_hardware_its_plan_command_names(tmp_path):
    """The README's `my.yaml`, for Qwen2.5-7B (its config.json from the field corpus), planned on
    the machine its `fitrl plan` line names (1 node x 8 GPUs of 80 GiB, 1 TiB): it fits, so the
    default `memory.plan=enforce` would not refuse the showcase config."""
    import json

    import yaml

    from fitrl.config import load_config
    from fitrl.planner import Hardware, plan_config

    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", readme, re.S).group(1)
    assert "--nodes 1 --gpus-per-node 8 --gpu-memory 80GiB --host-memory 1TiB" in readme
    models = yaml.safe_load((ROOT / "bench" / "field_corpus" / "models.yaml").read_text())
    model = tmp_path / "qwen2.5-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(models["qwen2.5-7b-instruct"]["config"]))
    (tmp_path / "my.yaml").write_text(block.replace("/data/Qwen2.5-7B-Instruct", str(model)))
    cfg = load_config(str(tmp_path / "my.yaml"), [])
    plan = plan_config(cfg, Hardware(nodes=1, gpus_per_node=8, gpu_memory=80 * 2**30, host_memory=2**40, device="cuda"))
    assert plan.verdict == "fits", plan.verdict
