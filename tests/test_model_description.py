"""Each model's ``config.json`` is read once per run, by ``train()``, and handed down as a
:class:`~fitrl.models.description.ModelDescription` (fitrl/models/description.py): the start-up
checks, the data path, the divergence judge, the FLOPs counter and every worker read it, never
the directory again, and no ``family_for`` re-derives the family.

Reads are counted at ``Path.read_text`` of the actor's ``config.json`` (fitrl's one reader,
fitrl/models/config_json.py, goes through it; transformers opens the file itself, and its read
when the weights load is not counted). The memory plan is off here: its expected lengths
(fitrl/memory/lengths.py) still ask the directory for the policy's media spec.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from fitrl.config.schema import ModelConfig
from fitrl.models.description import ModelDescription, RunModels
from fitrl.models.loading import described
from helpers import toy_config

ONE_STEP = ["trainer.max_steps=1", "trainer.num_threads=1", "rollout.n=2", "trainer.val_before_train=false",
            "data.val_files=[]", "actor.mini_batch_size=4", "actor.micro_batch_size=4"]


def count_reads(monkeypatch, model_dir) -> list[str]:
    """Every read of ``model_dir``'s config.json in this process from now on (one entry each)."""
    target, reads, read_text = Path(model_dir) / "config.json", [], Path.read_text

    def counted(self, *args, **kwargs):
        if Path(self) == target:
            reads.append(str(self))
        return read_text(self, *args, **kwargs)
    monkeypatch.setattr(Path, "read_text", counted)
    return reads


def count_family_for(monkeypatch) -> list[str]:
    import fitrl.models.families as families

    calls, family_for = [], families.family_for

    def counted(path, name="auto"):
        calls.append(str(path))
        return family_for(path, name)
    monkeypatch.setattr(families, "family_for", counted)  # (media_spec_of and any later import see it)
    return calls


def test_a_description_pickles_as_plain_data(tiny_model_dir):
    from fitrl.models.families import CAUSAL_LM

    d = ModelDescription.read(ModelConfig(path=str(tiny_model_dir)))
    assert d.family is CAUSAL_LM and d.family_name == "causal_lm" and d.tokenizer_path == str(tiny_model_dir)
    assert d.vocab_size == d.config["vocab_size"] and d.media_spec is None and d.shape.vocab == d.vocab_size
    back = pickle.loads(pickle.dumps(d))
    assert back == d and back.family is CAUSAL_LM
    assert not {"vocab_size", "media_spec", "shape"} & set(vars(back))  # derived again where asked for
    assert back.vocab_size == d.vocab_size


def test_a_directory_named_twice_is_read_once(tiny_model_dir, tmp_path, monkeypatch):
    cfg = toy_config(tiny_model_dir, tmp_path / "run", "algorithm.use_kl_loss=true",
                     f"ref.model.path={tiny_model_dir}")
    reads = count_reads(monkeypatch, tiny_model_dir)
    models = RunModels.read(cfg)
    assert len(reads) == 1
    ref = models.get("ref.model")
    assert ref is not None and ref.config is models.actor.config
    assert models.get("critic.model") is models.actor  # (no critic model of its own: the actor's)
    assert models.get("teacher.model") is None  # (distillation off: no teacher loads)
    assert described(models, "ref.model", cfg.ref.model) is ref and len(reads) == 1


def test_a_worker_built_directly_reads_its_own(tiny_model_dir, tmp_path, monkeypatch):
    cfg = toy_config(tiny_model_dir, tmp_path / "run")
    reads = count_reads(monkeypatch, tiny_model_dir)
    d = described(None, "actor.model", cfg.actor.model)
    assert d.path == str(tiny_model_dir) and len(reads) == 1
    with pytest.raises(ValueError, match="not of ref.model.path"):
        described(RunModels({"ref.model": d}), "ref.model", ModelConfig(path=str(tmp_path)))


def test_an_in_process_run_reads_the_actors_config_once(tiny_model_dir, tmp_path, monkeypatch):
    """Start-up checks, data, plan-free preflight, the policy's and the reference's workers, the
    FLOPs counter and the divergence judge: one read of config.json, no family_for."""
    from fitrl.trainer.run import train

    cfg = toy_config(tiny_model_dir, tmp_path / "run", *ONE_STEP, "algorithm.use_kl_loss=true")
    reads, family_for = count_reads(monkeypatch, tiny_model_dir), count_family_for(monkeypatch)
    history = train(cfg)
    assert len(history) == 1 and "time/ref" in history[0]  # the reference's worker was built and ran
    assert len(reads) == 1, f"{len(reads)} reads of {tiny_model_dir}/config.json"
    assert family_for == []


@pytest.fixture
def ray_read_log(tmp_path, tiny_model_dir):
    """A private Ray cluster whose every worker process logs its pid when it starts
    (``hooked``) and at each read of the tiny model's config.json (``read``)."""
    ray = pytest.importorskip("ray")
    from fitrl.workers.ray_group import ensure_ray

    log, target = tmp_path / "reads.log", str(Path(tiny_model_dir) / "config.json")

    def hook():  # (nested: pickled by value into each worker process)
        import os as os_
        from pathlib import Path as P

        read_text = P.read_text

        def note(what):
            with open(log, "a") as f:
                f.write(f"{what} {os_.getpid()}\n")

        def counted(self, *args, **kwargs):
            if str(self) == target:
                note("read")
            return read_text(self, *args, **kwargs)
        P.read_text = counted
        note("hooked")

    ray.shutdown()  # (an earlier module's cluster: this one must start with the hook)
    ensure_ray(num_cpus=2, runtime_env={"worker_process_setup_hook": hook})
    yield log
    ray.shutdown()


@pytest.mark.slow
def test_a_two_rank_ray_run_reads_it_once_in_the_driver(tiny_model_dir, tmp_path, monkeypatch, ray_read_log):
    """Under Ray the descriptions travel to the ranks (pickled with their group's arguments):
    the policy's and the reference's two ranks each read no config.json of their own."""
    from fitrl.trainer.run import train

    cfg = toy_config(tiny_model_dir, tmp_path / "run", *ONE_STEP, "algorithm.use_kl_loss=true",
                     "trainer.backend=ray", "trainer.devices_per_node=2", "trainer.device=cpu")
    reads = count_reads(monkeypatch, tiny_model_dir)
    history = train(cfg)
    assert len(history) == 1 and "time/ref" in history[0]
    assert len(reads) == 1  # this process: the driver
    lines = [line.split() for line in ray_read_log.read_text().splitlines()]
    hooked = {pid for what, pid in lines if what == "hooked"}
    assert len(hooked) >= 4, lines  # the two groups' ranks ran with the hook (else nothing here was counted)
    assert [pid for what, pid in lines if what == "read"] == [], lines
    assert str(os.getpid()) not in hooked
