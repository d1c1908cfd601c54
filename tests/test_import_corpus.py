"""The corpus: real launch scripts and configs nobody here wrote (tests/data/foreign/, each headed by
its repository, path and commit), run through what a user switching to fitrl runs:
``fitrl import-config SOURCE -o x.yaml`` then ``fitrl plan x.yaml`` (which loads it). Each input
either imports, loads and plans, or stops in one line naming what the user must supply (recorded in
:data:`CORPUS` with why), never a traceback; a stop at import is answered as its line says, and then
plans. A few keys per input are checked against what the source means (:data:`MEANS`), and no
dropped key of the corpus says "no fitrl key for it". The models named are planned from their
config.json alone (tests/data/foreign/models.json), in a Hugging Face cache of this module's own.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

import fitrl.rollout  # noqa: F401  (registers the engines: rollout.engine is checked on load)
from fitrl.cli import main
from fitrl.config import ConfigError
from fitrl.config.importer import import_config
from fitrl.core import hub
from helpers import ROOT, load_bench

FOREIGN = ROOT / "tests" / "data" / "foreign"
MODELS = {k: v for k, v in json.loads((FOREIGN / "models.json").read_text()).items() if not k.startswith("_")}
MODEL_KEYS = re.compile(r"(actor|critic|ref)\.model\.path|reward\.sources\.\w+\.model\.path")


@dataclass(frozen=True)
class Stops:
    """The input stops in one line at ``stage`` (``import`` or ``plan``), the line holding ``says``,
    because ``why``; ``answer`` (key=value after the source) is what the user then supplies."""
    stage: str
    says: str
    why: str
    answer: tuple[str, ...] = ()


PLANS = None
CORPUS: dict[str, Optional[Stops]] = {
    # veRL (volcengine/verl examples/ and recipe/)
    "verl/run_qwen2-7b.sh": PLANS,
    "verl/run_qwen2_5_vl-7b.sh": PLANS,
    "verl/run_qwen2_5-3b_gsm8k_grpo_lora.sh": PLANS,
    "verl/run_qwen2-7b_math_rf.sh": PLANS,
    "verl/run_qwen2-7b_seq_balance.sh": PLANS,
    "verl/recipe/dapo/test_dapo_7b.sh": PLANS,
    "verl/recipe/dapo/run_dapo_qwen2.5_32b.sh": PLANS,
    "verl/examples/ppo_trainer/run_deepseek7b_llm.sh": PLANS,
    "verl/examples/ppo_trainer/run_gemma.sh": Stops(
        "plan", "model_type 'gemma2' is not modelled",
        "Gemma 2 is not a model type fitrl runs (fitrl/core/model_types.py): the user must pick another model"),
    "verl/examples/ppo_trainer/run_qwen2-7b_rm_seq_balance.sh": PLANS,
    "verl/examples/ppo_trainer/run_deepseek_math_gsm8k_megatron.sh": PLANS,
    "verl/examples/grpo_trainer/run_qwen3-8b.sh": PLANS,
    "verl/examples/grpo_trainer/run_qwen2_5_vl-7b_lora.sh": PLANS,
    "verl/examples/grpo_trainer/run_mistral13b_skyworkrm_hhrlhf.sh": PLANS,
    "verl/examples/gspo_trainer/test_gspo_3b_math.sh": Stops(
        "import", "SLURM_JOB_NUM_NODES is not set in the script",
        "the node count comes from SLURM's environment, which only a running job has", ("trainer.nnodes=1",)),
    "verl/examples/rloo_trainer/run_qwen2-7b.sh": PLANS,
    "verl/examples/remax_trainer/run_qwen2.5-3b_seq_balance.sh": PLANS,
    "verl/examples/cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh": PLANS,
    "verl/examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh": PLANS,  # (verl-project/verl: OPD)
    "verl/examples/sapo_trainer/run_qwen30b_sapo.sh": Stops(
        "import", "SLURM_GPUS_PER_NODE is not set in the script",
        "the devices per node come from SLURM's environment (and the nodes too)",
        ("trainer.n_gpus_per_node=8", "trainer.nnodes=1")),
    "verl/examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh": PLANS,
    "verl/examples/sglang_multiturn/config/gsm8k_multiturn_grpo.yaml": Stops(
        "plan", "actor.model.path is empty",
        "a Hydra base config, whose model the script that names it sets (run_qwen2.5-3b_gsm8k_multiturn.sh)"),
    "verl/examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml": Stops(
        "import", "cannot tell the source's framework",
        "a list of veRL tool classes, not a training config: nothing to import"),
    # EasyR1 (hiyouga/EasyR1 examples/), today's and 0.2's
    "easyr1/examples/config.yaml": PLANS,
    "easyr1/examples/qwen2_5_7b_math_grpo.sh": PLANS,
    "easyr1/examples/qwen2_5_vl_7b_geo3k_grpo.sh": PLANS,
    "easyr1/examples/qwen3_4b_math_grpo_lora.sh": PLANS,
    "easyr1/examples/qwen2_5_vl_3b_geo3k_grpo.sh": PLANS,
    "easyr1/examples/qwen2_5_vl_32b_geo3k_grpo.sh": PLANS,
    "easyr1/examples/qwen3_14b_dapo17k_dapo.sh": PLANS,
    "easyr1/examples/qwen2_5_vl_7b_geo3k_gspo.sh": PLANS,
    "easyr1/examples/qwen2_5_vl_7b_geo3k_reinforce.sh": PLANS,
    "easyr1/examples/qwen2_5_vl_7b_geo3k_cispo.sh": PLANS,
    "easyr1/examples/baselines/qwen2_5_vl_3b_clevr.sh": PLANS,
    "easyr1/examples/qwen3_vl_4b_geo3k_grpo_lora.sh": PLANS,
    "easyr1/examples/qwen3_vl_30b_geo3k_grpo.sh": Stops(
        "plan", "model_type 'qwen3_vl_moe' is not modelled",
        "Qwen3-VL-30B-A3B is a mixture-of-experts VL model, a model type fitrl does not run yet"),
    "easyr1-0e6ef63/examples/config.yaml": PLANS,
    "easyr1-0e6ef63/examples/qwen2_5_7b_math.sh": PLANS,
    # projects built on them
    "search-r1/train_ppo.sh": PLANS,
    "simplerl-reason/train_grpo_math_tune_ray.sh": Stops(
        "import", "trainer.nnodes=TO_BE_FILLED",
        "the script leaves its node count (and paths) as TO_BE_FILLED placeholders", ("trainer.nnodes=2",)),
}
"""Every stored input (a launch script, or a config a script names) and what it does: PLANS, or its stop."""

MEANS: dict[str, dict[str, object]] = {  # source -> fitrl key -> what the source's setting means in fitrl
    "verl/run_qwen2_5_vl-7b.sh": {"rollout.n": 5, "algorithm.kl_coef": 0.01, "actor.mini_batch_size": 128},
    "verl/run_qwen2-7b_math_rf.sh": {"algorithm.adv_estimator": "reinforce_plus_plus", "algorithm.use_kl_loss": False,
                                     "algorithm.kl_in_reward.enable": True, "rollout.n": 8},
    "verl/recipe/dapo/test_dapo_7b.sh": {"algorithm.loss_agg_mode": "token-mean", "algorithm.overlong.enable": True,
                                         "algorithm.overlong.buffer_length": 512, "actor.clip_ratio_high": 0.28},
    "verl/recipe/dapo/run_dapo_qwen2.5_32b.sh": {
        "rollout.n": 16, "data.rollout_batch_size": 512, "actor.mini_batch_size": 32, "actor.clip_ratio_high": 0.28,
        "rollout.max_response_length": 20480, "algorithm.filter_groups.enable": True, "actor.ulysses_size": 8,
        "actor.optim.weight_decay": 0.1, "actor.optim.warmup_steps": 10, "algorithm.overlong.buffer_length": 4096,
        "actor.fsdp.strategy": "full", "trainer.nnodes": 16},
    "verl/examples/ppo_trainer/run_deepseek7b_llm.sh": {
        "algorithm.adv_estimator": "gae", "critic.optim.lr": 1e-5, "critic.micro_batch_size": 32,
        "critic.mini_batch_size": 256, "rollout.tensor_parallel_size": 4, "rollout.gpu_memory_utilization": 0.4,
        "actor.fsdp.mixed_precision": True, "critic.fsdp.mixed_precision": True},
    "verl/examples/ppo_trainer/run_gemma.sh": {"data.rollout_batch_size": 512, "trainer.devices_per_node": 2,
                                               "actor.packing": False, "critic.model.gradient_checkpointing": False},
    "verl/examples/ppo_trainer/run_qwen2-7b_rm_seq_balance.sh": {
        "reward.sources.rm.kind": "model", "reward.sources.rm.model.path": "sfairXC/FsfairX-LLaMA3-RM-v0.1",
        "actor.micro_batch_token_budget": 24000, "data.max_prompt_length": 4096, "critic.mini_batch_size": 512},
    "verl/examples/ppo_trainer/run_deepseek_math_gsm8k_megatron.sh": {"actor.micro_batch_size": 4,
                                                                      "critic.optim.lr": 1e-5},
    "verl/examples/grpo_trainer/run_qwen3-8b.sh": {
        "actor.model.path": "Qwen/Qwen3-8B", "rollout.n": 5, "algorithm.use_kl_loss": True,
        "algorithm.kl_estimator": "low_var_kl", "actor.entropy_coeff": 0, "actor.micro_batch_size": 32},
    "verl/examples/grpo_trainer/run_qwen2_5_vl-7b_lora.sh": {
        "actor.lora.rank": 64, "actor.lora.alpha": 32, "actor.optim.lr": 3e-6, "rollout.sleep_level": 0},
    "verl/examples/grpo_trainer/run_mistral13b_skyworkrm_hhrlhf.sh": {
        "reward.sources.rm.model.path": "Skywork/Skywork-Reward-Llama-3.1-8B", "rollout.tensor_parallel_size": 4,
        "data.max_prompt_length": 4096, "rollout.max_response_length": 2048, "algorithm.use_kl_loss": False},
    "verl/examples/gspo_trainer/test_gspo_3b_math.sh": {
        "algorithm.policy_loss": "gspo", "actor.clip_ratio_low": 0.0003, "actor.clip_ratio_high": 0.0004,
        "algorithm.loss_agg_mode": "seq-mean-token-mean", "actor.optim.weight_decay": 0.1,
        "actor.optim.warmup_steps": 25, "actor.micro_batch_token_budget": 20480, "rollout.n": 16},
    "verl/examples/rloo_trainer/run_qwen2-7b.sh": {
        "algorithm.adv_estimator": "rloo", "algorithm.kl_in_reward.enable": True,
        "algorithm.kl_in_reward.estimator": "k1", "algorithm.kl_in_reward.coef": 0.001, "actor.micro_batch_size": 80},
    "verl/examples/remax_trainer/run_qwen2.5-3b_seq_balance.sh": {
        "algorithm.adv_estimator": "remax", "actor.micro_batch_token_budget": 30000, "rollout.n": 4,
        "algorithm.kl_in_reward.enable": True},
    "verl/examples/cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh": {
        "algorithm.policy_loss": "cispo", "actor.clip_ratio_high": 0.2, "trainer.devices_per_node": 1,
        "algorithm.kl_coef": 0.001},
    "verl/examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh": {  # pure PG distillation, one sample
        "algorithm.distill.weight": 1.0, "algorithm.distill.loss": "reverse_kl", "algorithm.distill.top_k": "(unset)",
        "teacher.model.path": "Qwen/Qwen3-32B", "rollout.n": 1, "actor.router_aux_loss_coef": 0.0},
    "verl/examples/sapo_trainer/run_qwen30b_sapo.sh": {
        "actor.model.path": "Qwen/Qwen3-30B-A3B-Base", "rollout.n": 16, "actor.micro_batch_token_budget": 30720,
        "algorithm.overlong.enable": True, "algorithm.overlong.buffer_length": 4096, "actor.ulysses_size": 4},
    "verl/examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh": {
        "rollout.engine": "vllm", "rollout.n": 16, "rollout.agent.env": "tools", "rollout.agent.max_turns": 5,
        "rollout.mode": "sync", "data.rollout_batch_size": 256},
    "verl/examples/sglang_multiturn/config/gsm8k_multiturn_grpo.yaml": {"rollout.agent.max_turns": 5,
                                                                        "data.rollout_batch_size": 256},
    "easyr1/examples/qwen2_5_vl_32b_geo3k_grpo.sh": {"rollout.tensor_parallel_size": 8, "actor.clip_ratio_high": 0.3,
                                                     "algorithm.kl_coef": 0.01, "rollout.engine": "vllm"},
    "easyr1/examples/qwen3_14b_dapo17k_dapo.sh": {
        "algorithm.use_kl_loss": False, "algorithm.kl_in_reward.enable": False, "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.metric": "accuracy", "rollout.val.n": 16, "rollout.val.top_p": 0.7,
        "actor.clip_ratio_c": 10.0, "algorithm.overlong.buffer_length": 4096, "actor.optim.warmup_steps": 10},
    "easyr1/examples/qwen2_5_vl_7b_geo3k_gspo.sh": {"algorithm.policy_loss": "gspo", "actor.clip_ratio_low": 3e-4,
                                                    "algorithm.loss_agg_mode": "seq-mean-token-mean",
                                                    "algorithm.use_kl_loss": False},
    "easyr1/examples/qwen2_5_vl_7b_geo3k_reinforce.sh": {
        "algorithm.adv_estimator": "reinforce_plus_plus", "algorithm.use_kl_loss": False,
        "algorithm.kl_in_reward.enable": True, "algorithm.kl_in_reward.estimator": "k1",
        "algorithm.kl_in_reward.coef": 1e-3},
    "easyr1/examples/qwen2_5_vl_7b_geo3k_cispo.sh": {"algorithm.policy_loss": "cispo", "actor.clip_ratio_high": 4},
    "easyr1/examples/baselines/qwen2_5_vl_3b_clevr.sh": {"reward.function": "r1v", "rollout.tensor_parallel_size": 1,
                                                         "data.train_files": ["BUAADreamer/clevr_count_70k@train"]},
    "easyr1/examples/qwen3_vl_4b_geo3k_grpo_lora.sh": {"actor.lora.rank": 64, "actor.lora.alpha": 64,
                                                       "actor.optim.lr": 1e-5},
    "easyr1-0e6ef63/examples/qwen2_5_7b_math.sh": {  # 0.2's KL is in the loss, under worker.actor
        "algorithm.use_kl_loss": True, "algorithm.kl_in_reward.enable": False, "algorithm.kl_coef": 0.01,
        "algorithm.kl_estimator": "low_var_kl", "actor.clip_ratio_low": 0.2, "actor.clip_ratio_high": 0.2,
        "actor.entropy_coeff": 1e-3, "rollout.n": 5, "trainer.devices_per_node": 4, "reward.function": "math",
        "rollout.gpu_memory_utilization": 0.5},
    "easyr1-0e6ef63/examples/config.yaml": {"algorithm.use_kl_loss": True,  # 0.2 had no dynamic batching
                                            "actor.micro_batch_token_budget": "(unset)"},
    "search-r1/train_ppo.sh": {"algorithm.adv_estimator": "gae", "rollout.n": 1, "critic.micro_batch_size": 1,
                               "actor.micro_batch_size": 8, "critic.optim.warmup_steps": 15, "data.shuffle": True,
                               "trainer.val_only": False},
    "simplerl-reason/train_grpo_math_tune_ray.sh": {
        "actor.optim.lr": 5e-7, "actor.clip_ratio_low": 0.2, "actor.entropy_coeff": 0.001, "rollout.n": 8,
        "actor.logprob_micro_batch_size": 10, "trainer.nnodes": 2},
}
"""Stops are checked with their answer given."""

DROPPED_FOR_NO_KEY: set[str] = set()
"""Corpus keys whose only reason is "no fitrl key for it" (each fitrl setting a key means is mapped)."""


def inputs() -> list[str]:
    files = [*FOREIGN.rglob("*.sh"), *FOREIGN.rglob("*.yaml")]
    return sorted(str(p.relative_to(FOREIGN)) for p in files if "defaults" not in p.relative_to(FOREIGN).parts)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """Every model of the corpus by its Hub id in a cache of this module's own (offline), and the
    ones a script names by a local path as directories beside it."""
    root = tmp_path_factory.mktemp("models")
    env = {"HF_HOME": str(root / "hf-home"), "HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1"}
    saved = {k: os.environ.get(k) for k in (*env, "HF_TOKEN", "HUGGINGFACE_HUB_CACHE")}
    os.environ.update(env)
    for k in ("HF_TOKEN", "HUGGINGFACE_HUB_CACHE"):
        os.environ.pop(k, None)
    for name, model in MODELS.items():
        if "/" in name:
            hub.cache_repo(name, {"config.json": json.dumps(model["config"])})
        else:
            (root / name).mkdir()
            (root / name / "config.json").write_text(json.dumps(model["config"]))
    yield root
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    def this_host_only(host, *args, **kwargs):
        raise socket.gaierror(f"no network in tests/test_import_corpus.py ({host})")
    monkeypatch.setattr(socket, "getaddrinfo", this_host_only)


def _local_models(config: dict, root: Path) -> list[str]:
    """A model a script names by a local path (``${HOME}/verl/models/Qwen2.5-32B``): the corpus's
    copy of that model's config.json, as the user's directory."""
    return [f"{k}={root / Path(v).name}" for k, v in config.items() if MODEL_KEYS.fullmatch(k)
            and isinstance(v, str) and v not in MODELS and Path(v).name in MODELS]


def _one_line(rc: int, err: str, says: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("fitrl: ") and says in lines[0], err


def test_every_stored_input_has_its_expectation():
    assert inputs() == sorted(CORPUS), "a new input under tests/data/foreign/ needs its line in CORPUS (or a stale one)"
    assert set(MEANS) <= set(CORPUS)
    for source in CORPUS:
        head = (FOREIGN / source).read_text().splitlines()[0]
        assert re.match(r"# (from )?[\w-]+/[\w.-]+ \S+ at [0-9a-f]{40} ", head), (source, head)


@pytest.mark.parametrize("source", sorted(CORPUS))
def test_each_input_imports_loads_and_plans_or_stops_in_one_line(source, models, tmp_path, capsys):
    stop, out = CORPUS[source], tmp_path / "imported.yaml"
    rc = main(["import-config", str(FOREIGN / source), "-o", str(out)])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    if stop is not None and stop.stage == "import":
        _one_line(rc, err, stop.says)
        if not stop.answer:
            return
        rc = main(["import-config", str(FOREIGN / source), *stop.answer, "-o", str(out)])  # answered as it says
        err = capsys.readouterr().err
    assert rc == 0 and out.is_file(), err
    imported = import_config(str(FOREIGN / source), list(stop.answer if stop else ()))
    rc = main(["plan", str(out), *_local_models(imported.config, models), "--no-recommend",
               "--device", "cuda", "--gpu-memory", "80GiB"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "internal error" not in captured.err, captured.err
    if stop is not None and stop.stage == "plan":
        _one_line(rc, captured.err, stop.says)
    else:  # (1: planned, and it does not fit)
        assert rc in (0, 1) and re.search(r"\b(fits|tight|does not fit)\b", captured.out), captured.out + captured.err


@pytest.mark.parametrize("source", sorted(MEANS))
def test_keys_mean_what_they_meant_in_the_source(source):
    stop = CORPUS[source]
    imported = import_config(str(FOREIGN / source), list(stop.answer if stop else ()))
    got = {k: imported.config.get(k, "(unset)") for k in MEANS[source]}
    assert got == MEANS[source]


@pytest.mark.parametrize("source", sorted(CORPUS))
def test_no_key_is_dropped_for_a_false_reason(source):
    stop = CORPUS[source]
    if stop is not None and stop.stage == "import" and not stop.answer:
        return
    imported = import_config(str(FOREIGN / source), list(stop.answer if stop else ()))
    for status, key, why in imported.lines:
        name = key.split("=")[0]
        assert why != "no fitrl key for it" or name in DROPPED_FOR_NO_KEY, key
        assert "not built yet" not in why, key


def test_a_relative_config_is_read_from_the_repository_the_script_runs_from(tmp_path, monkeypatch, capsys):
    """EasyR1 0.2's script says ``config=examples/config.yaml``, relative to the repository root its
    scripts run from. From a folder whose examples/config.yaml is another (today's EasyR1's), the
    import still reads the script's own repository's, and says where it read it and why."""
    script = FOREIGN / "easyr1-0e6ef63" / "examples" / "qwen2_5_7b_math.sh"
    monkeypatch.chdir(FOREIGN / "easyr1")
    imp = import_config(str(script))
    assert (imp.config["algorithm.kl_coef"], imp.config["rollout.gpu_memory_utilization"]) == (0.01, 0.5)  # 0.2's
    note = next(n for n in imp.notes if n.startswith("examples/config.yaml: "))
    assert f"read from {FOREIGN / 'easyr1-0e6ef63'}, the folder the source runs from" in note
    assert main(["import-config", str(script), "-o", str(tmp_path / "x.yaml")]) == 0
    assert "read from" in next(line for line in capsys.readouterr().err.splitlines() if "examples/config.yaml:" in line)
    # today's EasyR1 script's prompt template, relative to its repository too, from anywhere
    monkeypatch.chdir(tmp_path)
    geo = import_config(str(FOREIGN / "easyr1" / "examples" / "qwen2_5_vl_7b_geo3k_grpo.sh"))
    assert geo.config["data.prompt_template"].startswith("{{ problem | trim }} You FIRST think")
    assert any(n.startswith("./examples/format_prompt/math.jinja: ") and "read from" in n for n in geo.notes)
    # a script no folder above holds the file for: the current directory's, said so; else one line
    (tmp_path / "run.sh").write_text("python3 -m verl.trainer.main config=examples/config.yaml worker.rollout.n=4\n")
    monkeypatch.chdir(FOREIGN / "easyr1")
    here = import_config(str(tmp_path / "run.sh"))
    assert any("from the current directory" in n for n in here.notes) and here.config["rollout.n"] == 4
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"config=examples/config.yaml not found .*then in the current directory"):
        import_config(str(tmp_path / "run.sh"))


def test_a_hydra_config_path_is_found_from_the_folder_the_script_runs_from():
    """veRL's multi-turn script: ``--config-path="$PROJECT_DIR/examples/sglang_multiturn/config"`` with
    ``PROJECT_DIR=$(pwd)``, the repository root it says to run from; its base config's keys apply
    under the script's, and the output says which file and how it was found."""
    imp = import_config(str(FOREIGN / "verl/examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh"))
    base = FOREIGN / "verl" / "examples" / "sglang_multiturn" / "config" / "gsm8k_multiturn_grpo.yaml"
    note = next(n for n in imp.notes if n.startswith("--config-name gsm8k_multiturn_grpo: "))
    assert str(base) in note and f"relative to {FOREIGN / 'verl'}, the folder the script runs from" in note
    assert imp.config["rollout.agent.max_turns"] == 5  # from the base config alone
    megatron = import_config(str(FOREIGN / "verl/examples/ppo_trainer/run_deepseek_math_gsm8k_megatron.sh"))
    assert any("veRL's own ppo_megatron_trainer.yaml" in n and "FSDP" in n for n in megatron.notes)


def test_the_switching_doc_s_defaults_tables_are_what_the_code_does():
    """docs/switching.md's tables of each defaults layer and of what is approximated are what
    bench/switching_table.py writes from the importer today (every layer, each of its keys)."""
    table = load_bench("switching_table")
    doc = table.DOC.read_text()
    assert table.splice(doc, table.render()) == doc, \
        "docs/switching.md's defaults section is stale: run .venv/bin/python bench/switching_table.py"
    section = doc.split(table.BEGIN)[1].split(table.END)[0]
    for name, layer in table.DEFAULTS.items():
        assert f"**{table.SOURCE_NAMES[name]}'s defaults layer**" in section
        for key in layer:
            assert f"| `{key} = " in section, key


FOUND = [  # (source keys, fitrl key -> value): what the corpus found dropped for a false reason, or missing
    (["actor_rollout_ref.model.use_rmpad=false", "data.shuffle_train_dataloader=false"],
     {"actor.packing": False, "data.shuffle": False}),  # older veRL's names
    (["actor_rollout_ref.actor.use_token_level_loss=true", "custom_reward_function.overlong_buffer.enable=true",
      "custom_reward_function.overlong_buffer.len=512"],
     {"algorithm.loss_agg_mode": "token-mean", "algorithm.overlong.enable": True,
      "algorithm.overlong.buffer_length": 512}),
    (["+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
      "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4096",
      "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5"],
     {"algorithm.overlong.enable": True, "algorithm.overlong.buffer_length": 4096,
      "algorithm.overlong.penalty_factor": 0.5}),  # the dapo reward manager's kwargs
    (["trainer.val_only=true", "trainer.resume_mode=disable", "trainer.remove_previous_ckpt_in_save=true"],
     {"trainer.val_only": True, "checkpoint.resume": "never", "checkpoint.save_limit": 1}),
    (["critic.optim.lr_warmup_steps_ratio=0.1", "trainer.total_training_steps=200", "critic.optim.clip_grad=0.5",
      "actor_rollout_ref.actor.optim.clip_grad=0.7"],
     {"critic.optim.warmup_steps": 20, "critic.optim.grad_clip": 0.5, "actor.optim.grad_clip": 0.7}),
    (["actor_rollout_ref.actor.fsdp_config.fsdp_size=8", "trainer.n_gpus_per_node=8", "trainer.nnodes=2"],
     {"actor.fsdp.strategy": "hybrid"}),
    (["actor_rollout_ref.rollout.ignore_eos=true", "actor_rollout_ref.rollout.do_sample=false",
      "actor_rollout_ref.rollout.name=sglang"],
     {"rollout.ignore_eos": True, "rollout.temperature": 0.0, "rollout.engine": "vllm"}),
    (["algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold=3.0"],
     {"algorithm.rollout_correction.mode": "sequence", "algorithm.rollout_correction.cap": 3.0}),
    (["actor_rollout_ref.actor.tis_imp_ratio_cap=2.0"],
     {"algorithm.rollout_correction.mode": "token", "algorithm.rollout_correction.cap": 2.0}),
    (["custom_reward_function.path=my_reward.py", "custom_reward_function.reward_kwargs.scale=2"],
     {"reward.function": "my_reward.py:compute_score", "reward.kwargs.scale": 2}),
    (["actor_rollout_ref.rollout.n_agent=5"], {"rollout.n": 5}),  # Search-R1's samples per prompt
]


@pytest.mark.parametrize("overrides,expected", FOUND, ids=[f[0][0] for f in FOUND])
def test_keys_the_corpus_found_reach_fitrl_s_settings(overrides, expected):
    imp = import_config(None, ["actor_rollout_ref.model.path=/m", *overrides], fmt="verl")
    assert {k: imp.config.get(k) for k in expected} == expected
    for status, key, why in imp.lines:
        assert why != "no fitrl key for it", key


def test_what_fitrl_does_instead_is_the_reason_a_key_is_dropped():
    imp = import_config(None, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.megatron.pipeline_model_"
                               "parallel_size=2", "reward_model.use_reward_loop=true", "reward_model.rollout.name=vllm",
                               "actor_rollout_ref.actor.fsdp_config.grad_offload=true", "global_profiler.tool=nsys",
                               "actor_rollout_ref.rollout.name=sglang"], fmt="verl")
    seen = {key.split("=")[0]: (status, why) for status, key, why in imp.lines}
    assert "FSDP2" in seen["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"][1]
    assert "reward.sources.rm" in seen["reward_model.use_reward_loop"][1] == seen["reward_model.rollout.name"][1]
    assert "cpu_offload" in seen["actor_rollout_ref.actor.fsdp_config.grad_offload"][1]
    assert seen["actor_rollout_ref.rollout.name"] == ("approximated", "rollout.engine=vllm: fitrl's engines are hf "
                                                                      "and vllm: SGLang runs as vllm")
    old = import_config(None, ["worker.actor.model.model_path=/m", "worker.rollout.n=4", "worker.actor.clip_ratio=0.1",
                               "worker.actor.ulysses_sequence_parallel_size=2", "trainer.remove_previous_ckpt=true",
                               "worker.rollout.ignore_eos=true"]).config
    assert (old["actor.clip_ratio_low"], old["actor.clip_ratio_high"], old["actor.ulysses_size"],
            old["checkpoint.save_limit"], old["rollout.ignore_eos"]) == (0.1, 0.1, 2, 1, True)


def test_a_placeholder_where_a_number_goes_is_one_line(tmp_path, capsys):
    script = tmp_path / "run.sh"
    script.write_text("N=TO_BE_FILLED\npython3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=/m "
                      "trainer.n_gpus_per_node=$N\n")
    assert main(["import-config", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    assert "trainer.n_gpus_per_node=TO_BE_FILLED: not a value this key takes" in err
    assert "give trainer.n_gpus_per_node=VALUE" in err
    assert main(["import-config", str(script), "trainer.n_gpus_per_node=4", "-o", str(tmp_path / "x.yaml")]) == 0
