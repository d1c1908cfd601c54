"""Issue 66: a checkpoint is complete only when every rank's files are where the loader looks.

On a cluster whose nodes each have their own disk, a rank writes its shards into its own node's
``trainer.run_dir``: the driver's copy lacks them, and a marker built from what the driver sees
does not list them. Here a rank is given a disk of its own with ``FITRL_INJECT_OWN_DISK``
(fitrl/core/faults.py), or its files are deleted between the write and the check:

- ``fitrl checkpoint verify`` names a rank's file the checkpoint lacks even when its marker does
  not list it;
- a save missing a rank's files is not marked complete: one line naming the rank, the partial
  save removed, the previous checkpoint loadable;
- before step 1 of a Ray run the driver and every rank check that they see one run directory,
  and refuse (exit 2) naming the rank that does not.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from badcases import DATA, base_config
from fitrl.checkpoint import layout, shared_dir
from fitrl.cli import main
from fitrl.core import faults
from fitrl.core.errors import RunDirError
from fitrl.trainer import rundir
from helpers import toy_config

STEP_2 = Path("checkpoints") / "step_2"


def verify(path: Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["checkpoint", "verify", str(path)])
    return code, out.getvalue()


def unlist(marker: Path, *rels: str, **changes) -> None:
    """Drop files from a marker, as a save whose ranks wrote them elsewhere leaves it."""
    meta = json.loads(marker.read_text())
    for rel in rels:
        meta["files"].pop(rel)
        meta["hashes"].pop(rel)
    for key, value in changes.items():  # (``...`` removes the key)
        meta.pop(key) if value is ... else meta.__setitem__(key, value)
    marker.write_text(json.dumps(meta))


def test_verify_names_a_ranks_shard_that_the_marker_does_not_list(finished_run, tmp_path):
    run = shutil.copytree(finished_run, tmp_path / "run")
    step = run / STEP_2
    (step / "actor" / "__0_0.distcp").unlink()
    unlist(step / layout.MARKER, "actor/__0_0.distcp")
    code, out = verify(step)
    assert code == 1, out
    assert "BAD  step_2/actor/__0_0.distcp: missing: actor rank 0's file, not listed in the COMPLETE marker" in out
    assert "1 of" in out and "damaged or missing" in out


def test_verify_checks_every_rank_of_the_saved_world_size(finished_run, tiny_model_dir, tmp_path, capsys):
    """A marker saying 2 ranks saved (written before markers listed each role's ranks): rank 1's
    generators are not there. A resume refuses it before any model loads, naming the file."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    unlist(run / STEP_2 / layout.MARKER, world_size=2, role_world_sizes=...)
    code, out = verify(run)
    assert code == 1, out
    assert "BAD  step_2/actor/rng_rank1.pt: missing: actor rank 1's file" in out
    assert "rank 0" not in out
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(base_config(tiny_model_dir, DATA), sort_keys=False))
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", str(config), f"trainer.run_dir={run}", "trainer.max_steps=3"]) == 1
    err = capsys.readouterr().err
    assert f"checkpoint {run / STEP_2} lacks actor/rng_rank1.pt of actor rank 1 (missing)" in err, err


def test_a_save_missing_a_ranks_files_is_not_marked_complete(finished_run, tiny_model_dir, tmp_path, monkeypatch,
                                                             capsys):
    """Rank 0 (in-process: the driver's own process) writes its shards to a disk of its own at the
    step-3 save: the run stops in one line naming the rank and the files, no step_3 and no partial
    save are left, and step_2 still resumes."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(base_config(tiny_model_dir, DATA), sort_keys=False))
    before = (run / STEP_2 / layout.MARKER).read_text()
    elsewhere = tmp_path / "node-disk"
    monkeypatch.setenv(faults.INJECT_OWN_DISK, f"policy:0:checkpoint:{elsewhere}")
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", str(config), f"trainer.run_dir={run}", "trainer.max_steps=3"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("fitrl:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("fitrl: run directory: checkpoint of step 3 not saved: the files of actor rank 0 "
                               "(host "), lines
    assert "lacks .metadata, role_state.pt, __0_0.distcp, rng_rank0.pt. " in lines[0]
    assert "trainer.run_dir must be one filesystem shared by every node" in lines[0]
    assert f"the newest checkpoint is still {run / STEP_2}" in lines[0]
    assert list(elsewhere.rglob("__0_0.distcp")), "the injected fault did not move the shard"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2"]  # no step_3, no partial save
    assert (run / STEP_2 / layout.MARKER).read_text() == before
    layout.read(run / STEP_2)  # every file as saved

    monkeypatch.delenv(faults.INJECT_OWN_DISK)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", str(config), f"trainer.run_dir={run}", "trainer.max_steps=3"]) == 0
    saved = layout.read(run / "checkpoints" / "step_3")
    assert saved.meta["role_world_sizes"] == {"actor": 1}
    assert verify(run)[0] == 0


class TwoRanks:
    """A worker group of two ranks in this process, each running the check's rank side under
    its own identity (so ``FITRL_INJECT_OWN_DISK`` can name one)."""

    world_size = 2
    node_ips = ["10.0.0.1", "10.0.0.2"]

    def __init__(self, after=None):
        self.after = after or (lambda rank, run_dir, token: None)

    def call_all(self, method, per_rank_args, kwargs):
        assert method == "run_dir_view"
        out = []
        try:
            for rank, args in enumerate(per_rank_args):
                faults.identify("policy", rank)
                out.append(shared_dir.rank_view(*args, rank=rank))
                self.after(rank, *args)
        finally:
            faults.identify("policy", 0)
        return out


def test_the_start_up_check_refuses_a_rank_that_sees_another_directory(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    rundir.check_shared(run, TwoRanks())  # one directory: passes, and leaves nothing behind
    assert list(run.iterdir()) == []

    monkeypatch.setenv(faults.INJECT_OWN_DISK, f"policy:1:run_dir:{tmp_path / 'node-disk'}")
    with pytest.raises(RunDirError) as e:
        rundir.check_shared(run, TwoRanks())
    text = str(e.value)
    assert "policy rank 1 (host " in text and "node 10.0.0.2) does not see the driver's marker" in text
    assert "rank 0" not in text and "\n" not in text
    assert "trainer.run_dir must be one filesystem shared by every node (NFS, Lustre, ...)" in text
    assert list(run.iterdir()) == [] and not (tmp_path / "node-disk").exists()  # rank 1 wrote nothing


def test_the_start_up_check_refuses_a_rank_whose_marker_the_driver_does_not_see(tmp_path, monkeypatch):
    """The other way round: rank 0 sees the driver's marker, but what it writes never shows in
    the driver's directory (here: removed at once)."""
    monkeypatch.setattr(rundir, "MARK_WAIT_S", 0.3)

    def vanish(rank, run_dir, token):
        if rank == 0:
            (Path(run_dir) / rundir.SHARE_DIR / token / "rank0.json").unlink()

    with pytest.raises(RunDirError, match=r"policy rank 0 \(host [^)]*node 10\.0\.0\.1\) wrote its marker where the "
                                          r"driver does not see it \(the driver runs on host"):
        rundir.check_shared(tmp_path, TwoRanks(after=vanish))


def test_the_run_dir_handed_to_ranks_is_absolute(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    cfg = toy_config(tiny_model_dir, "relative/run")
    assert rundir.run_dir_path(cfg.trainer) == tmp_path / "relative" / "run"
    cfg.trainer.run_dir = ""
    assert rundir.run_dir_path(cfg.trainer).is_absolute()


# ---------------------------------------------------------------------- 2 ranks under Ray

RAY = ["trainer.backend=ray", "trainer.devices_per_node=2", "trainer.device=cpu", "trainer.val_before_train=false",
       "data.val_files=[]", "data.rollout_batch_size=4", "rollout.n=2", "actor.mini_batch_size=4",
       "actor.micro_batch_size=2"]


@pytest.fixture(scope="module")
def ray_with_rank_1_apart(tmp_path_factory):
    """A private 2-CPU Ray cluster whose worker processes all start with policy rank 1 seeing the
    run directory on a disk of its own (for the start-up check only: its saves go where the
    driver's do). Set before Ray starts: its workers inherit the environment of its raylet."""
    ray = pytest.importorskip("ray")
    from fitrl.workers.ray_group import ensure_ray

    assert not ray.is_initialized()
    disk = tmp_path_factory.mktemp("node-disk")
    os.environ[faults.INJECT_OWN_DISK] = f"policy:1:run_dir:{disk}"
    try:
        ensure_ray(num_cpus=2)
    finally:
        del os.environ[faults.INJECT_OWN_DISK]  # (this driver process does not act on it)
    yield disk
    ray.shutdown()


@pytest.mark.slow
def test_a_ray_run_whose_rank_sees_another_run_dir_is_refused_before_step_1(ray_with_rank_1_apart, tiny_model_dir,
                                                                            tmp_path, capsys):
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(base_config(tiny_model_dir, DATA), sort_keys=False))
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", str(config), f"trainer.run_dir={run}", "trainer.max_steps=1", *RAY])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("fitrl:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"fitrl: run directory: trainer.run_dir={run} is not one directory for every rank: "
                               "policy rank 1 (host "), lines
    assert "Ray node id" in lines[0] and "rank 0" not in lines[0]
    assert not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text().strip()  # no step ran
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())
    assert not (run / rundir.SHARE_DIR).exists()


@pytest.mark.slow
def test_a_ray_save_missing_rank_1s_files_is_refused_and_verify_names_them(ray_with_rank_1_apart, tiny_model_dir,
                                                                           tmp_path):
    """Two real FSDP2 ranks save step 1; at step 2 rank 1's files are deleted between the write
    and the completeness check: no step_2, step_1 intact. Then step_1 loses rank 1's shard and
    its marker the entry (as a save on per-node disks leaves it): verify names rank 1."""
    from rich.console import Console

    from fitrl.checkpoint.manager import CheckpointManager
    from fitrl.roles.workers import PolicyWorker
    from fitrl.workers.group import RoleHandle
    from fitrl.workers.ray_group import RayWorkerGroup

    run = tmp_path / "run"
    cfg = toy_config(tiny_model_dir, run, *RAY)
    manager = CheckpointManager(cfg, run, Console(quiet=True))
    with RayWorkerGroup(PolicyWorker, cfg, world_size=2, name="policy") as group:
        policy = RoleHandle(group)
        step_1 = manager.save(1, {"actor": policy}, {"step": 1}, {})
        assert {"actor/__1_0.distcp", "actor/rng_rank1.pt"} <= set(layout.read(step_1).meta["files"])

        class LosesRank1(RoleHandle):
            def save_checkpoint(self, path, model_only=False):
                policy.save_checkpoint(path, model_only)
                for name in ("__1_0.distcp", "rng_rank1.pt"):
                    (Path(path) / name).unlink()

        with pytest.raises(RunDirError) as e:
            manager.save(2, {"actor": LosesRank1(group)}, {"step": 2}, {})
    text = str(e.value)
    assert text.startswith(f"checkpoint of step 2 not saved: the files of actor rank 1 (node {group.node_ips[1]}) "
                           "are not where the driver"), text
    assert "lacks __1_0.distcp, rng_rank1.pt. trainer.run_dir must be" in text
    assert f"the newest checkpoint is still {step_1}" in text
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1"]
    layout.read(step_1)

    (step_1 / "actor" / "__1_0.distcp").unlink()
    unlist(step_1 / layout.MARKER, "actor/__1_0.distcp")
    code, out = verify(step_1)
    assert code == 1, out
    assert "BAD  step_1/actor/__1_0.distcp: missing: actor rank 1's file, not listed" in out
