"""Issue 65: ``fitrl demo`` leaves the repository clean (fitrl/trainer/demo.py). Whatever directory
it is started from, everything it writes (its run directories, the warm start's and its export,
the tiny models and reward models it makes, the toy data it writes when missing) is outside the
checkout or under a path .gitignore names; every other path its configs name is a committed file
it only reads. Each variant is run with the training, the model making and the export replaced by
recorders, so the paths are the demo's own and nothing heavy runs."""

import shutil
import subprocess
from pathlib import Path

import pytest

from fitrl.cli import _load
from fitrl.trainer import demo
from fitrl.trainer.rundir import run_dir_path

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                                reason="needs the git checkout and git")


def _git(*args: str) -> int:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True).returncode


def _where(path: Path) -> str:
    """"outside", "ignored" or "tracked" (a committed file), else "untracked"."""
    path = path.absolute()
    if ROOT not in path.parents and path != ROOT:
        return "outside"
    if _git("check-ignore", "-q", "--no-index", str(path)) == 0:
        return "ignored"
    return "tracked" if _git("ls-files", "--error-unmatch", str(path)) == 0 else "untracked"


class Recorder:
    def __init__(self):
        self.written: list[Path] = []  # what the demo writes
        self.read: list[Path] = []     # what its configs name, which it writes only when missing

    def train(self, cfg, console=None, supervised=False, where=None):
        run = run_dir_path(cfg.trainer)
        self.written.append(run)
        for path in [cfg.actor.model.path, *cfg.data.train_files, *cfg.data.val_files,
                     *(s.model.path for s in cfg.reward.sources.values() if s.kind == "model")]:
            self.read.append(Path(path).absolute())
        where.update(run_dir=run, val_prompts=0)
        return [{"reward/mean": 0.0}]

    def wrote(self, out, *args, **kw):
        self.written.append(Path(out).absolute())
        return {"train_right_sum_ranked_first": 1.0, "held_out_right_sum_ranked_first": 1.0,
                "held_out_correlation": 1.0}

    def data_writer(self, real, scratch: Path):
        """``real`` run into ``scratch``: each file it writes recorded at its place in ``out``."""
        def write(out, seed=0, **kw):
            real(scratch, seed=seed, **kw)
            self.written += [Path(out).absolute() / f.relative_to(scratch) for f in scratch.rglob("*") if f.is_file()]
        return write


@pytest.mark.parametrize("flag", [None, "vl", "reward_model", "tools"])
def test_the_demo_writes_only_outside_the_checkout_or_where_git_ignores(flag, tmp_path, monkeypatch):
    import fitrl.checkpoint.export
    import fitrl.data.toy_images
    import fitrl.data.toy_tools
    import fitrl.models.tiny
    import fitrl.models.tiny_reward
    import fitrl.trainer.run

    rec = Recorder()
    monkeypatch.chdir(tmp_path)  # a user's own directory (the demo moves to the checkout: restored after)
    monkeypatch.setattr(fitrl.trainer.run, "train", rec.train)
    monkeypatch.setattr(fitrl.models.tiny, "make_tiny_model", rec.wrote)
    monkeypatch.setattr(fitrl.checkpoint.export, "export_checkpoint", lambda run, out: rec.wrote(out))
    monkeypatch.setattr(fitrl.models.tiny_reward, "train_arith_reward_model", rec.wrote)
    for module, name in ((fitrl.data.toy_tools, "write_mul_tools_data"), (fitrl.data.toy_images, "write_shapes_data")):
        monkeypatch.setattr(module, name, rec.data_writer(getattr(module, name), tmp_path / name))
    monkeypatch.setattr(demo, "accuracy_gain", lambda *a, **k: None)
    args = demo.argparse.Namespace(vl=flag == "vl", reward_model=flag == "reward_model", tools=flag == "tools",
                                   warm_start_steps=None, overrides=[])
    demo.run_demo(args, _load, lambda cfg: None)

    assert len([p for p in rec.written if p.name != "hf"]) >= 2  # the warm start's run and GRPO's (+ their models)
    for path in rec.written:
        assert _where(path) in ("outside", "ignored"), f"fitrl demo writes {path}, inside the checkout"
    for path in rec.read:  # a path the demo fills when missing: ignored; else a committed file it reads
        assert _where(path) in ("outside", "ignored", "tracked"), f"fitrl demo names {path}: not committed, not ignored"
