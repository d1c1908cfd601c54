"""Models and datasets named by Hugging Face Hub ids (fitrl/core/hub.py, fitrl/models/hub.py,
fitrl/data/hub.py; docs/hub.md), resolved from a cache each test builds in the hub's own layout
(:func:`fitrl.core.hub.cache_repo`) under ``HF_HUB_OFFLINE=1``, with no host but this one
resolvable: nothing here reaches a network."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fitrl.core import hub
from fitrl.core.errors import DataError, ModelDirError
from fitrl.data.hub import parse_dataset_ref
from helpers import DATA, EXAMPLE, ROOT, read_metrics, toy_config

MODEL = "tiny-org/tiny-qwen2"
STORY_MODELS = ROOT / "examples" / "failure_stories" / "models"
ARITH_DATA = {"train.jsonl": DATA / "arith_train.jsonl", "test.jsonl": DATA / "arith_val.jsonl"}
SHORT = ["trainer.val_before_train=false", "data.val_files=[]", "rollout.n=2", "actor.mini_batch_size=4",
         "actor.micro_batch_size=4", "checkpoint.save_freq=1", "trainer.progress_bar=false", "memory.plan=off"]
_getaddrinfo = socket.getaddrinfo


def _this_host_only(host, *args, **kwargs):
    if host not in (None, "localhost", "127.0.0.1", "::1"):
        raise socket.gaierror(socket.EAI_NONAME, f"tests/test_hub.py resolves no host ({host})")
    return _getaddrinfo(host, *args, **kwargs)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache of this test's own, offline, without a token."""
    for name in ("HF_TOKEN", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_OFFLINE",
                 "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket, "getaddrinfo", _this_host_only)
    return tmp_path / "hub"


@pytest.fixture
def hub_model(tiny_model_dir) -> hub.Snapshot:
    """The tiny model as ``tiny-org/tiny-qwen2`` in the cache, ``main`` naming its commit."""
    return hub.cache_repo(MODEL, {p.name: p for p in Path(tiny_model_dir).iterdir() if p.is_file()})


def _one_line(err: str, kind: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fitrl: {kind}: ") and "Traceback" not in err, err
    return lines[0]


def test_a_hub_id_is_org_name_at_a_revision_and_never_a_local_path(tmp_path, monkeypatch):
    from fitrl.models.config_json import check_path

    monkeypatch.chdir(tmp_path)
    assert hub.parse_model_ref("Qwen/Qwen2.5-7B-Instruct") == hub.HubRef("Qwen/Qwen2.5-7B-Instruct")
    assert hub.parse_model_ref("Qwen/Qwen2.5-7B-Instruct@v1.0") == hub.HubRef("Qwen/Qwen2.5-7B-Instruct", "v1.0")
    for local in ("/models/Qwen2.5-7B", "./org/name", "a/b/c", "org/name@", "org--x/name", "org/name.git", ""):
        assert hub.parse_model_ref(local) is None, local
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub.parse_model_ref("org/name") is None  # it exists here: the local directory
    (tmp_path / "models").mkdir()
    assert hub.parse_model_ref("models/qwen") is None  # a misspelt path beside models/, and said so
    with pytest.raises(ModelDirError, match=r"actor.model.path='models/qwen' does not exist .*org/name@revision"):
        check_path("models/qwen", "actor.model.path")

    ref = parse_dataset_ref("openai/gsm8k:main@test")
    assert (ref.repo, ref.config, ref.split, ref.name) == (hub.HubRef("openai/gsm8k", None, "dataset"), "main",
                                                           "test", "openai/gsm8k:main@test")
    assert parse_dataset_ref("hiyouga/math12k").split == "train"
    assert parse_dataset_ref("hiyouga/math12k@train[:100]").split == "train[:100]"
    for local in ("data/train.jsonl", "org/name:@train", "models/qwen", "org/name"):
        assert parse_dataset_ref(local) is None, local


def test_plan_of_a_hub_id_reads_its_config_json_alone(cache, capsys, monkeypatch):
    """The flagship 7B VL config planned by its Hub ids with nothing but config.json in the cache
    (no weights, no tokenizer, no processor) plans as its local config-only copy does."""
    from fitrl.cli import main

    monkeypatch.chdir(ROOT)
    local = STORY_MODELS / "qwen2.5-vl-7b-instruct"
    snap = hub.cache_repo("Qwen/Qwen2.5-VL-7B-Instruct", {"config.json": local / "config.json"})
    config = str(ROOT / "examples" / "geo3k_qwen2_5_vl_7b.yaml")
    outs = []
    for model in ("Qwen/Qwen2.5-VL-7B-Instruct", local):
        assert main(["plan", config, f"actor.model.path={model}", f"ref.model.path={model}", "--no-recommend"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and "fits, peaks taken at the top of the plan's band" in outs[0]
    assert sorted(p.name for p in snap.path.iterdir()) == ["config.json"]


def test_plan_samples_prompt_lengths_with_the_cached_tokenizer(hub_model, capsys, monkeypatch):
    from fitrl.cli import main

    monkeypatch.chdir(ROOT)
    weights = hub_model.path / "model.safetensors"
    weights.unlink()  # what the plan never reads
    assert main(["plan", EXAMPLE, f"actor.model.path={MODEL}", "--no-recommend"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "qwen2 156K params" in out and "prompt 25 (the longest of 80 prompts read from" in out


@pytest.fixture
def opened(hub_model):
    """A function giving the names (in the snapshot) of ``hub_model``'s files opened since its last
    call, by anything in any process (Python, safetensors' Rust, a subprocess): the kernel's own
    record (inotify's ``IN_OPEN`` on the cache's ``blobs/``, where every link of the snapshot
    leads). The weight file is made unreadable too (for a user other than root)."""
    import ctypes
    import os
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "inotify_init1"):
        pytest.skip("needs Linux's inotify")
    blobs = {os.path.basename(os.path.realpath(p)): p.name for p in hub_model.path.iterdir()}  # sha256 -> name
    weights = os.path.realpath(hub_model.path / "model.safetensors")
    os.chmod(weights, 0)
    fd, in_open = libc.inotify_init1(os.O_NONBLOCK), 0x20
    assert fd >= 0 and libc.inotify_add_watch(fd, os.path.dirname(weights).encode(), in_open) >= 0

    def names() -> list[str]:
        found = []
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                return found
            i = 0
            while i < len(data):  # struct inotify_event: int wd; uint32 mask, cookie, len; char name[len]
                _, _, _, size = struct.unpack_from("iIII", data, i)
                found.append(blobs[data[i + 16:i + 16 + size].rstrip(b"\0").decode()])
                i += 16 + size

    yield names
    os.close(fd)
    os.chmod(weights, 0o644)


def test_the_plan_opens_config_json_and_the_tokenizer_never_a_weight_file(hub_model, opened, capsys, monkeypatch):
    """A cache holding the whole model: the plan opens its config.json, and its tokenizer's files
    only to sample prompt lengths from local data; never a weight file."""
    import os

    from transformers import AutoModelForCausalLM

    from fitrl.cli import main

    monkeypatch.chdir(ROOT)
    assert (hub_model.path / "model.safetensors").is_file() and opened() == []
    assert main(["plan", EXAMPLE, f"actor.model.path={MODEL}", "--no-recommend"]) == 0
    assert "prompt 25 (the longest of 80 prompts read from" in " ".join(capsys.readouterr().out.split())
    names = set(opened())
    assert {"config.json", "tokenizer_config.json"} <= names <= {"config.json", *hub.TOKENIZER_FILES}, names
    assert main(["plan", EXAMPLE, f"actor.model.path={MODEL}", "plan.expected_prompt_length=null",
                 "--no-recommend"]) == 0
    assert "fits" in capsys.readouterr().out and set(opened()) == {"config.json"}
    os.chmod(os.path.realpath(hub_model.path / "model.safetensors"), 0o644)  # the watch sees what a load
    AutoModelForCausalLM.from_pretrained(str(hub_model.path))                # opens (in safetensors' Rust)
    assert "model.safetensors" in opened()


def test_the_plan_of_a_hub_dataset_is_at_the_prompt_cap_and_says_why(hub_model, capsys, monkeypatch):
    from fitrl.cli import main

    monkeypatch.chdir(ROOT)
    hub.cache_repo("data-org/arith", ARITH_DATA, repo_type="dataset")
    assert main(["plan", EXAMPLE, f"actor.model.path={MODEL}", "data.train_files=[data-org/arith@train]",
                 "--no-recommend"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("note: plan.expected_prompt_length=auto sampled no prompt lengths: data.train_files names a Hub "
            "dataset (data-org/arith@train), which the plan does not read: the expected prompt length is the "
            "cap") in out and "not on this machine" not in out


def test_a_trl_reward_outside_a_run_tokenises_with_the_hub_models_tokenizer(hub_model, tiny_model_dir):
    """``completion_ids`` for a call outside a run come from the tokenizer of ``fitrl.train(model=...)``,
    a Hub id here: read from its snapshot in the cache."""
    from transformers import AutoTokenizer

    from fitrl.rewards.python import PYTHON_REWARDS, TrlInputs, register_python_rewards

    got = []

    def length(completions, completion_ids, **kwargs):
        got.extend(completion_ids)
        return [float(len(ids)) for ids in completion_ids]

    name = register_python_rewards([length], inputs=TrlInputs(tokenizer_path=MODEL))
    assert PYTHON_REWARDS[name](["12 + 30"], [None])[0]["score"] == len(got[0]) > 0
    assert got == [AutoTokenizer.from_pretrained(str(tiny_model_dir))("12 + 30", add_special_tokens=False)["input_ids"]]
    name = register_python_rewards([length], inputs=TrlInputs(tokenizer_path="nobody/nothing"))
    with pytest.raises(ModelDirError, match=r"^the tokenizer of 'nobody/nothing': no local path of that name, and "
                                            r"nobody/nothing is not in the Hugging Face cache"):
        PYTHON_REWARDS[name](["12"], [None])


def test_train_by_hub_ids_records_the_commits_and_a_resume_keeps_them(hub_model, tiny_model_dir, tmp_path, capsys):
    """The Python API trains a Hub model on a Hub dataset; ``hub_refs.json`` holds their commits; a
    resume in the same run directory reads those commits after ``main`` moved to commits that would
    fail (a model without weights, a dataset without prompts); a new run directory reads ``main``."""
    import fitrl
    from fitrl.cli import main
    from fitrl.trainer.run import train

    data = hub.cache_repo("data-org/arith", ARITH_DATA, repo_type="dataset")
    run = tmp_path / "run"
    fitrl.train(EXAMPLE, model=MODEL, overrides=[f"trainer.run_dir={run}", "trainer.max_steps=1",
                                                 "data.train_files=[data-org/arith@train]", *SHORT])
    refs = json.loads((run / "hub_refs.json").read_text())
    assert refs["actor.model.path"] == {"id": MODEL, "revision": "main", "commit": hub_model.commit,
                                        "path": str(hub_model.path)}
    assert refs["data.train_files[0]"]["commit"] == data.commit and refs["data.train_files[0]"]["split"] == "train"

    hub.cache_repo(MODEL, {"config.json": Path(tiny_model_dir) / "config.json"}, commit="b" * 40)
    hub.cache_repo("data-org/arith", {"train.jsonl": '{"answer": 1}\n'}, repo_type="dataset", commit="c" * 40)
    train(toy_config(MODEL, run, "trainer.max_steps=2", "data.train_files=[data-org/arith@train]", *SHORT))
    assert [r["step"] for r in read_metrics(run) if "reward/mean" in r] == [1, 2]
    assert json.loads((run / "hub_refs.json").read_text()) == refs
    out = capsys.readouterr().out
    assert f"(commit {hub_model.commit[:8]}, as this run directory recorded; from the Hugging Face cache)" in out

    assert main(["train", EXAMPLE, f"actor.model.path={MODEL}", f"trainer.run_dir={tmp_path / 'new'}", *SHORT]) == 2
    line = _one_line(capsys.readouterr().err, "model error")
    assert f"holds {MODEL} at bbbbbbbb without its weights (config.json: what `fitrl plan` fetches)" in line
    assert f"`hf download {MODEL} --cache-dir {hub.hub_cache()}`" in line


def test_every_model_a_config_names_is_resolved_and_the_unbuilt_need_config_json_alone(hub_model, tmp_path):
    """A reward model by Hub id gets its weights; a reference the run does not build (no KL) gets
    its config.json, which the plan reads: a cache holding nothing more is enough for it."""
    from fitrl.models.hub import RECORD, resolve_run_refs

    only = hub.cache_repo("big-org/config-only", {"config.json": hub_model.path / "config.json"})
    cfg = toy_config(MODEL, tmp_path / "run", "ref.model.path=big-org/config-only", "reward.sources.rm.kind=model",
                     f"reward.sources.rm.model.path={MODEL}", "reward.sources.rule.kind=function")
    assert resolve_run_refs(cfg, tmp_path) == json.loads((tmp_path / RECORD).read_text())
    assert cfg.actor.model.path == cfg.reward.sources["rm"].model.path == str(hub_model.path)
    assert cfg.ref.model.path == str(only.path)
    cfg = toy_config(MODEL, tmp_path / "run", "ref.model.path=big-org/config-only", "algorithm.use_kl_loss=true")
    with pytest.raises(ModelDirError, match=r"^ref.model.path='big-org/config-only': .* without its weights"):
        resolve_run_refs(cfg, None)


def test_what_the_cache_lacks_is_one_line(hub_model, cache, tmp_path, capsys):
    from fitrl.cli import main

    def train(model, *more):
        return main(["train", EXAMPLE, f"actor.model.path={model}", f"trainer.run_dir={tmp_path / 'run'}", *SHORT,
                     *more])

    assert train("nobody/nothing") == 2
    line = _one_line(capsys.readouterr().err, "model error")
    assert (f"actor.model.path='nobody/nothing': no local path of that name, and nobody/nothing is not in the "
            f"Hugging Face cache {cache} (HF_HUB_OFFLINE=1: nothing is downloaded)") in line
    assert f"`hf download nobody/nothing --cache-dir {cache}` (`huggingface-cli download` before" in line
    assert train(f"{MODEL}@v9") == 2
    line = _one_line(capsys.readouterr().err, "model error")
    assert f"revision 'v9' of {MODEL} is not in the Hugging Face cache {cache} (it holds main -> " in line
    assert f"--revision v9 --cache-dir {cache}" in line
    assert train(MODEL, "actor.model.tokenizer_path=tiny-org/no-tokenizer") == 2
    line = _one_line(capsys.readouterr().err, "model error")
    assert line.startswith("fitrl: model error: actor.model.tokenizer_path='tiny-org/no-tokenizer': no local path")
    assert hub.lookup(hub.HubRef(MODEL, hub_model.commit), "x")[0] == hub_model.commit  # a commit id it holds


def test_a_hub_dataset_loads_through_the_same_row_checks(cache, tiny_model_dir):
    from transformers import AutoTokenizer

    from fitrl.data.dataset import PromptDataset
    from fitrl.data.rows import iter_rows

    hub.cache_repo("data-org/arith", ARITH_DATA, repo_type="dataset")
    local = [row for _, row in iter_rows(DATA / "arith_val.jsonl")]
    got = list(iter_rows("data-org/arith@test"))
    assert [row for _, row in got] == local and got[3][0] == "data-org/arith@test: row 3"
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    def load(entry):
        return PromptDataset([entry], tokenizer, prompt_key="prompt", answer_key="answer", max_prompt_length=64)

    assert len(load("data-org/arith@test")) == 20
    rows = [{"prompt": "What is 1 + 1?", "answer": 2}, {"answer": 3}]
    hub.cache_repo("data-org/bad", {"data/train-00000-of-00001.parquet": _parquet(rows)}, repo_type="dataset")
    with pytest.raises(DataError, match=r"^data-org/bad@train: row 1: 'prompt' is null"):
        load("data-org/bad")
    with pytest.raises(DataError) as e:
        load("data-org/arith@validation")
    assert str(e.value) == ("data file='data-org/arith@validation': data-org/arith has no split 'validation' (its "
                            "splits: train, test); write data-org/arith@train")
    with pytest.raises(DataError, match=r"^data file='data-org/none@train': no local path of that name, and "
                                        r"data-org/none is not in the Hugging Face cache .*--repo-type dataset"):
        load("data-org/none@train")


def test_a_dataset_of_several_configs_is_named_with_one(cache):
    from fitrl.data.rows import iter_rows

    card = ("---\nconfigs:\n- config_name: easy\n  data_files:\n  - split: train\n    path: easy.jsonl\n"
            "- config_name: hard\n  data_files:\n  - split: train\n    path: hard.jsonl\n---\n")
    hub.cache_repo("data-org/levels", {"README.md": card, "easy.jsonl": '{"prompt": "1+1", "answer": 2}\n',
                                       "hard.jsonl": '{"prompt": "9*9", "answer": 81}\n'}, repo_type="dataset")
    assert [row["answer"] for _, row in iter_rows("data-org/levels:hard@train")] == [81]
    with pytest.raises(DataError, match=r"has several configs \(easy, hard\): name one, e.g. data-org/levels:easy"):
        list(iter_rows("data-org/levels@train"))
    with pytest.raises(DataError, match=r"has no config 'medium' \(its configs: easy, hard\)"):
        list(iter_rows("data-org/levels:medium@train"))


def test_export_base_by_hub_id(hub_model, tiny_model_dir):
    from fitrl.models.hub import resolve_base

    assert resolve_base(str(tiny_model_dir)) == str(tiny_model_dir) and resolve_base(None) is None
    assert resolve_base(MODEL) == str(hub_model.path)
    hub.cache_repo("big-org/config-only", {"config.json": hub_model.path / "config.json"})
    assert resolve_base("big-org/config-only", weights=False).endswith("config-only/snapshots/" +
                                                                       hub.lookup(hub.HubRef("big-org/config-only"),
                                                                                  "x")[0])
    with pytest.raises(ModelDirError, match=r"^--base 'big-org/config-only': the Hugging Face cache holds .* "
                                            r"without its weights"):
        resolve_base("big-org/config-only")


def test_export_merges_lora_into_a_base_named_by_hub_id(hub_model, tmp_path, capsys):
    pytest.importorskip("peft")
    from rich.console import Console

    from fitrl.checkpoint.manager import CheckpointManager
    from fitrl.cli import main
    from fitrl.models.hub import resolve_run_refs
    from fitrl.roles.workers import PolicyWorker
    from fitrl.workers.group import InProcessWorkerGroup, RoleHandle

    cfg = toy_config(MODEL, tmp_path / "run", "trainer.device=cpu", "actor.lora.rank=4", "actor.lora.alpha=8")
    resolve_run_refs(cfg, None)
    policy = RoleHandle(InProcessWorkerGroup(PolicyWorker, cfg))
    point = CheckpointManager(cfg, tmp_path / "run", Console(quiet=True)).save(1, {"actor": policy}, {"step": 1}, {})
    assert main(["export", str(point), str(tmp_path / "merged"), "--base", MODEL]) == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    capsys.readouterr()  # (transformers' progress bars)
    hub.cache_repo("big-org/config-only", {"config.json": hub_model.path / "config.json"})
    assert main(["export", str(point), str(tmp_path / "again"), "--base", "big-org/config-only"]) == 2
    line = _one_line(capsys.readouterr().err, "model error")
    assert "--base 'big-org/config-only': the Hugging Face cache holds big-org/config-only at " in line


def test_online_without_a_network_reads_the_cache_and_the_hub_answers_are_one_line(hub_model, monkeypatch):
    """Online (HF_HUB_OFFLINE unset) and the Hub out of reach: the cache, said so. The Hub's own
    refusals (gated, missing, no such revision) each become one line naming what to do."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    commit, names, why = hub.lookup(hub.HubRef(MODEL), "actor.model.path")
    assert (commit, names) == (hub_model.commit, None) and why.startswith("the Hub could not be reached")

    response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/api/models/a/b"))
    for error, expected in ((GatedRepoError, r"a/b is gated on the Hub and no token is set: accept its terms at "
                                             r"https://huggingface.co/a/b, then log in"),
                            (RepositoryNotFoundError, r"a/b is not on the Hub, or is private and no token is set"),
                            (RevisionNotFoundError, r"a/b has no revision 'v2' on the Hub: name a branch, a tag")):
        def refuse(self, *args, _error=error, **kwargs):
            raise _error("refused", response=response)

        monkeypatch.setattr(HfApi, "repo_info", refuse)
        with pytest.raises(ModelDirError, match=rf"^actor.model.path='a/b@v2': {expected}"):
            hub.lookup(hub.HubRef("a/b", "v2"), "actor.model.path='a/b@v2'")


def test_what_docs_hub_md_shows_is_what_fitrl_writes(hub_model, tmp_path, capsys, monkeypatch):
    """Its error line is what the command prints; its hub_refs.json has the keys a run writes."""
    from fitrl.cli import main
    from fitrl.data.hub import resolve_dataset

    text = (ROOT / "docs" / "hub.md").read_text()
    shown = re.search(r"```text\n(.*?)\n```", text, re.S).group(1)
    command = re.search(r"For example, `(.*?)` with nothing", text, re.S).group(1).split()
    env = dict(item.split("=", 1) for item in command[:2])
    assert command[2:4] == ["fitrl", "plan"] and env["HF_HUB_OFFLINE"] == "1"
    monkeypatch.setenv("HF_HUB_CACHE", env["HF_HUB_CACHE"])
    monkeypatch.chdir(ROOT)
    assert main(command[3:]) == 2
    assert capsys.readouterr().err.strip() == shown

    example = json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))
    data = hub.cache_repo("data-org/arith", ARITH_DATA, repo_type="dataset", cache=tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    record = resolve_dataset(parse_dataset_ref("data-org/arith@train")).record()
    assert set(example["actor.model.path"]) == set(hub_model.record()) and set(example["data.train_files[0]"]) == \
        set(record) and record["commit"] == data.commit


@pytest.mark.cli
def test_the_command_says_it_in_one_line_and_exits_2(cache, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fitrl.cli", "train", EXAMPLE, "actor.model.path=nobody/nothing",
                           f"trainer.run_dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    line = _one_line(proc.stderr, "model error")
    assert "nobody/nothing is not in the Hugging Face cache" in line and "`hf download nobody/nothing" in line


def _parquet(rows: list[dict]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out.getvalue()

