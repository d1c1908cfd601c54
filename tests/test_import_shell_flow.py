"""`fitrl import-config` follows a launch script's control flow as bash would, without running it
(fitrl/config/shell.py, shell_flow.py, shell_eval.py, shell_expand.py, shell_launch.py): what a
test of a variable the script sets decides is taken, what only running would decide reads every
path and names the key it feeds. Every script here is a small synthetic one written for these
tests, one construct each."""

from __future__ import annotations

from pathlib import Path

import pytest

from fitrl.cli import main
from fitrl.config import ConfigError
from fitrl.config.importer import import_config
from fitrl.config.shell import read_launch

PPO = "python3 -m verl.trainer.main_ppo"


def script(tmp_path: Path, body: str, name: str = "run.sh") -> Path:
    """A synthetic launch script (not from any project): line 1 is the shebang, line 2 `set -e`."""
    path = tmp_path / name
    path.write_text("#!/bin/bash\nset -e\n" + body)
    return path


def args(path: Path) -> dict[str, str]:
    return dict(a.text.split("=", 1) for a in read_launch(path).args if "=" in a.text)


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# ---- if / elif / else ------------------------------------------------------------------------

def test_if_elif_else_is_decided_by_a_test_of_a_variable_the_script_sets(tmp_path):
    p = script(tmp_path, """
backend=fsdp
if [ "$backend" = megatron ]; then
    N=1
elif [[ $backend == fs* && -n "$backend" ]]; then
    N=2
else
    N=3
fi
if [ -z "$N_GPUS" ]; then N_GPUS=8; fi
""" + PPO + " actor_rollout_ref.model.path=/m actor_rollout_ref.rollout.n=$N trainer.n_gpus_per_node=$N_GPUS\n")
    launch = read_launch(p)
    assert args(p)["actor_rollout_ref.rollout.n"] == "2" and args(p)["trainer.n_gpus_per_node"] == "8"
    assert all(not a.unknown for a in launch.args)
    assert any(n.startswith("N_GPUS: not set in the script") for n in launch.notes)  # the script's default, said
    c = import_config(str(p)).config
    assert (c["rollout.n"], c["trainer.devices_per_node"]) == (2, 8)


@pytest.mark.parametrize("condition", ["[ -f /etc/fitrl_marker ]", '[ "$1" = big ]', "grep -q 8 /proc/cpuinfo"])
def test_a_branch_only_running_decides_reads_both_paths_and_names_the_key(tmp_path, condition):
    p = script(tmp_path, f"""
if {condition}; then
    N=8
    MODEL=/models/big
else
    N=4
    MODEL=/models/small
fi
SAME=/data/train.parquet
""" + PPO + " actor_rollout_ref.model.path=$MODEL actor_rollout_ref.rollout.n=$N data.train_files=$SAME\n")
    with pytest.raises(ConfigError) as e:
        import_config(str(p))
    text = one_line(e)
    assert "run.sh:12: actor_rollout_ref.rollout.n=" in text and f"`if {condition}` (line 4)" in text
    assert "give actor_rollout_ref.rollout.n=VALUE after the script" in text
    imp = import_config(str(p), ["actor_rollout_ref.rollout.n=8"])  # the user's value: no question left
    assert imp.config["rollout.n"] == 8 and imp.config["data.train_files"] == ["/data/train.parquet"]
    # a path set differently on the two paths is left for the user, with the condition named
    assert any(n.startswith("actor_rollout_ref.model.path=") and "left for you to set" in n
               and f"`if {condition}`" in n for n in imp.notes), imp.notes


def test_a_training_command_inside_an_unknown_branch_is_read_with_a_line(tmp_path):
    p = script(tmp_path, "if [ -d /mnt/ckpt ]; then\n    " + PPO + " actor_rollout_ref.model.path=/m\nfi\n")
    assert any("runs only as `if [ -d /mnt/ckpt ]` (line 3) decides" in n for n in read_launch(p).notes)
    q = script(tmp_path, "if [ -f x ]; then exit 1; fi\nN=3\n" + PPO + " actor_rollout_ref.rollout.n=$N\n", "q.sh")
    assert args(q)["actor_rollout_ref.rollout.n"] == "3"  # the path that exits ends there; the other goes on


# ---- loops, case, functions, && / || ----------------------------------------------------------

def test_for_loops_over_literal_words(tmp_path):
    p = script(tmp_path, """
for n in 2 4 8; do
    LAST=$n
done
for ((i = 0; i < 3; i++)); do COUNT=$i; done
for lr in 1e-6 5e-7; do
    """ + PPO + """ actor_rollout_ref.model.path=/m actor_rollout_ref.actor.optim.lr=$lr \\
        actor_rollout_ref.rollout.n=$LAST data.train_batch_size=$COUNT
done
""")
    a = args(p)
    assert (a["actor_rollout_ref.rollout.n"], a["data.train_batch_size"]) == ("8", "2")
    assert a["actor_rollout_ref.actor.optim.lr"] == "5e-7"  # the last run
    assert any("runs once per value of lr (1e-6 5e-7): read the last run, lr=5e-7" in n for n in read_launch(p).notes)
    loop = script(tmp_path, "for f in $(ls data); do N=$f; done\n" + PPO + " actor_rollout_ref.rollout.n=$N\n", "l.sh")
    with pytest.raises(ConfigError, match=r"l.sh:4: actor_rollout_ref.rollout.n=.*`for f in \$\(ls data\)` \(line 3\)"):
        import_config(str(loop))


def test_case_with_glob_patterns(tmp_path):
    p = script(tmp_path, """
model=Qwen2.5-7B-Instruct
case "$model" in
    *72B*) TP=8 ;;
    *7B*|*8B*) TP=2 ;;
    *) TP=1 ;;
esac
case abc in
    "a*") Q=quoted ;;
    a[a-c]?) Q=glob ;;
esac
""" + PPO + " actor_rollout_ref.model.path=/m actor_rollout_ref.rollout.tensor_model_parallel_size=$TP x.q=$Q\n")
    assert (args(p)["actor_rollout_ref.rollout.tensor_model_parallel_size"], args(p)["x.q"]) == ("2", "glob")
    assert import_config(str(p)).config["rollout.tensor_parallel_size"] == 2
    unknown = script(tmp_path, 'case "$1" in\n  big) TP=8 ;;\n  *) TP=1 ;;\nesac\n'
                     + PPO + " actor_rollout_ref.rollout.tensor_model_parallel_size=$TP\n", "u.sh")
    with pytest.raises(ConfigError, match=r'tensor_model_parallel_size=.*`case "\$1" in` \(line 3\)'):
        import_config(str(unknown))


def test_a_function_defines_variables_when_called(tmp_path):
    p = script(tmp_path, """
x=outer
setup() {
    local x=inner
    MODEL=/models/$1
    N=$((2 * 4))
    SEEN=$x
}
function train {
    """ + PPO + """ actor_rollout_ref.model.path=$MODEL actor_rollout_ref.rollout.n=$N x.a=$x x.b=$SEEN "$@"
}
setup qwen
train trainer.total_epochs=3
""")
    a = args(p)
    assert (a["actor_rollout_ref.model.path"], a["actor_rollout_ref.rollout.n"]) == ("/models/qwen", "8")
    assert (a["x.a"], a["x.b"], a["trainer.total_epochs"]) == ("outer", "inner", "3")  # `local` ends with the call
    assert not any("$@" in n for n in read_launch(p).notes)  # "$@" inside is the call's own, known, arguments
    passes = script(tmp_path, "main() {\n    " + PPO + ' actor_rollout_ref.model.path=/m "$@"\n}\nmain "$@"\n', "m.sh")
    assert any(n.startswith("`$@`") for n in read_launch(passes).notes)  # the script's own arguments, unknown


def test_and_or_lists(tmp_path):
    p = script(tmp_path, """
A=1
[ "$A" = 1 ] && N=7 || N=9
[ "$A" = 2 ] && M=7 || M=9
true && K=1
false || J=2
[ -d /data ] && ROOT=/data || ROOT=/scratch
""" + PPO + " actor_rollout_ref.model.path=/m x.n=$N x.m=$M x.k=$K x.j=$J data.train_files=$ROOT/t.parquet\n")
    a = args(p)
    assert (a["x.n"], a["x.m"], a["x.k"], a["x.j"]) == ("7", "9", "1", "2")
    imp = import_config(str(p))
    assert any(n.startswith("data.train_files=") and "`[ -d /data ]` (line 9)" in n for n in imp.notes), imp.notes


def test_a_sourced_file_beside_the_script_is_read_and_a_missing_one_said(tmp_path):
    (tmp_path / "common.sh").write_text("MODEL=/models/qwen\nN=$((2 + 3))\n")
    p = script(tmp_path, "source common.sh\n. ./missing.sh\n" + PPO
               + " actor_rollout_ref.model.path=$MODEL actor_rollout_ref.rollout.n=$N\n")
    assert (args(p)["actor_rollout_ref.model.path"], args(p)["actor_rollout_ref.rollout.n"]) == ("/models/qwen", "5")
    notes = read_launch(p).notes
    assert any(n.startswith("`source ./missing.sh` (line 4): not found beside the script") for n in notes)


# ---- expansions ----------------------------------------------------------------------------

def test_arithmetic_as_bash_computes_it(tmp_path):
    p = script(tmp_path, """
max_prompt_length=$((1024 * 2))
(( NODES = 2 * 2 ))
if (( NODES > 2 )); then BIG=yes; fi
i=3
""" + PPO + """ actor_rollout_ref.model.path=/m data.max_prompt_length=$max_prompt_length trainer.nnodes=$NODES \\
    x.post=$((i++)) x.after=$i x.hex=$((0x10)) x.base=$((2#101)) x.wrap=$((2**64)) x.minus=$((5--3)) x.big=$BIG
""")
    a = args(p)
    assert (a["data.max_prompt_length"], a["trainer.nnodes"], a["x.big"]) == ("2048", "4", "yes")
    assert (a["x.post"], a["x.after"], a["x.hex"], a["x.base"], a["x.wrap"], a["x.minus"]) == \
        ("3", "4", "16", "5", "0", "8")  # what bash prints for each
    assert import_config(str(p)).config["data.max_prompt_length"] == 2048


def test_an_unset_variable_is_named_as_unknown(tmp_path):
    p = script(tmp_path, PPO + " actor_rollout_ref.model.path=/m trainer.n_gpus_per_node=$((N_GPUS * 2)) \\\n"
                              "    trainer.nnodes=$NNODES\n")
    launch = read_launch(p)
    assert [a.text for a in launch.args][1] == "trainer.n_gpus_per_node=$((N_GPUS * 2))"  # one argument, not split
    with pytest.raises(ConfigError) as e:
        import_config(str(p))
    text = one_line(e)
    assert "run.sh:3: trainer.n_gpus_per_node=" in text and "N_GPUS is not set in the script" in text
    with pytest.raises(ConfigError, match=r"trainer.nnodes=\$\{NNODES\}: NNODES is not set in the script"):
        import_config(str(p), ["trainer.n_gpus_per_node=8"])


def test_nested_defaults(tmp_path):
    p = script(tmp_path, """
B=/models
A=${A:-"${B}/x"}
C=${C:-${UNSET_D:-/d}/y}
""" + PPO + ' actor_rollout_ref.model.path=$A critic.model.path="${C}"\n')
    assert (args(p)["actor_rollout_ref.model.path"], args(p)["critic.model.path"]) == ("/models/x", "/d/y")
    assert any(n.startswith("A, C, UNSET_D: not set in the script") for n in read_launch(p).notes)


def test_line_joins_and_multi_line_quotes(tmp_path):
    p = script(tmp_path, "LOGGER='[\"console\",\n    \"wandb\"]'\n" + PPO + " \\\n"
                         "    trainer.project_name=my\\\n_proj \\\n"
                         '    trainer.experiment_name="exp\\\n_one" \\\n'
                         "    actor_rollout_ref.model.path=/m \\\n"
                         '    trainer.logger="$LOGGER"\n')
    a = args(p)
    assert (a["trainer.project_name"], a["trainer.experiment_name"]) == ("my_proj", "exp_one")  # no space at a join
    assert a["trainer.logger"] == '["console",\n    "wandb"]'
    assert import_config(str(p)).config["trainer.loggers"] == ["console", "wandb"]


# ---- the training command -------------------------------------------------------------------

@pytest.mark.parametrize("command", ["PYTHONUNBUFFERED=1 python3 -m verl.trainer.main_ppo",
                                     "python3 -m recipe.dapo.main_dapo"])
def test_env_prefixed_and_recipe_commands(tmp_path, command):
    p = script(tmp_path, f"MAX=$((1024 * 2))\n{command} \\\n    actor_rollout_ref.model.path=/m \\\n"
                         "    data.max_prompt_length=$MAX\n")
    launch = read_launch(p)
    assert launch.entry == command.split()[-1] and launch.line == 4
    assert [a.text for a in launch.args] == ["actor_rollout_ref.model.path=/m", "data.max_prompt_length=2048"]
    assert import_config(str(p)).config["data.max_prompt_length"] == 2048


def test_commands_are_reported_as_unknown_not_copied(tmp_path):
    p = script(tmp_path, "TS=$(date +%Y%m%d)\n" + PPO + " actor_rollout_ref.model.path=/m \\\n"
                         "    trainer.experiment_name=run_${TS} trainer.default_local_dir=$(pwd)/ckpt\n")
    imp = import_config(str(p))
    for key, command in [("trainer.experiment_name", "$(date +%Y%m%d)"), ("trainer.default_local_dir", "$(pwd)")]:
        assert any(n.startswith(f"{key}=") and "left for you to set" in n
                   and f"`{command}` is a command, which fitrl does not run" in n for n in imp.notes), imp.notes
    setting = script(tmp_path, PPO + " actor_rollout_ref.model.path=/m data.train_batch_size=$(nproc)\n", "s.sh")
    with pytest.raises(ConfigError) as e:
        import_config(str(setting))
    assert "s.sh:3: data.train_batch_size=$(nproc): `$(nproc)` is a command" in one_line(e)


def test_hydra_options_deletions_and_dollar_at_each_have_a_line(tmp_path):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "base.yaml").write_text("data:\n  train_batch_size: 64\nactor_rollout_ref:\n  rollout:\n    n: 4\n")
    p = script(tmp_path, 'HERE=conf\nrun() {\n    ' + PPO + ' --config-path "$HERE" --config-name=base \\\n'
                         '        actor_rollout_ref.model.path=/m ~actor_rollout_ref.rollout.n "$@"\n}\nrun "$@"\n')
    imp = import_config(str(p))
    notes = "\n".join(imp.notes)
    assert "--config-name base:" in notes and "base.yaml is the base" in notes
    assert "~actor_rollout_ref.rollout.n: deleted" in notes and "rollout.n" not in imp.config
    assert "`$@`: the script passes on its own arguments" in notes
    assert imp.config["data.rollout_batch_size"] == 64
    bare = script(tmp_path, PPO + " actor_rollout_ref.model.path=/m --config-name\n", "bare.sh")
    assert any(n.startswith("--config-name without a value") for n in read_launch(bare).notes)


# ---- bad input: one line, never a traceback --------------------------------------------------

@pytest.mark.parametrize("body,where,says", [
    ("if true; then\n  N=1\n", 3, "`if` opened here has no `fi`"),
    ("for i in 1 2; do\n  N=1\n", 3, "`for` opened here has no `done`"),
    ("while true; do\n  N=1\n", 3, "`while` opened here has no `done`"),
    ("case x in\n  a) N=1 ;;\n", 3, "`case` opened here has no `esac`"),
    ("case\n", 3, "`case` without `WORD in`"),
    ("f() {\n  N=1\n", 3, "`{` opened here has no `}`"),
    ("fi\n", 3, "`fi` without what opens it"),
    ("N=$((1 + 2\n", 3, "never closed"),
    ("[[ -n x\n", 3, "[[ opened here is never closed"),
    ("f() { f; }\nf\n", 3, "f calls itself too deep"),
])
def test_bad_scripts_stop_in_one_line(tmp_path, body, where, says):
    p = script(tmp_path, body + PPO + " actor_rollout_ref.model.path=/m\n")
    with pytest.raises(ConfigError) as e:
        import_config(str(p))
    text = one_line(e)
    assert text.startswith(f"{p}:{where}: ") and says in text, text


@pytest.mark.parametrize("body", [
    "{ " * 3000 + "A=1" + "; }" * 3000 + "\n",  # nested deeper than Python's stack
    "for a in " + " ".join(["x"] * 64) + "; do for b in " + " ".join(["x"] * 64)
    + "; do for c in " + " ".join(["x"] * 64) + "; do :; done; done; done\n",  # 262,144 commands
])
def test_scripts_too_large_to_follow_stop_in_one_line(tmp_path, body):
    p = script(tmp_path, body + PPO + " actor_rollout_ref.model.path=/m\n")
    with pytest.raises(ConfigError) as e:
        import_config(str(p))
    assert str(p) in one_line(e)


@pytest.mark.parametrize("body", ["[[ abc =~ ( ]] && N=1\n", "[ abc -eq 3 ] && N=1\n", "[ -eq 3 ] && N=1\n",
                                  "N=$((2 ** -1))\n", "N=$((08))\n", "N=$((1 / 0))\n"])
def test_a_test_or_arithmetic_bash_refuses_leaves_the_value_unknown(tmp_path, body):
    p = script(tmp_path, body + PPO + " actor_rollout_ref.model.path=/m actor_rollout_ref.rollout.n=$N\n")
    with pytest.raises(ConfigError) as e:
        import_config(str(p))
    assert "actor_rollout_ref.rollout.n=" in one_line(e) and "give actor_rollout_ref.rollout.n=VALUE" in str(e.value)


def test_the_cli_exits_2_with_one_line(tmp_path, capsys):
    p = script(tmp_path, "if [ -f /x ]; then N=8; else N=4; fi\n" + PPO + " actor_rollout_ref.rollout.n=$N\n")
    assert main(["import-config", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and "actor_rollout_ref.rollout.n" in err
