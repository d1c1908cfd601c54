"""What the README and docs/ show a command printing, produced by running the command.

A block of output is marked in the markdown, the marker on the line above its fence::

    <!-- output: demo -->
    ```
    ...
    ```

Every such block is written here from a real run of its command (:data:`BLOCKS`): the lines a
reader needs, selected by pattern, with ``...`` where lines were left out. A fence without a
language holds command output and must be marked (``text`` fences hold diagrams and formulas),
so no typed output can slip in.

    .venv/bin/python bench/doc_outputs.py                  # run every block's command, rewrite the blocks
    .venv/bin/python bench/doc_outputs.py demo guard       # only these
    .venv/bin/python bench/doc_outputs.py --check [NAME]   # exit 1 when a block differs from a run now

What changes from run to run is masked before comparing: times, temporary paths, memory
readings of this machine. Training figures (rewards, accuracies) are deterministic for a seed
on one machine, so they are compared exactly where the block was recorded (its CPU, recorded
in the marker) and by the shape of the lines elsewhere, where another CPU's kernels round
differently. ``tests/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- output: (?P<name>[\w-]+)(?:; recorded on (?P<machine>[^>]*?))? -->$")
GAP = "..."
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
EXIT = re.compile(r"\(exit status \d+\)")
NOISE = re.compile(r"(?<=GRPO raised it)(?: beyond noise|, but within noise)")
TIME = re.compile(r"\b\d+(?:\.\d+)?\s?(?:s|ms)\b")
GIB = re.compile(r"\b\d[\d,]*(?:\.\d+)? (?:GiB|MiB|G)\b")


def machine() -> str:
    """What makes training figures reproducible bit for bit: the CPU model, its widest vector
    unit (MKL and oneDNN pick kernels by it) and torch's version."""
    import torch

    model, flags = platform.machine(), ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = re.search(r"model name\s*:\s*(.*)", info).group(1).strip()
        flags = re.search(r"flags\s*:\s*(.*)", info).group(1)
    except (OSError, AttributeError):
        pass
    isa = "avx512" if "avx512f" in flags.split() else "avx2" if "avx2" in flags.split() else "other"
    return f"{model}, {isa}, torch {torch.__version__}"


@dataclass(frozen=True)
class Block:
    """One documented output: where it is shown and how it is made."""

    name: str
    file: str                              # the markdown file, relative to the repository root
    make: Callable[[Path], str]            # a scratch directory -> the block's text
    masks: tuple[re.Pattern, ...] = ()     # what varies between runs on one machine
    trained: bool = False                  # figures from training: exact only on the recording CPU
    slow: bool = False                     # a minute or more (tests mark it slow)


def fitrl(*args: str, cwd: Path = ROOT, columns: int = 110, **env: str) -> tuple[int, str]:
    """Run ``fitrl ARGS`` as a user would (a fresh process, no terminal; ``env``: variables set
    for it); stdout then stderr."""
    env = {**os.environ, "COLUMNS": str(columns), "FITRL_DEBUG": "", "PYTHONUNBUFFERED": "1", **env}
    proc = subprocess.run([sys.executable, "-m", "fitrl.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1800)
    return proc.returncode, proc.stdout + proc.stderr


BORDER = re.compile(r"^[┏┡└┗┌├]")       # a table's rules: left out silently
CONTINUED = re.compile(r"^│[^│]*│ +│")   # a table row's wrapped line (its second cell blank): kept with its row


def demo_model() -> None:
    """The tiny model ``examples/arith.yaml`` names, as ``fitrl demo`` makes it when missing (the
    docs' ``fitrl train examples/arith.yaml`` commands assume ``make demo`` ran first; a fresh
    clone has no model)."""
    from fitrl.models.tiny import make_tiny_model

    path = ROOT / ".cache" / "models" / "tiny-qwen2"
    if not (path / "config.json").is_file():
        make_tiny_model(path, arch="qwen2", size="tiny", seed=1)


def select(text: str, keep: list[str], gaps: bool = True) -> list[str]:
    """The lines matching any of ``keep`` (regexes, searched), ``...`` where lines were left out
    (a table's rules aside; a kept row keeps its wrapped lines)."""
    out: list[str] = []
    pats = [re.compile(k) for k in keep]
    kept = False
    for line in text.splitlines():
        if BORDER.match(line):
            continue
        if any(p.search(line) for p in pats) or (kept and CONTINUED.match(line)):
            out.append(line.rstrip())
            kept = True
            continue
        kept = False
        if gaps and out and out[-1] != GAP:
            out.append(GAP)
    while out and out[-1] == GAP:
        out.pop()
    return out


def _scrub(lines: list[str], scratch: Path, to: str = "runs") -> str:
    return "\n".join(line.replace(str(scratch), to) for line in lines)


def _demo_run(scratch: Path, run: str, *flags: str, keep: list[str]) -> str:
    """``fitrl demo FLAGS`` into ``scratch/run``: the lines ``keep`` selects, each step line cut
    after its gradient norm (the rest is timing) and long by-source lists after the first."""
    rc, out = fitrl("demo", *flags, f"trainer.run_dir={scratch}/{run}", "trainer.progress_bar=false")
    lines = [re.sub(r"( \| gnorm [\d.]+) \|.*", r"\1 | ...", re.sub(r"(; by source: [^,]*),.*", r"\1, ...", line))
             for line in select(out, [*keep, r"^validation @", r"^reward:", r"^validation exact"], gaps=False)]
    command = " ".join(["$ fitrl demo", *flags, f"trainer.run_dir=runs/{run}"])
    return _scrub([command, *lines, f"(exit status {rc})"], scratch)


def _demo(scratch: Path) -> str:
    return _demo_run(scratch, "arith-grpo", keep=[r"^warm start", r"^note: rollout\.n", r"^step +(1|300) \|"])


def _vl_demo(scratch: Path) -> str:
    return _demo_run(scratch, "shapes", "--vl", keep=[r"^warm start", r"^train:", r"^step +(1|50|100) \|"])


def _config_errors(scratch: Path) -> str:
    lines = []
    for args in (["train", "examples/arith.yaml", "actor.optim.lrr=1e-5"],
                 ["train", "examples/arith.yaml", "algorithm.adv_estimator=grpoo"]):
        rc, out = fitrl(*args)
        lines += ["$ fitrl " + " ".join(args), *out.strip().splitlines(), f"(exit status {rc})"]
    return "\n".join(lines)


def _plan_story(scratch: Path) -> str:
    config = "examples/failure_stories/3_host_grows_each_rollout.yaml"
    rc, out = fitrl("plan", config, columns=80)  # what an 80-column terminal shows (issue 37)
    lines = select(out, [r"^qwen2 ", r"^on 1 node", r"^256 prompts", r"^peak (GPU|host) memory", r"^┃ phase",
                         r"^│ (rollout|ref_logprob) ", r"^per process", r"^┃ process", r"^│ (trainer rank|rollout engine)",
                         r"^note: plan\.emulate", r"stay cached: host grows", r"^does not fit", r"^  host memory",
                         r"^recommendations", r"^before the rest", r"^┃ change",
                         r"^│ (ref\.fsdp|plan\.emulate|rollout\.sleep)", r"^to apply"])
    return "\n".join([f"$ fitrl plan {config}", *lines, f"(exit status {rc})"])


QWEN_72B_CONFIG = {  # https://huggingface.co/Qwen/Qwen2.5-72B-Instruct/blob/main/config.json, as published
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 8192, "initializer_range": 0.02, "intermediate_size": 29568,
    "max_position_embeddings": 32768, "max_window_layers": 70, "model_type": "qwen2", "num_attention_heads": 64,
    "num_hidden_layers": 80, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064}


def _plan_hub(scratch: Path) -> str:
    """``fitrl plan`` of a Hub id whose cache holds its config.json alone (what ``hf download
    Qwen/Qwen2.5-72B-Instruct config.json`` leaves; built here without a network), offline."""
    import json

    from fitrl.core.hub import cache_repo

    model, config = "Qwen/Qwen2.5-72B-Instruct", "examples/failure_stories/3_host_grows_each_rollout.yaml"
    snap = cache_repo(model, {"config.json": json.dumps(QWEN_72B_CONFIG, indent=2) + "\n"}, cache=scratch / "hub")
    args = [config, f"actor.model.path={model}", f"ref.model.path={model}", "rollout.tensor_parallel_size=8",
            "--nodes", "4", "--gpus-per-node", "8", "--gpu-memory", "80GiB", "--host-memory", "2TiB"]
    rc, out = fitrl("plan", *args, HF_HUB_CACHE=str(scratch / "hub"), HF_HUB_OFFLINE="1")
    lines = select(out, [r"^qwen2 ", r"^on 4 node", r"^256 prompts", r"^peak (GPU|host) memory", r"^┃ phase",
                         r"^│ (rollout|ref_logprob|update) ", r"^┃ process", r"^│ (trainer rank|rollout engine)",
                         r"^(does not fit|tight|fits)", r"^  (GPU|host) ", r"^recommendations", r"^┃ change",
                         r"│ fits +│$", r"^to apply", r"^(actor|ref|rollout|plan|data)\.\S+="])
    return "\n".join(["$ ls $HF_HUB_CACHE/models--Qwen--Qwen2.5-72B-Instruct/snapshots/*/",
                      *sorted(p.name for p in snap.path.iterdir()),
                      f"$ HF_HUB_OFFLINE=1 fitrl plan {args[0]} \\", "    " + " ".join(args[1:3]) + " \\",
                      "    " + " ".join(args[3:]), *lines, f"(exit status {rc})"])


def _plan_on_train(scratch: Path) -> str:
    demo_model()
    fits = ["train", "examples/arith.yaml", "trainer.max_steps=1", f"trainer.run_dir={scratch}/fits"]
    rc1, out1 = fitrl(*fits)
    big = ["train", "examples/arith.yaml", "actor.model.path=examples/failure_stories/models/qwen2.5-7b-instruct",
           "trainer.device=cpu"]
    rc2, out2 = fitrl(*big)
    return "\n".join(["$ fitrl train examples/arith.yaml trainer.max_steps=1", *select(out1, [r"^memory plan:"]),
                      "$ fitrl " + " ".join(big), GAP, *select(out2, [r"^fitrl: run stopped", r"^no change",
                                                                       r"^to train anyway"]),
                      f"(exit status {rc2})"])


def _guard(scratch: Path) -> str:
    demo_model()
    args = ["train", "examples/arith.yaml", "memory.guard_min_available_gib=100", "trainer.val_before_train=false",
            f"trainer.run_dir={scratch}/g"]
    rc, out = fitrl(*args)
    lines = select(out, [r"^fitrl: run stopped", r"^  "], gaps=False)
    return _scrub(["$ fitrl train examples/arith.yaml memory.guard_min_available_gib=100 trainer.val_before_train=false "
                   "trainer.run_dir=runs/g",
                   *lines, f"(exit status {rc})"], scratch)


LEAK_SCRIPT = """
import functools, sys
import numpy as np
from fitrl.config import load_config
from fitrl.roles.workers import PolicyWorker
from fitrl.trainer.run import train

held, original = [], PolicyWorker.compute_logprob
@functools.wraps(original)
def leaking(self, *args, **kwargs):  # touched pages, so RSS really grows by 8 MiB per step
    held.append(np.ones(8 * 2**20, dtype=np.uint8))
    return original(self, *args, **kwargs)
PolicyWorker.compute_logprob = leaking
train(load_config("examples/arith.yaml", ["trainer.max_steps=40", "trainer.val_freq=0", "trainer.run_dir=" + sys.argv[1],
      "trainer.val_before_train=false", "checkpoint.save_final=false", "trainer.progress_bar=false"]))
"""


def _leak(scratch: Path) -> str:
    demo_model()
    proc = subprocess.run([sys.executable, "-c", LEAK_SCRIPT, str(scratch / "leak")], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    lines = select(proc.stdout + proc.stderr, [r"^warning: memory leak"], gaps=False)
    return "\n".join(lines[:1]) if lines else f"(no leak warning; exit status {proc.returncode})"


MEMORY = (GIB, re.compile(r"step \d+\b"), re.compile(r"steps \d+-\d+"))
BLOCKS: dict[str, Block] = {b.name: b for b in (
    Block("demo", "README.md", _demo, trained=True, slow=True),
    Block("vl-demo", "docs/vision.md", _vl_demo, trained=True, slow=True),
    Block("config-errors", "docs/config.md", _config_errors),
    Block("plan-story", "docs/memory.md", _plan_story),
    Block("plan-hub", "docs/hub.md", _plan_hub),
    Block("plan-on-train", "docs/memory.md", _plan_on_train, masks=(GIB, re.compile(r"\d+% of"))),
    Block("guard", "docs/memory.md", _guard, masks=MEMORY),
    Block("leak", "docs/memory.md", _leak, masks=(*MEMORY, re.compile(r"\d+\.\d MiB/step")), slow=True),
)}


def normalise(text: str, block: Block, exact: bool) -> str:
    """``text`` with what varies between runs replaced by ``#``: the block's masks and times, and
    every number when the figures come from training on another CPU than the recording one."""
    for pattern in (*block.masks, TIME):
        text = pattern.sub("#", text)
    if block.trained and not exact:  # (an exit status is the verdict: compared everywhere)
        text = "\n".join(line if EXIT.fullmatch(line.strip()) else NUMBER.sub("#", line)
                         for line in text.splitlines())
        text = NOISE.sub("", text)  # whether a rise is beyond noise follows the figures
    return "\n".join(line.rstrip() for line in text.splitlines())


def documented() -> dict[str, tuple[Path, str, str | None]]:
    """Every marked block in the README and docs/: name -> (file, the block's text, recorded on)."""
    found: dict[str, tuple[Path, str, str | None]] = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            m = MARKER.match(line)
            if not m:
                continue
            if i + 1 >= len(lines) or lines[i + 1] != "```":
                raise SystemExit(f"{path.relative_to(ROOT)}:{i + 1}: an output marker must sit right above a ``` fence")
            end = lines.index("```", i + 2)
            found[m["name"]] = (path, "\n".join(lines[i + 2:end]), m["machine"])
    return found


def unmarked_output_fences() -> list[str]:
    """Fences without a language (command output) that carry no output marker: ``file:line``."""
    bad = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines, inside = path.read_text().splitlines(), False
        for i, line in enumerate(lines):
            if not line.startswith("```"):
                continue
            if not inside and line == "```" and not (i and MARKER.match(lines[i - 1])):
                bad.append(f"{path.relative_to(ROOT)}:{i + 1}")
            inside = not inside
    return bad


def write(block: Block, text: str) -> None:
    path = ROOT / block.file
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if m and m["name"] == block.name:
            end = lines.index("```", i + 2)
            recorded = f"; recorded on {machine()}" if block.trained else ""
            marker = f"<!-- output: {block.name}{recorded} -->"
            lines[i:end + 1] = [marker, "```", *text.splitlines(), "```"]
            path.write_text("\n".join(lines) + "\n")
            return
    raise SystemExit(f"{block.file} has no <!-- output: {block.name} --> marker")


def check(block: Block, scratch: Path) -> str | None:
    """None when the documented block is what its command prints now; else a unified diff."""
    import difflib

    path, shown, recorded = documented()[block.name]
    exact = recorded is None or recorded == machine()
    now = block.make(scratch)
    a, b = normalise(shown, block, exact), normalise(now, block, exact)
    if a == b:
        return None
    diff = difflib.unified_diff(a.splitlines(), b.splitlines(), f"{path.name} ({block.name})", "now", lineterm="")
    return "\n".join(diff) + f"\n(rewrite it: .venv/bin/python bench/doc_outputs.py {block.name})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"blocks to run (default: all): {', '.join(BLOCKS)}")
    parser.add_argument("--check", action="store_true", help="exit 1 when a block differs from a run now")
    args = parser.parse_args()
    bad = unmarked_output_fences()
    if bad:
        print("output fences without an <!-- output: NAME --> marker (or give diagrams the `text` language): "
              + ", ".join(bad))
        return 1
    unknown = [n for n in args.names if n not in BLOCKS]
    if unknown:
        parser.error(f"no block named {', '.join(unknown)}; the blocks: {', '.join(BLOCKS)}")
    names = args.names or list(BLOCKS)
    stale = 0
    for name in names:
        block = BLOCKS[name]
        with tempfile.TemporaryDirectory(prefix=f"fitrl-doc-{name}-") as tmp:
            if args.check:
                diff = check(block, Path(tmp))
                print(f"{name}: " + ("as documented" if diff is None else "STALE\n" + diff))
                stale += diff is not None
            else:
                write(block, block.make(Path(tmp)))
                print(f"{name}: written to {block.file}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
