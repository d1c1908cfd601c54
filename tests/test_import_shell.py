"""`fitrl import-config` reads a launch script as bash does (fitrl/config/shell.py). The scripts
here are minimal synthetic ones written for these tests, one construct each, except the DAPO
recipe script under tests/data/foreign/ (headed by its repository, path and commit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fitrl.cli import main
from fitrl.config import ConfigError
from fitrl.config.importer import import_config
from fitrl.config.shell import read_launch
from helpers import ROOT

FOREIGN = ROOT / "tests" / "data" / "foreign"
PPO = "python3 -m verl.trainer.main_ppo"


def script(tmp_path: Path, body: str, name: str = "run.sh") -> Path:
    """A synthetic launch script (not from any project)."""
    path = tmp_path / name
    path.write_text("#!/bin/bash\nset -x\n" + body)
    return path


def args(path: Path) -> dict[str, str]:
    return dict(a.text.split("=", 1) for a in read_launch(path).args if "=" in a.text)


def test_variables_with_defaults_nesting_and_assignments(tmp_path):
    p = script(tmp_path, """
export ROOT=/data
B=/models
MODEL=${MODEL:-"${B}/qwen"}
TRAIN=${TRAIN_FILE:-${ROOT}/gsm8k/train.parquet}
N=${N:=4}
CKPT=$ROOT/ckpt
NAME=first
LR=1e-6
""" + PPO + """ \\
    actor_rollout_ref.model.path=${MODEL} \\
    data.train_files=$TRAIN \\
    actor_rollout_ref.rollout.n=$N \\
    trainer.default_local_dir="$CKPT" \\
    trainer.experiment_name=${NAME}_run \\
    actor_rollout_ref.actor.optim.lr=${LR:-1e-5} \\
    trainer.project_name=${UNSET_P:+never}proj
NAME=second
""")
    assert args(p) == {"actor_rollout_ref.model.path": "/models/qwen", "data.train_files": "/data/gsm8k/train.parquet",
                       "actor_rollout_ref.rollout.n": "4", "trainer.default_local_dir": "/data/ckpt",
                       "trainer.experiment_name": "first_run", "actor_rollout_ref.actor.optim.lr": "1e-6",
                       "trainer.project_name": "proj"}
    imp = import_config(str(p))
    assert (imp.config["actor.model.path"], imp.config["rollout.n"], imp.config["trainer.experiment_name"]) == \
        ("/models/qwen", 4, "first_run")
    assert any("MODEL, TRAIN_FILE, N" in n and "environment" in n for n in imp.notes)


def test_arithmetic_reaches_the_maps_as_numbers(tmp_path):
    p = script(tmp_path, """
max_prompt_length=$((1024 * 2))
N=4
bsz=$(( N * 8 ))
""" + PPO + """ \\
    data.max_prompt_length=${max_prompt_length} \\
    data.max_response_length=$((max_prompt_length + $N * 1024)) \\
    data.train_batch_size=$bsz \\
    actor_rollout_ref.actor.ppo_mini_batch_size=$(( -7 / 2 + 11 )) \\
    actor_rollout_ref.rollout.n=$((7 % 4))
""")
    assert args(p)["actor_rollout_ref.actor.ppo_mini_batch_size"] == "8"  # -7/2 is -3 in bash, not -4
    c = import_config(str(p)).config
    assert (c["data.max_prompt_length"], c["rollout.max_response_length"], c["data.rollout_batch_size"],
            c["rollout.n"]) == (2048, 6144, 32, 3)


@pytest.mark.parametrize("value,named", [("$N_GPUS", "N_GPUS"), ("${SLURM_JOB_NUM_NODES}", "SLURM_JOB_NUM_NODES"),
                                         ("$((N_GPUS * 2))", "N_GPUS"), ("$(nproc)", "$(nproc)"),
                                         ("`nproc`", "`nproc`"), ("$1", "$1")])
def test_an_unknown_value_for_a_setting_stops_in_one_line(tmp_path, value, named):
    p = script(tmp_path, f"{PPO} actor_rollout_ref.model.path=/m trainer.n_gpus_per_node={value}\n")
    with pytest.raises(ConfigError, match=r"run.sh:3: trainer.n_gpus_per_node=.*" + named.replace("$", r"\$")
                       .replace("(", r"\(").replace(")", r"\)") + ".*give trainer.n_gpus_per_node=VALUE"):
        import_config(str(p))
    ok = import_config(str(p), ["trainer.n_gpus_per_node=8"])  # the user's value after the script: no question
    assert ok.config["trainer.devices_per_node"] == 8


def test_names_and_paths_are_left_for_the_user_with_a_line(tmp_path):
    p = script(tmp_path, """
TS=$(date +%Y%m%d_%H%M)
DATA=~/data
""" + PPO + """ \\
    actor_rollout_ref.model.path=$MODEL_DIR/qwen \\
    trainer.experiment_name=grpo_${TS} \\
    trainer.project_name=`whoami` \\
    trainer.default_local_dir=$(pwd)/ckpts \\
    data.train_files=$DATA/train.parquet \\
    data.val_files=~/data/test.parquet
""")
    imp = import_config(str(p))
    c = imp.config
    assert (c["actor.model.path"], c["trainer.experiment_name"], c["trainer.project_name"]) == \
        ("${MODEL_DIR}/qwen", "grpo_$(date +%Y%m%d_%H%M)", "`whoami`")
    assert c["data.train_files"] == ["~/data/train.parquet"]  # (~ after `A=`: bash's tilde expansion)
    assert c["data.val_files"] == ["~/data/test.parquet"] and not any(n.startswith("data.val_files") for n in imp.notes)
    notes = "\n".join(imp.notes)
    for key, why in [("actor_rollout_ref.model.path", "MODEL_DIR is not set in the script"),
                     ("trainer.experiment_name", "`$(date +%Y%m%d_%H%M)` is a command, which fitrl does not run"),
                     ("trainer.project_name", "`whoami`"), ("trainer.default_local_dir", "`$(pwd)`"),
                     ("data.train_files", "`~` is a home folder")]:
        assert any(n.startswith(key + "=") and "left for you to set" in n and why in n for n in imp.notes), notes


def test_line_joins_comments_and_quoting(tmp_path):
    p = script(tmp_path, """
# a comment with an 'unbalanced quote
""" + PPO + """ \\
    trainer.project_name=pro\\
ject \\
    actor_rollout_ref.model.path=/m \\
    trainer.logger='["console",
      "wandb"]' \\
    trainer.experiment_name="a b"'c'\\"d \\
    data.truncation=left # a comment ending the command \\
    data.train_batch_size=7
""")
    a = args(p)
    assert a["trainer.project_name"] == "project"  # a join inside a word is no space
    assert a["trainer.logger"] == '["console",\n      "wandb"]' and a["trainer.experiment_name"] == 'a bc"d'
    assert a["data.truncation"] == "left" and "data.train_batch_size" not in a
    imp = import_config(str(p))
    assert imp.config["trainer.loggers"] == ["console", "wandb"]


@pytest.mark.parametrize("quote", ["'", '"', "$(", "${"])
def test_an_unclosed_quote_is_one_line(tmp_path, quote):
    p = script(tmp_path, f"{PPO} \\\n    trainer.project_name={quote}abc \\\n    data.train_batch_size=8\n")
    with pytest.raises(ConfigError, match=r"run.sh:4: .* opened here is never closed"):
        import_config(str(p))


@pytest.mark.parametrize("command", [
    "PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 python3 -m verl.trainer.main_ppo",
    "python verl/trainer/main_ppo.py",
    "python3 -u -m recipe.dapo.main_dapo",
    "python3 -m recipe.dapo.src.main_dapo",
    "torchrun --nproc_per_node=8 -m verl.trainer.main_ppo",
    'ray job submit --address="http://127.0.0.1:8265" --runtime-env=verl/trainer/runtime_env.yaml '
    "--no-wait -- python3 -m recipe.prime.main_prime",
    "nohup python3 -m verl.trainer.main_ppo",
])
def test_env_prefixed_wrapped_and_recipe_commands(tmp_path, command):
    p = script(tmp_path, "python3 examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k\n"
                         f"{command} \\\n    actor_rollout_ref.model.path=/m \\\n    data.train_batch_size=64 "
                         f"2>&1 | tee log.txt\n")
    launch = read_launch(p)
    assert [a.text for a in launch.args] == ["actor_rollout_ref.model.path=/m", "data.train_batch_size=64"]
    assert import_config(str(p)).config["data.rollout_batch_size"] == 64


def test_easyr1s_entry_point_and_a_generation_script(tmp_path):
    (tmp_path / "config.yaml").write_text("worker:\n  rollout:\n    n: 5\n")
    p = script(tmp_path, "python3 -m verl.trainer.main config=config.yaml worker.actor.model.model_path=/m\n")
    assert import_config(str(p)).config["rollout.n"] == 5
    gen = script(tmp_path, "python3 -m verl.trainer.main_generation data.path=/x model.path=/m\n", "gen.sh")
    with pytest.raises(ConfigError, match="gen.sh:3: verl.trainer.main_generation generates, it does not train"):
        import_config(str(gen))


def test_hydra_config_path_and_name_are_the_base(tmp_path):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "my_grpo.yaml").write_text("hydra:\n  searchpath: [file://verl/trainer/config]\n"
                                       "defaults:\n  - ppo_trainer\n  - _self_\n"
                                       "data:\n  train_batch_size: 64\n"
                                       "actor_rollout_ref:\n  rollout:\n    n: 4\n    temperature: 0.7\n")
    sub = tmp_path / "scripts"
    sub.mkdir()
    p = script(sub, 'PROJECT_DIR="$(pwd)"\n'
                    f'{PPO} --config-path="$PROJECT_DIR/conf" --config-name=my_grpo \\\n'
                    "    actor_rollout_ref.model.path=/m +actor_rollout_ref.rollout.n=8 "
                    "~actor_rollout_ref.rollout.temperature\n")
    imp = import_config(str(p))
    c = imp.config
    assert (c["data.rollout_batch_size"], c["rollout.n"]) == (64, 8)  # the YAML's, then the script's +key
    assert "rollout.temperature" not in c  # ~key: neither the YAML's 0.7 nor veRL's default
    notes = "\n".join(imp.notes)
    assert "my_grpo.yaml is the base" in notes and "`defaults`" in notes and "`$(pwd)`" in notes
    assert "~actor_rollout_ref.rollout.temperature: deleted" in notes
    missing = script(tmp_path, f"{PPO} --config-path conf --config-name nowhere actor_rollout_ref.model.path=/m\n",
                     "missing.sh")
    assert any("nowhere.yaml not found" in n for n in import_config(str(missing)).notes)
    own = script(tmp_path, f"{PPO} --config-name ppo_megatron_trainer actor_rollout_ref.model.path=/m\n", "own.sh")
    assert any("--config-name ppo_megatron_trainer" in n and "not read" in n for n in import_config(str(own)).notes)


def test_dollar_at_is_ignored_with_a_line(tmp_path):
    p = script(tmp_path, f'{PPO} actor_rollout_ref.model.path=/m "$@"\n')
    imp = import_config(str(p))
    assert [a.text for a in read_launch(p).args] == ["actor_rollout_ref.model.path=/m"]
    assert any(n.startswith("`$@`") and "not known here" in n for n in imp.notes)


def test_unquoted_expansions_split_as_bash_splits_them(tmp_path):
    p = script(tmp_path, 'files="[a, b]"\n'
                         f"{PPO} actor_rollout_ref.model.path=/m data.train_files=\"$files\" data.val_files=$files\n")
    launch = read_launch(p)
    assert [a.text for a in launch.args] == ["actor_rollout_ref.model.path=/m", "data.train_files=[a, b]",
                                            "data.val_files=[a,"]
    assert any("'b]'" in n and "not a key=value" in n for n in launch.notes)


def test_the_dapo_recipe_script(tmp_path):
    source = FOREIGN / "verl/recipe/dapo/test_dapo_7b.sh"  # ray job submit -- python3 -m recipe.dapo.src.main_dapo
    imp = import_config(str(source))
    c = imp.config
    assert (c["data.max_prompt_length"], c["rollout.max_response_length"]) == (2048, 2048)  # $((1024 * 2))
    assert (c["data.rollout_batch_size"], c["rollout.n"], c["actor.mini_batch_size"]) == (512, 16, 32)
    assert c["actor.micro_batch_token_budget"] == 4096  # $((max_prompt_length + max_response_length))
    assert c["actor.model.path"] == "${HOME}/verl/models/Qwen2.5-Math-7B"  # ${MODEL_PATH:-"${RAY_DATA_HOME}/..."}
    assert c["trainer.nnodes"] == 4 and c["trainer.experiment_name"] == "DAPO-Qwen2.5-7B-Math-Test"
    assert any(n.startswith("actor_rollout_ref.model.path=") and "HOME is not set" in n for n in imp.notes)
    out = tmp_path / "dapo.yaml"
    assert main(["import-config", str(source), "-o", str(out)]) == 0


def _cli(*argv: str, debug: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FITRL_DEBUG"}
    if debug:
        env["FITRL_DEBUG"] = "1"
    return subprocess.run([sys.executable, "-m", "fitrl.cli", "import-config", *argv], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)


def test_the_cli_stops_in_one_line_without_a_traceback(tmp_path):
    unset = script(tmp_path, f"{PPO} actor_rollout_ref.model.path=/m trainer.nnodes=$SLURM_JOB_NUM_NODES\n")
    r = _cli(str(unset))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "SLURM_JOB_NUM_NODES is not set in the script" in r.stderr
    assert "trainer.nnodes" in r.stderr
    quote = script(tmp_path, f"{PPO} actor_rollout_ref.model.path=/m trainer.logger='[\"console\"\n", "q.sh")
    r = _cli(str(quote))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "No closing quotation" not in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "never closed" in r.stderr
    assert "Traceback" in _cli(str(quote), debug=True).stderr  # FITRL_DEBUG shows where


def test_the_cli_reads_an_env_prefixed_recipe_command(tmp_path):
    p = script(tmp_path, "PYTHONUNBUFFERED=1 python3 -m recipe.dapo.main_dapo \\\n"
                         "    actor_rollout_ref.model.path=/m \\\n    data.max_prompt_length=$((1024 * 2)) \\\n"
                         "    trainer.experiment_name=run_$(date +%s)\n")
    out = tmp_path / "out.yaml"
    r = _cli(str(p), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "max_prompt_length: 2048" in out.read_text()
    assert "trainer.experiment_name=run_$(date +%s): left for you to set" in r.stderr
