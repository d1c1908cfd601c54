"""The faults of the bad-input table (tests/test_bad_inputs.py): each breaks one thing in a
case's workspace (tests/badcases.py) and returns the command line, or checks what a case left."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from badcases import Case, Outcome, Workspace, edit_json

from fitrl.trainer.rundir import LOCK_NAME


# ----------------------------------------------------------------------------- helpers


def on_run(*overrides: str):
    """``prepare`` that trains on the existing finished run with ``overrides`` (must not damage it)."""
    return lambda ws: ws.train_args(*overrides, run_dir=ws.run)


def on_new(*overrides: str):
    """``prepare`` that trains on a fresh run directory with ``overrides``."""
    return lambda ws: ws.train_args(*overrides)


def break_model(fault):
    """``prepare`` that applies ``fault(ws)`` to the workspace's model copy, then trains on ws.run."""
    def prepare(ws: Workspace) -> list[str]:
        fault(ws)
        return ws.train_args(run_dir=ws.run)
    return prepare


def write_file(name: str, text: str, then):
    """``prepare`` that writes ``text`` to ``ws.root / name`` and returns ``then(ws, path)``."""
    def prepare(ws: Workspace) -> list[str]:
        path = ws.root / name
        path.write_text(text)
        return then(ws, path)
    return prepare


def no_lock_left(ws: Workspace, out: Outcome) -> None:
    """The run directory's lock is released (its file removed) on the way out of a failed run."""
    assert not (ws.run / LOCK_NAME).exists(), "the lock of the existing run was not released"


def no_new_run_dir(ws: Workspace, out: Outcome) -> None:
    """A run that failed its checks leaves no (empty) run directory behind."""
    assert not (ws.root / "new-run").exists(), sorted(p.name for p in (ws.root / "new-run").iterdir())


def no_hub_talk(ws: Workspace, out: Outcome) -> None:
    text = (out.stderr + out.stdout).lower()
    assert "huggingface.co" not in text and "repo id" not in text and "internet" not in text, text


def all_of(*checks):
    def check(ws: Workspace, out: Outcome) -> None:
        for c in checks:
            c(ws, out)
    return check


# ----------------------------------------------------------------------------- model faults

def corrupt_config_json(ws):
    (ws.model / "config.json").write_text('{\n  "hidden_size": 64,\n  "model_type": "qwen2",,\n}\n')


def drop_shape_keys(ws):
    edit_json(ws.model / "config.json", hidden_size=..., num_hidden_layers=...)


def unknown_model_type(ws):
    edit_json(ws.model / "config.json", model_type="qwen9")


def no_weights(ws):
    (ws.model / "model.safetensors").unlink()


def truncated_weights(ws):
    f = ws.model / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def garbage_weights(ws):
    f = ws.model / "model.safetensors"
    f.write_bytes(os.urandom(f.stat().st_size))


def shard_without_index(ws):
    (ws.model / "model.safetensors").rename(ws.model / "model-00001-of-00002.safetensors")


def index_names_missing_file(ws):
    (ws.model / "model.safetensors").rename(ws.model / "model-00001-of-00002.safetensors")
    (ws.model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors"}}))


def no_tokenizer_json(ws):
    (ws.model / "tokenizer.json").unlink()


def no_tokenizer_files(ws):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (ws.model / name).unlink()


def garbage_tokenizer_json(ws):
    (ws.model / "tokenizer.json").write_text("{ this is not a tokenizer")


def tokenizer_larger_than_embedding(ws):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ws.model), local_files_only=True)
    tok.add_tokens([f"extra_token_{i}" for i in range(100)])
    tok.save_pretrained(str(ws.model))


def config_from_another_model(ws):
    edit_json(ws.model / "config.json", vocab_size=256)


def no_chat_template(ws):
    (ws.model / "chat_template.jinja").unlink()
    edit_json(ws.model / "tokenizer_config.json", chat_template=...)


def no_eos(ws):
    edit_json(ws.model / "tokenizer_config.json", eos_token=None)
    edit_json(ws.model / "config.json", eos_token_id=None)
    edit_json(ws.model / "generation_config.json", eos_token_id=...)


def misspelt_model_path(ws):
    return ws.train_args(f"actor.model.path={ws.root / 'modle'}", run_dir=ws.run)


def misspelt_tokenizer_path(ws):
    return ws.train_args(f"actor.model.tokenizer_path={ws.root / 'modle'}", run_dir=ws.run)


def reference_without_weights(ws):
    ref = ws.root / "ref-model"
    ref.mkdir()
    shutil.copy(ws.model / "config.json", ref / "config.json")
    return ws.train_args("algorithm.use_kl_loss=true", f"ref.model.path={ref}", run_dir=ws.run)


# ----------------------------------------------------------------------------- data faults

def data_lines(ws, name: str, lines: list[str], *overrides: str) -> list[str]:
    path = ws.data / name
    path.write_text("".join(line + "\n" for line in lines))
    return ws.train_args(f"data.train_files=[{path}]", *overrides, run_dir=ws.run)


def first_rows(ws, n: int) -> list[str]:
    return (ws.data / "arith_train.jsonl").read_text().splitlines()[:n]


def bad_json_line(ws):
    rows = first_rows(ws, 5)
    rows[2] = rows[2][:-5]  # line 3 cut short
    return data_lines(ws, "broken.jsonl", rows)


def empty_data_file(ws):
    return data_lines(ws, "empty.jsonl", [])


def fewer_prompts_than_batch(ws):
    return data_lines(ws, "three.jsonl", first_rows(ws, 3))  # data.rollout_batch_size=4


def images_on_text_model(ws):
    rows = [json.loads(r) for r in first_rows(ws, 5)]
    rows[3]["images"] = ["cat.png"]  # line 4; the tiny model is a text model
    return data_lines(ws, "with_images.jsonl", [json.dumps(r) for r in rows])


# ----------------------------------------------------------------------------- reward faults

def reward_file(ws, text: str, function: str, *overrides: str, run_dir=None) -> list[str]:
    path = ws.root / "my_reward.py"
    path.write_text(text)
    return ws.train_args(f"reward.function={path}:{function}", *overrides, run_dir=run_dir or ws.run)


def agent_file(ws, name: str, text: str, key: str, obj: str, *overrides: str) -> list[str]:
    """A user's environment or tool file for ``key`` (``rollout.agent.env``, ``rollout.agent.tools``)."""
    path = ws.root / name
    path.write_text(text)
    value = f"[{path}:{obj}]" if key.endswith("tools") else f"{path}:{obj}"
    return ws.train_args(f"{key}={value}", *overrides)


NO_TOOLS_TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                     "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def template_without_tools(ws) -> list[str]:
    """The model's chat template replaced by one that ignores ``tools=``, then a run with a tool."""
    jinja = ws.model / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(NO_TOOLS_TEMPLATE)
    else:
        path = ws.model / "tokenizer_config.json"
        cfg = json.loads(path.read_text())
        cfg["chat_template"] = NO_TOOLS_TEMPLATE
        path.write_text(json.dumps(cfg))
    return ws.train_args("rollout.agent.env=tools", "rollout.agent.tools=[calculator]")


SEGFAULT_REWARD = "import ctypes\n\n\ndef crash(response, answer):\n    return ctypes.string_at(0)\n"


# ----------------------------------------------------------------------------- run-directory faults

def file_in_the_way(ws):
    (ws.root / "a-file").write_text("not a directory")
    return ws.train_args(run_dir=ws.root / "a-file")


def below_a_file(ws):
    (ws.root / "a-file").write_text("not a directory")
    return ws.train_args(run_dir=ws.root / "a-file" / "run")


def unwritable_before_model(ws):
    no_weights(ws)  # the model is broken too: the run directory must be reported first
    return ws.train_args(run_dir=Path("/proc/fitrl-bad-inputs/run"))


def start_live_run(ws: Workspace, run_dir: Path) -> subprocess.Popen:
    """A long run in the background, returned once it holds its run directory's lock."""
    args = ws.train_args("trainer.max_steps=100000", "trainer.val_before_train=false", "data.val_files=[]",
                         "reward.num_workers=0", run_dir=run_dir)
    log = open(ws.root / "live-run.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "fitrl.cli", *args], cwd=ws.root, stdout=log,
                            stderr=subprocess.STDOUT)
    ws.background = [*getattr(ws, "background", []), proc]  # killed by the test whatever happens
    deadline = time.monotonic() + 300  # 10x a loaded machine's start-up
    lock = run_dir / LOCK_NAME
    while not (lock.is_file() and lock.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            log_text = (ws.root / "live-run.log").read_text()
            raise AssertionError(f"the live run did not take its lock: {log_text[-2000:]}")
        time.sleep(0.1)
    return proc


def second_run_on_live_dir(ws):
    start_live_run(ws, ws.root / "live")
    return ws.train_args(run_dir=ws.root / "live")


def names_live_pid(ws: Workspace, out: Outcome) -> None:
    live = ws.background[0]
    assert f"PID {live.pid} on host {socket.gethostname()}" in out.stderr, out.stderr
    assert live.poll() is None, "the refused run stopped the live one"
    assert (ws.root / "live" / LOCK_NAME).is_file(), "the refused run removed the live run's lock"


def stale_lock(ws):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a PID that no longer runs
    (ws.run / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                "started": "2026-01-01T00:00:00"}) + "\n")
    ws.stale_pid = dead.pid
    # a data mistake stops the run after the takeover: the notice and then the one line
    return ws.train_args(f"data.train_files=[{ws.data / 'missing.jsonl'}]", run_dir=ws.run)


def took_over(ws: Workspace, out: Outcome) -> None:
    assert f"took over the lock of PID {ws.stale_pid}" in out.stdout, out.stdout
    assert "data file not found" in out.stderr, out.stderr
    no_lock_left(ws, out)


# ----------------------------------------------------------------------------- plan and export

def plan(*flags: str):
    return lambda ws: ["plan", str(ws.config), *flags]


def plan_without_shape_keys(ws):
    drop_shape_keys(ws)
    return ["plan", str(ws.config)]
