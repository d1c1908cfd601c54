"""Bad inputs through the real command line (issue 12, part A): every user's mistake is one line,
exit 2, no traceback, and leaves an existing run as it was (harness: tests/badcases.py).

Categories: config mistakes, non-finite or non-positive learning rates, every fault of a model
directory, data faults, reward faults, run-directory faults (unwritable, locked by a live run,
a stale lock), `fitrl plan` and `fitrl export` mistakes, and the --debug switch.

Most cases run in this process (no torch import per case); the few that need a second process
at the same time or a crash run as subprocesses. Cases that must not damage an existing run
train on ``ws.run`` (the finished run with its checkpoint) as their run directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from badcases import Case, Workspace, run_case
from bad_input_faults import (
    on_run,
    on_new,
    break_model,
    write_file,
    no_lock_left,
    no_new_run_dir,
    no_hub_talk,
    corrupt_config_json,
    drop_shape_keys,
    unknown_model_type,
    no_weights,
    truncated_weights,
    garbage_weights,
    shard_without_index,
    index_names_missing_file,
    no_tokenizer_json,
    no_tokenizer_files,
    garbage_tokenizer_json,
    tokenizer_larger_than_embedding,
    config_from_another_model,
    no_chat_template,
    no_eos,
    misspelt_model_path,
    misspelt_tokenizer_path,
    reference_without_weights,
    data_lines,
    bad_json_line,
    empty_data_file,
    fewer_prompts_than_batch,
    images_on_text_model,
    reward_file,
    agent_file,
    template_without_tools,
    file_in_the_way,
    below_a_file,
    unwritable_before_model,
    second_run_on_live_dir,
    names_live_pid,
    stale_lock,
    took_over,
    plan,
    plan_without_shape_keys,
    SEGFAULT_REWARD,
)

from fitrl.trainer.rundir import LOCK_NAME


# ----------------------------------------------------------------------------- the table

MODEL = "model error: .*"
CASES = [
    # --- config mistakes (stop at load: nothing is created)
    Case("config-unknown-key", "config", on_new("actor.optim.lrr=1e-5"), r"did you mean 'actor\.optim\.lr'",
         check=no_new_run_dir),
    Case("config-wrong-type", "config", on_new("trainer.max_steps=many"), r"trainer\.max_steps.*expects int"),
    Case("config-yaml-syntax", "config", write_file("bad.yaml", "data: [unclosed\n", lambda ws, p: ["train", str(p)]),
         r"bad\.yaml is not valid YAML"),
    Case("config-file-missing", "config", lambda ws: ["train", str(ws.root / "nope.yaml")], r"config file not found"),
    Case("config-batch-does-not-divide", "config", on_new("data.rollout_batch_size=6"), r"data\.rollout_batch_size=6"),
    Case("config-reward-timeout-inf", "config", on_new("reward.timeout=inf"), r"'reward\.timeout'.*finite number"),
    Case("config-kl-coef-nan", "config", on_new("algorithm.kl_coef=nan"), r"'algorithm\.kl_coef'.*finite number"),
    # --- learning rates
    Case("lr-nan", "lr", on_run("actor.optim.lr=nan"), r"'actor\.optim\.lr' \(in overrides\) must be a finite number"),
    Case("lr-inf", "lr", on_run("actor.optim.lr=inf"), r"'actor\.optim\.lr' \(in overrides\) must be a finite number"),
    Case("lr-zero", "lr", on_run("actor.optim.lr=0"), r"actor\.optim\.lr must be a finite number > 0, got 0\.0"),
    Case("lr-negative", "lr", on_run("actor.optim.lr=-1e-5"), r"actor\.optim\.lr must be a finite number > 0"),
    Case("critic-lr-zero", "lr", on_run("critic.optim.lr=0"), r"critic\.optim\.lr must be a finite number > 0"),
    Case("critic-lr-nan", "lr", on_run("critic.optim.lr=nan"), r"'critic\.optim\.lr'.*finite number"),
    # --- model directory (on the existing run: refused before it is touched)
    Case("model-path-misspelt", "model", misspelt_model_path,
         MODEL + r"actor\.model\.path='.*modle' does not exist.*did you mean '.*model'", check=no_hub_talk),
    Case("model-config-corrupt", "model", break_model(corrupt_config_json),
         MODEL + r".*model/config\.json:3: invalid JSON", check=no_lock_left),
    Case("model-config-no-shape-keys", "model", break_model(drop_shape_keys),
         MODEL + r".*config\.json has no hidden_size, num_hidden_layers"),
    Case("model-type-unknown", "model", break_model(unknown_model_type), MODEL + r"model_type 'qwen9' is not"),
    Case("model-no-weights", "model", break_model(no_weights), MODEL + r"has no weights \(model\.safetensors"),
    Case("model-truncated-safetensors", "model", break_model(truncated_weights),
         MODEL + r".*model\.safetensors is truncated: .* bytes, its header describes"),
    Case("model-garbage-safetensors", "model", break_model(garbage_weights),
         MODEL + r".*model\.safetensors is not a readable safetensors file"),
    Case("model-shard-without-index", "model", break_model(shard_without_index),
         MODEL + r"model-00001-of-00002\.safetensors but no model\.safetensors\.index\.json"),
    Case("model-index-names-missing-file", "model", break_model(index_names_missing_file),
         MODEL + r"index\.json names 1 file\(s\) that are not in .*model-00002-of-00002"),
    Case("model-config-from-another-model", "model", break_model(config_from_another_model),
         MODEL + r"does not belong to the weights beside it: it says vocab_size=256"),
    Case("tokenizer-missing-vocabulary", "model", break_model(no_tokenizer_json),
         MODEL + r"the tokenizer in .* is empty: .*no vocabulary file there", check=no_lock_left),
    Case("tokenizer-no-files-at-all", "model", break_model(no_tokenizer_files),
         MODEL + r"the tokenizer in .* is empty"),
    Case("tokenizer-garbage", "model", break_model(garbage_tokenizer_json),
         MODEL + r"cannot load the tokenizer in .*model \(actor\.model\.path\)"),
    Case("tokenizer-path-misspelt", "model", misspelt_tokenizer_path,
         MODEL + r"actor\.model\.tokenizer_path='.*modle' does not exist \(fitrl reads local directories only",
         check=no_hub_talk),
    Case("tokenizer-larger-than-embedding", "model", break_model(tokenizer_larger_than_embedding),
         MODEL + r"has 612 token ids but the model's embedding has vocab_size=512"),
    Case("tokenizer-no-chat-template", "model", break_model(no_chat_template),
         MODEL + r"has no chat template .* data\.apply_chat_template=true"),
    Case("tokenizer-no-eos", "model", break_model(no_eos), MODEL + r"no end-of-sequence token"),
    Case("reference-model-without-weights", "model", reference_without_weights,
         MODEL + r"ref\.model\.path='.*ref-model' has no weights"),
    # --- data
    Case("data-file-missing", "data", on_run("data.train_files=[/nonexistent/train.jsonl]"),
         r"^fitrl: data error: data file not found: /nonexistent/train\.jsonl", check=no_lock_left),
    Case("data-bad-json-line", "data", bad_json_line, r"data error: .*broken\.jsonl:3: invalid JSON"),
    Case("data-missing-prompt-key", "data", on_run("data.prompt_key=question"),
         r"arith_train\.jsonl:1: row has no 'question' column .* set data\.prompt_key"),
    Case("data-empty-file", "data", empty_data_file, r"data error: train: no rows in .*empty\.jsonl"),
    Case("data-fewer-prompts-than-batch", "data", fewer_prompts_than_batch,
         r"train: 3 prompts but data\.rollout_batch_size=4 draws 4 per step.*lower data\.rollout_batch_size to 3"),
    Case("data-images-on-a-text-model", "data", images_on_text_model,
         r"with_images\.jsonl:4: row has images \(column 'images'\) but actor\.model\.path is a text model"),
    Case("data-all-prompts-too-long", "data", on_run("data.max_prompt_length=5"),
         r"all 80 rows of .* are longer than data\.max_prompt_length=5 tokens"),
    Case("data-unsupported-format", "data",
         lambda ws: data_lines(ws, "train.csv", ["prompt,answer", "1+1,2"]), r"unsupported file type '\.csv'"),
    # --- reward
    Case("reward-unknown-builtin", "reward", on_run("reward.function=arithh"), r"did you mean 'arith'"),
    Case("reward-file-missing", "reward", on_run("reward.function=/nonexistent/reward.py:score"),
         r"reward\.function: file not found: /nonexistent/reward\.py"),
    Case("reward-syntax-error", "reward",
         lambda ws: reward_file(ws, "def score(response, answer:\n    return 1\n", "score"),
         r"config error: reward\.function: .*my_reward\.py:1: syntax error"),
    Case("reward-import-raises", "reward",
         lambda ws: reward_file(ws, "import math\nWEIGHT = undefined_name\n", "score"),
         r"importing .*my_reward\.py raised NameError: .*undefined_name.* \(at .*my_reward\.py:2\)"),
    Case("reward-no-such-function", "reward", lambda ws: reward_file(ws, "def other(r, a):\n    return 0\n", "score"),
         r"my_reward\.py has no function 'score'"),
    Case("reward-returns-wrong-type", "reward",
         lambda ws: reward_file(ws, "def score(response, answer):\n    return 'high'\n", "score",
                                "reward.num_workers=0", "trainer.max_steps=1", run_dir=ws.root / "new-run"),
         r"^fitrl: reward error: reward function .*my_reward\.py:score returned str \('high'\)"),
    Case("reward-raises-on-every-call", "reward",
         lambda ws: reward_file(ws, "def score(response, answer):\n    raise ValueError('no answer key')\n", "score",
                                "reward.num_workers=0", "trainer.max_steps=1", run_dir=ws.root / "new-run"),
         r"^fitrl: reward error: .*raised ValueError: no answer key.*more than reward\.max_error_fraction"),
    Case("reward-segfault-in-driver", "reward",
         lambda ws: reward_file(ws, SEGFAULT_REWARD, "crash", "reward.num_workers=0", "trainer.max_steps=1",
                                run_dir=ws.root / "new-run"),
         r"Segmentation fault.*my_reward\.py\", line 5 in crash", exit=-11, subprocess=True),
    # --- multi-turn agents (docs/agents.md)
    Case("agent-env-unknown", "agent", on_new("rollout.agent.env=tool"), r"rollout\.agent\.env: unknown name 'tool'; "
         r"did you mean 'tools'", check=no_new_run_dir),
    Case("agent-env-syntax-error", "agent", lambda ws: agent_file(ws, "my_env.py", "class Env(:\n", "rollout.agent.env", "Env"),
         r"config error: rollout\.agent\.env: .*my_env\.py:1: syntax error"),
    Case("agent-tool-without-docstring", "agent",
         lambda ws: agent_file(ws, "my_tools.py", "def lookup(key):\n    return key\n", "rollout.agent.tools", "lookup",
                               "rollout.agent.env=tools"),
         r"rollout\.agent\.tools: .*my_tools\.py:lookup: no JSON schema can be made .*Args:"),
    Case("agent-template-cannot-render-tools", "agent", template_without_tools,
         r"the chat template of .* does not render tools \(tool 'calculator' is missing"),
    # --- run directory
    Case("run-dir-under-proc", "run_dir", lambda ws: ws.train_args(run_dir=Path("/proc/fitrl-bad-inputs")),
         r"^fitrl: run directory: cannot create /proc/fitrl-bad-inputs \(trainer\.run_dir\)"),
    Case("run-dir-file-in-the-way", "run_dir", file_in_the_way, r"a-file \(trainer\.run_dir\): a file is in the way"),
    Case("run-dir-below-a-file", "run_dir", below_a_file, r"a part of that path is a file, not a directory"),
    Case("run-dir-reported-before-the-model", "run_dir", unwritable_before_model,
         r"^fitrl: run directory: cannot create /proc/fitrl-bad-inputs/run"),
    Case("run-dir-in-use-by-a-live-run", "run_dir", second_run_on_live_dir,
         r"run directory: .*live is in use by another fitrl run: PID \d+ on host", check=names_live_pid),
    Case("run-dir-stale-lock-taken-over", "run_dir", stale_lock, r"took over the lock of PID \d+ on host .*which is "
         r"no longer running", check=took_over),
    Case("resume-with-changed-config", "run_dir", on_run("actor.optim.lr=1e-2"),
         r"config error: checkpoint .*step_2 was saved with a different config.*actor\.optim\.lr", check=no_lock_left),
    Case("resume-missing-checkpoint", "run_dir", on_run("checkpoint.resume=/nonexistent/step_7"),
         r"^fitrl: checkpoint error: checkpoint /nonexistent/step_7 does not exist"),
    # --- fitrl plan
    Case("plan-gpu-memory-zero", "plan", plan("--gpu-memory", "0"), r"--gpu-memory: 0 bytes per device is not a GPU's"),
    Case("plan-gpu-memory-negative", "plan", plan("--gpu-memory=-80GiB"), r"--gpu-memory='-80GiB' is not a size"),
    Case("plan-gpu-memory-absurd", "plan", plan("--gpu-memory", "100000TiB"), r"GiB per device is not a GPU's memory"),
    Case("plan-host-memory-no-unit", "plan", plan("--host-memory", "512"), r"--host-memory: 512 bytes per node"),
    Case("plan-size-not-a-size", "plan", plan("--gpu-memory", "lots"), r"--gpu-memory='lots' is not a size"),
    Case("plan-nodes-zero", "plan", plan("--nodes", "0"), r"--nodes 0: must be >= 1"),
    Case("plan-config-json-without-shape-keys", "plan", plan_without_shape_keys,
         r"config\.json has no hidden_size, num_hidden_layers"),
    # --- fitrl export
    Case("export-missing-checkpoint", "export", lambda ws: ["export", str(ws.root / "nope"), str(ws.root / "out")],
         r"^fitrl: checkpoint error: checkpoint .*nope does not exist"),
    Case("export-no-checkpoint-in-dir", "export", lambda ws: ["export", str(ws.data), str(ws.root / "out")],
         r"no complete checkpoint in .*data"),
    Case("export-out-dir-not-empty", "export", lambda ws: ["export", str(ws.run), str(ws.data)],
         r"data already exists and is not empty"),
    Case("export-adapter-of-full-checkpoint", "export",
         lambda ws: ["export", str(ws.run), str(ws.root / "out"), "--lora", "adapter"],
         r"holds the full policy .* --lora adapter needs a checkpoint of a LoRA run"),
    Case("export-bad-dtype", "export", lambda ws: ["export", str(ws.run), str(ws.root / "out"), "--dtype", "fp8"],
         r"invalid choice: 'fp8'"),
    # --- --debug shows the traceback a user's mistake otherwise hides
    Case("debug-flag-shows-traceback", "debug", on_run("actor.optim.lr=0", "--debug"),
         r"Traceback \(most recent call last\).*fitrl: config error: actor\.optim\.lr must be", traceback=True),
    Case("debug-flag-before-command", "debug", lambda ws: ["--debug", *ws.train_args("actor.optim.lr=0")],
         r"Traceback \(most recent call last\).*actor\.optim\.lr must be", traceback=True),
    Case("debug-env-shows-traceback", "debug", on_run("data.train_files=[/nonexistent/x.jsonl]"),
         r"Traceback \(most recent call last\).*fitrl: data error: data file not found", traceback=True,
         env={"FITRL_DEBUG": "1"}),
]


# a case with a second process (~5 s each: torch imported again) is in the slow tier
SECOND_PROCESS = {"run-dir-in-use-by-a-live-run"}
PARAMS = [pytest.param(c, marks=pytest.mark.slow) if c.subprocess or c.id in SECOND_PROCESS else c for c in CASES]


@pytest.mark.parametrize("case", PARAMS, ids=str)
def test_bad_input(case: Case, workspace: Workspace):
    try:
        run_case(case, workspace)
    finally:
        for proc in getattr(workspace, "background", []):  # a live run started by the case
            proc.kill()
            proc.wait()


def test_the_table_covers_every_category():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)
    assert {c.category for c in CASES} >= {"config", "lr", "model", "data", "reward", "run_dir", "plan", "export"}


def test_an_internal_error_prints_its_traceback_and_says_it_is_a_bug(monkeypatch, capsys):
    import fitrl.cli

    def broken(args):
        return 1 / 0  # stands for any bug in fitrl

    monkeypatch.setattr(fitrl.cli, "cmd_config", broken)
    assert fitrl.cli.main(["config"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ZeroDivisionError" in err
    assert err.strip().splitlines()[-1].startswith("fitrl: internal error: this is a bug in fitrl")


def test_plan_help_has_no_doubled_percent(capsys):
    from fitrl.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "97% of a device" in out and "%%" not in out


def test_lock_is_exclusive_within_one_process_and_released(tmp_path):
    from fitrl.core.errors import RunDirError
    from fitrl.trainer.rundir import RunDirLock

    with RunDirLock(tmp_path) as held:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        with pytest.raises(RunDirError, match=f"in use by another fitrl run: PID {os.getpid()}"):
            RunDirLock(tmp_path).acquire()
        assert held.file.is_file()
    assert not (tmp_path / LOCK_NAME).exists()
    with RunDirLock(tmp_path):  # free again
        pass
