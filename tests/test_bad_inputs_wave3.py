"""Bad inputs of the newer features through the real command line (issue 66): supervised rows,
``import-config`` given a file that is not text, ``trainer.hang_timeouts`` keys that name no
phase, an allocator library that cannot be loaded, a full disk at a checkpoint save, and reward
sources (a reward model of another vocabulary, a judge template with literal braces).

Each mistake is one line, exit 2, no traceback, and the workspace's finished run is untouched
(harness: tests/badcases.py); cases run in this process through ``fitrl.cli.main`` unless they
need a process of their own (the allocator's restart, one import-config case as a user runs it).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from badcases import DATA, ROOT, Case, Workspace, run_case, run_cli

EXAMPLE = str(ROOT / "examples" / "arith.yaml")
NO_TRACEBACK = "Traceback (most recent call last)"


def cli(*args: str, cwd: Path = ROOT, env: dict | None = None):
    """``fitrl ARGS`` in this process: (exit status, stderr + stdout)."""
    out = run_cli(list(args), subprocess_=False, env=env or {}, timeout=0, cwd=cwd)
    return out.code, out.stderr + out.stdout


def one_line_exit_2(code: int, text: str, pattern: str) -> str:
    """The ``fitrl: ...`` line of a refused input: exit 2, no traceback, matching ``pattern``."""
    import re

    assert code == 2 and NO_TRACEBACK not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("fitrl: ")]
    assert len(lines) == 1 and re.search(pattern, lines[0]), text[-3000:]
    return lines[0]


# ------------------------------------------------------------------------- 1. supervised rows

GOOD = {"prompt": "What is 2 + 3? Answer with a number.", "answer": 5}
GOOD_COMPLETION = {"prompt": "What is 2 + 3? Answer with a number.", "completion": "5"}


def sft_rows(bad: dict, good: dict = GOOD):
    """``prepare``: ``fitrl sft`` on seven good rows and ``bad`` as line 8 of ``sft.jsonl``."""
    def prepare(ws: Workspace) -> list[str]:
        path = ws.root / "sft.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in [good] * 7 + [bad]))
        return ["sft", str(ws.config), f"trainer.run_dir={ws.root / 'new-run'}", f"data.train_files=[{path}]",
                "data.val_files=[]", "trainer.max_steps=1", "trainer.val_before_train=false"]
    return prepare


MESSAGES = [{"role": "assistant", "content": "5"}]
SFT_CASES = [
    Case("answer-is-chat-messages", "sft", sft_rows({**GOOD, "answer": MESSAGES}),
         r"sft\.jsonl:8: the answer 'answer' \(data\.answer_key.*is a list \(of chat messages: put them in a "
         r"completion column"),
    Case("answer-null", "sft", sft_rows({**GOOD, "answer": None}), r"sft\.jsonl:8: the answer 'answer' .*is null"),
    Case("answer-empty", "sft", sft_rows({**GOOD, "answer": " \n"}), r"sft\.jsonl:8: the answer 'answer' .*is empty"),
    Case("answer-nan", "sft", sft_rows({**GOOD, "answer": float("nan")}), r"sft\.jsonl:8: .*is nan, not a finite"),
    Case("answer-object", "sft", sft_rows({**GOOD, "answer": {"value": 5}}), r"sft\.jsonl:8: .*is an object"),
    Case("completion-null", "sft", sft_rows({**GOOD_COMPLETION, "completion": None}, GOOD_COMPLETION),
         r"sft\.jsonl:8: 'completion' is null; expected text or a list of .*messages; fix or remove the row"),
    Case("completion-empty", "sft", sft_rows({**GOOD_COMPLETION, "completion": ""}, GOOD_COMPLETION),
         r"sft\.jsonl:8: an assistant turn is empty"),
    Case("completion-message-content-null", "sft",
         sft_rows({**GOOD_COMPLETION, "completion": [{"role": "assistant", "content": None}]}, GOOD_COMPLETION),
         r"sft\.jsonl:8: 'completion' has a message that is not"),
]


@pytest.mark.parametrize("case", SFT_CASES, ids=str)
def test_bad_supervised_rows_are_refused_naming_the_row(case, workspace):
    run_case(case, workspace)
    assert not list((workspace.root / "new-run").glob("checkpoints/step_*"))


def test_long_supervised_targets_are_cut_and_counted(workspace):
    long = {**GOOD, "answer": "five " * 100}
    out = run_case(Case("long-target", "sft", sft_rows(long), r"note: 1 of 8 supervised targets are longer than "
                        r"rollout\.max_response_length=\d+ tokens .* cut there", exit=0), workspace)
    assert "fitrl: " not in out.stderr


def test_a_completion_of_chat_messages_is_its_assistant_turn_not_its_repr(tiny_model_dir, tmp_path):
    from fitrl.config.data import DataConfig
    from fitrl.data.dataset import PromptDataset
    from fitrl.data.supervised import ChatTarget
    from fitrl.models.loading import load_local_tokenizer

    tok = load_local_tokenizer(str(tiny_model_dir))
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 2 + 3?"}],
                                "completion": [{"role": "assistant", "content": "It is 5."}]}) + "\n")
    for key in ("answer", "completion"):  # (data.answer_key=completion names the same column)
        ds = PromptDataset.from_config([str(path)], tok, DataConfig(answer_key=key), name="train", vision=None)
        target = ds[0]["answer"]
        assert isinstance(target, ChatTarget) and str(target) == "It is 5."
        trained = tok.decode([i for i, m in zip(target.ids, target.mask) if m])
        assert trained.startswith("It is 5.") and "'role'" not in tok.decode(target.ids)


# ---------------------------------------------------------------- 2. import-config, not text

NOT_TEXT = {
    "binary.yaml": (bytes(range(256)) * 8, r"binary\.yaml: not a text file \(a NUL byte at offset 0"),
    "launch.sh": (b"\x7fELF\x02\x01\x01\x00" + os.urandom(64), r"launch\.sh: not a text file"),
    "latin1.yaml": ("trainer:\n  project_name: caf\u00e9\n".encode("latin-1"),
                    r"latin1\.yaml:2: not UTF-8 text \(byte 0xe9 .*save it as UTF-8 \(e\.g\. `iconv"),
    "latin1.sh": ("python3 -m verl.trainer.main_ppo trainer.project_name=caf\u00e9\n".encode("latin-1"),
                  r"latin1\.sh:1: not UTF-8 text"),
    "utf16.yaml": ("trainer:\n  total_epochs: 3\n".encode("utf-16"), r"utf16\.yaml: UTF-16 text .*save it as UTF-8"),
}


@pytest.mark.parametrize("name", sorted(NOT_TEXT))
def test_import_config_of_a_file_that_is_not_text_is_one_line(name, tmp_path):
    data, pattern = NOT_TEXT[name]
    (tmp_path / name).write_bytes(data)
    one_line_exit_2(*cli("import-config", str(tmp_path / name)), r"^fitrl: config error: .*" + pattern)


def test_import_config_of_a_binary_as_a_user_runs_it(tmp_path):
    """In a process of its own, as typed: the line, exit 2, and not the internal-error banner."""
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + bytes(64))
    proc = subprocess.run([sys.executable, "-m", "fitrl.cli", "import-config", str(tmp_path / "model.safetensors")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    one_line_exit_2(proc.returncode, proc.stderr + proc.stdout, r"model\.safetensors: not a text file")
    assert "internal error" not in proc.stderr


def test_import_config_to_a_path_it_cannot_write_is_one_line(tmp_path):
    """``-o`` into a folder that does not exist: the path and the fix, not the internal-error banner."""
    script = next(p for p in sorted((ROOT / "tests/data/foreign/verl").iterdir()) if p.suffix == ".sh")
    one_line_exit_2(*cli("import-config", str(script), "-o", str(tmp_path / "nowhere" / "mine.yaml")),
                    r"-o .*nowhere/mine\.yaml: cannot write the translated config \(No such file or directory\)")


def test_import_config_of_a_directory_and_fitrl_configs_that_are_not_text(tmp_path):
    one_line_exit_2(*cli("import-config", str(tmp_path)), r"a directory, not a file")
    (tmp_path / "mine.yaml").write_bytes(b"trainer:\n  max_steps: 3\n  run_dir: /tmp/caf\xe9\n")
    one_line_exit_2(*cli("config", str(tmp_path / "mine.yaml")), r"mine\.yaml:3: not UTF-8 text")
    (tmp_path / "mine.yaml").write_bytes(bytes(range(256)))
    one_line_exit_2(*cli("train", str(tmp_path / "mine.yaml")), r"mine\.yaml: not a text file")


# ---------------------------------------------------------------- 3. hang timeouts, by phase

@pytest.mark.parametrize("key, hint", [("bogus_phase", ""), ("checkpoint_sav", "checkpoint_save"),
                                       ("ref_logprob", "ref")])
def test_a_hang_timeout_for_no_phase_is_refused_naming_the_phases(key, hint):
    line = one_line_exit_2(*cli("config", EXAMPLE, f"trainer.hang_timeouts={{{key}: 10}}"),
                           rf"trainer\.hang_timeouts\.{key}: no phase is called '{key}'")
    assert (f"did you mean {hint!r}?" in line) == bool(hint)
    assert "(the phases: data, rollout, " in line and "checkpoint_save)" in line


def test_every_driver_phase_is_a_hang_timeout_key_and_no_other():
    from fitrl.config import load_config
    from fitrl.config import describe_fields
    from fitrl.core.driver_phases import DRIVER_PHASES
    from fitrl.telemetry.timer import PhaseTimer

    cfg = load_config(EXAMPLE, ["trainer.hang_timeouts={" + ", ".join(f"{p}: 5" for p in DRIVER_PHASES) + "}"])
    assert set(cfg.trainer.hang_timeouts) == set(DRIVER_PHASES)
    doc = next(d for key, _, _, d in describe_fields() if key == "trainer.hang_timeouts")
    assert all(f"``{p}``" in doc for p in DRIVER_PHASES), doc  # the doc lists every phase
    with pytest.raises(ValueError, match="not in fitrl/core/driver_phases.py"):  # a new phase must be listed
        with PhaseTimer().phase("a_phase_nobody_listed"):
            pass


# ---------------------------------------------------------------- 4. allocator libraries

def test_an_allocator_library_that_cannot_be_loaded_is_one_line_before_anything_loads(tmp_path):
    """The file is there but is no library (a truncated download): the loader would print its own
    warning and run on glibc; fitrl says so in one line before it restarts under it."""
    (tmp_path / "libs").mkdir()
    (tmp_path / "libs" / "libjemalloc.so.2").write_bytes(b"<html>404 Not Found</html>\n")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "fitrl.cli", "train", EXAMPLE, "memory.host_allocator=jemalloc",
                           f"trainer.run_dir={run_dir}"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "FITRL_ALLOCATOR_DIR": str(tmp_path / "libs")})
    line = one_line_exit_2(proc.returncode, proc.stderr + proc.stdout,
                           r"memory\.host_allocator=jemalloc: .*libs/libjemalloc\.so\.2 cannot be preloaded \(.+\); "
                           r".*`make allocators`.*memory\.host_allocator=glibc$")
    assert "ld.so" not in proc.stderr.replace(line, "") and not run_dir.exists()


def test_a_missing_allocator_library_is_one_line_naming_where_it_looked(tmp_path, monkeypatch):
    from fitrl.core import allocator

    monkeypatch.setattr(allocator, "search_dirs", lambda: [tmp_path / "nowhere"])
    one_line_exit_2(*cli("train", EXAMPLE, "memory.host_allocator=tcmalloc", f"trainer.run_dir={tmp_path / 'run'}"),
                    r"none of libtcmalloc_minimal\.so\.4, libtcmalloc\.so\.4 in .*nowhere; `make allocators`")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- 5. a full disk at a save

@contextlib.contextmanager
def full_disk_at_save(error: BaseException):
    """Every shard write puts a few bytes down, then fails with ``error``, as a filling disk does."""
    from fitrl.checkpoint import sharded

    def save(state, checkpoint_id):
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"\0" * 100)
        raise error
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sharded.dcp, "save", save)
        yield


def test_a_full_disk_at_a_save_is_one_line_and_the_previous_checkpoint_resumes(workspace):
    from fitrl.checkpoint import layout, ranks

    resume = ["train", str(workspace.config), f"trainer.run_dir={workspace.run}", "trainer.max_steps=3",
              f"data.train_files=[{DATA / 'arith_train.jsonl'}]", f"data.val_files=[{DATA / 'arith_val.jsonl'}]"]
    with full_disk_at_save(OSError(errno.ENOSPC, "No space left on device")):
        run_case(Case("disk-full", "checkpoint", lambda ws: resume,
                      r"fitrl: run directory: checkpoint of step 3 not saved: no space left on device .*in "
                      r".*checkpoints; the partial save was removed and the newest checkpoint is still .*step_2, "
                      r"untouched .*Free space "
                      r"there \(a checkpoint of this run takes [\d.]+ MiB\)", may_change=("metrics.jsonl", "config.yaml", "generations.jsonl")),
                 workspace)
    names = sorted(p.name for p in (workspace.run / "checkpoints").iterdir())
    assert names == ["step_2"], names  # no step_3, no step_3.tmp-*
    point = layout.read(workspace.run / "checkpoints" / "step_2")
    ranks.check_checkpoint(point.path, point.meta)
    # room again: the same command resumes from step 2 and saves step 3
    code, text = cli(*resume)
    assert code == 0 and "resumed from" in text and "step_2 (step 2)" in text, text[-3000:]
    assert (workspace.run / "checkpoints" / "step_3" / layout.MARKER).is_file()


def test_what_torch_raises_on_a_full_disk_is_read_as_one(tmp_path, monkeypatch):
    """torch's zip writer loses the errno ("unexpected pos"), DCP wraps it per rank in a
    BaseException: the free space left says it was the disk; other errors stay what they are."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from fitrl.checkpoint import disk

    try:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as e:
        wrapped = CheckpointException("CheckpointException ranks:dict_keys([0])", {0: _wrap_exception(e)})
    monkeypatch.setattr(disk, "free_bytes", lambda d: 4096)
    assert disk.storage_failure(wrapped, tmp_path) == "no space left on device (4 KiB free)"
    monkeypatch.setattr(disk, "free_bytes", lambda d: 100 * 2**30)
    assert disk.storage_failure(wrapped, tmp_path).startswith("a write the storage refused (torch's writer: ")
    assert disk.storage_failure(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path) == "disk quota exceeded"
    assert disk.storage_failure(ValueError("a bug, not the disk"), tmp_path) is None


# ---------------------------------------------------------------- 6. reward sources

def test_a_reward_model_of_another_vocabulary_scores_the_text(tiny_model_dir, tmp_path):
    """The policy's responses reach a reward model as text, encoded by its own tokenizer: with a
    vocabulary unlike the policy's, its scores are those of the text through its own template."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from fitrl.data.batch import Batch
    from fitrl.models.tiny import make_tiny_model
    from fitrl.roles.model_reward import RewardModelWorker, check_reward_sources
    from helpers import toy_config

    rm_dir = make_tiny_model(tmp_path / "rm-agent", size="agent", seed=3, head="reward")
    policy_tok, rm_tok = AutoTokenizer.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(rm_dir)
    text = "The answer is 42, since 17 + 25 = 42."
    assert len(policy_tok) != len(rm_tok)
    assert policy_tok(text)["input_ids"] != rm_tok(text)["input_ids"]
    cfg = toy_config(tiny_model_dir, tmp_path / "run", "reward.sources.rm.kind=model",
                     f"reward.sources.rm.model.path={rm_dir}")
    check_reward_sources(cfg)  # nothing to refuse at start-up
    messages = [[{"role": "user", "content": "What is 17 + 25?"}], [{"role": "user", "content": "Hi"}]]
    got = RewardModelWorker(cfg, rank=0, world_size=1).score(
        Batch(fields={"prompt_messages": messages, "response_text": [text, "hello"]}))["rm"]
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    want = []
    for m, r in zip(messages, [text, "hello"]):
        rendered = rm_tok.apply_chat_template(m + [{"role": "assistant", "content": r}], tokenize=False)
        with torch.no_grad():
            want.append(model(**rm_tok(rendered, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item())
    assert got.tolist() == pytest.approx(want, abs=1e-5)


JSON_TEMPLATE = 'Grade it. Response: {response}\nReply as JSON: {"score": <0-10>}'


def test_a_judge_template_with_literal_braces_is_one_line_with_the_fix(tmp_path):
    cfg = tmp_path / "judge.yaml"
    cfg.write_text(f"base: {EXAMPLE}\nreward:\n  sources:\n    j:\n      kind: judge\n      model: {{path: x}}\n"
                   f"      template: {json.dumps(JSON_TEMPLATE)}\n")
    one_line_exit_2(*cli("config", str(cfg)),
                    r"reward\.sources\.j\.template has '\{\"score\": <0-10>\}', which str\.format reads as a field: "
                    r"write a literal brace doubled, '\{\{\"score\": <0-10>\}\}'")
    cfg.write_text(cfg.read_text().replace("{response}", "{respons}"))
    one_line_exit_2(*cli("config", str(cfg)), r"it has \{respons\} \(did you mean \{response\}\?\)")


def test_a_judge_template_with_doubled_braces_renders_them_once():
    from fitrl.config import load_config
    from fitrl.roles.model_reward import judge_prompt

    doubled = JSON_TEMPLATE.replace('{"', '{{"').replace(">}", ">}}")
    cfg = load_config(EXAMPLE, ["reward.sources.j.kind=judge", "reward.sources.j.model.path=x",
                                f"reward.sources.j.template={json.dumps(doubled)}"])
    prompt = judge_prompt(cfg.reward.sources["j"], [{"role": "user", "content": "2+2?"}], "4", 4)
    assert prompt == 'Grade it. Response: 4\nReply as JSON: {"score": <0-10>}'
