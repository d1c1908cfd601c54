"""Faults during and between runs through the real command line (issue 12, part B): signals,
damaged checkpoints, divergence, weights-only checkpoints (harness: tests/badcases.py).

Every case asserts its exit status, its message, no traceback, and that the finished run of the
workspace (``ws.run``: config.yaml, metrics.jsonl, checkpoints/step_2) is as it was, but for the
files it lists in ``may_change`` (those its ``prepare`` damages on purpose, or a resume rewrites).

Signals are real: the run is a subprocess that sends itself SIGTERM/SIGINT at a chosen phase of a
chosen step (tests/hooks/sitecustomize.py, on the subprocess's PYTHONPATH), so what is tested does
not depend on timing. Every other case runs in this process. A run that stopped with an
emergency checkpoint is then resumed (in this process) to show the checkpoint is resumable.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from badcases import DATA, Case, Outcome, Workspace, edit_json, run_case, run_cli

from fitrl.checkpoint import layout

HOOKS = Path(__file__).resolve().parent / "hooks"
STEP_2 = "checkpoints/step_2"
SHARD = f"{STEP_2}/actor/__0_0.distcp"
MARKER = f"{STEP_2}/{layout.MARKER}"
# Leaner runs: rewards scored in the driver, no validation before the first step.
LEAN = ("reward.num_workers=0", "trainer.val_before_train=false", "data.val_files=[]")
# The finished run was trained on the repository's data: a resume must name the same files
# (the workspace's config points at a copy, and data files are not resume-safe).
SAME_DATA = f"data.train_files=[{DATA / 'arith_train.jsonl'}]"


# ----------------------------------------------------------------------------- helpers


def on_run(*overrides: str):
    """``prepare``: continue the finished run (``ws.run``) with ``overrides``."""
    return lambda ws: ws.train_args(SAME_DATA, *LEAN, *overrides, run_dir=ws.run)


def on_new(*overrides: str):
    """``prepare``: train in a fresh run directory (``ws.root / "new-run"``)."""
    return lambda ws: ws.train_args(*LEAN, *overrides)


def then(fault, prepare):
    """``prepare`` that applies ``fault(ws)`` first."""
    def both(ws: Workspace) -> list[str]:
        fault(ws)
        return prepare(ws)
    return both


def signals(spec: str) -> dict:
    """The subprocess sends itself signals as ``spec`` says (tests/hooks/sitecustomize.py)."""
    return {"PYTHONPATH": str(HOOKS), "FITRL_TEST_SIGNAL_AT": spec}


def flip_byte(rel: str, where: float = 0.5):
    """Fault: one byte of ``ws.run/rel`` inverted, the size unchanged."""
    def fault(ws: Workspace) -> None:
        path = ws.run / rel
        data = bytearray(path.read_bytes())
        data[int(len(data) * where)] ^= 0xFF
        path.write_bytes(bytes(data))
    return fault


def truncate(rel: str):
    def fault(ws: Workspace) -> None:
        path = ws.run / rel
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return fault


def delete(rel: str):
    return lambda ws: (ws.run / rel).unlink()


def edit_marker(**changes):
    """Fault: the step_2 marker rewritten with ``changes`` (``...`` removes a key)."""
    return lambda ws: edit_json(ws.run / MARKER, **changes)


def train_steps(run: Path) -> list[int]:
    """The steps metrics.jsonl holds training records of, in file order."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "reward/mean" in r and "event" not in r]


def then_resumed(prepare, run_of, *, from_step: int, to_step: int, also=None):
    """``(prepare, check)``: ``check`` runs the same command again (in this process) and asserts
    that it continues from ``from_step`` to ``to_step`` of the run directory ``run_of(ws)``,
    whose metrics.jsonl then lists every step once; ``also(ws)`` runs first."""
    seen: dict = {}

    def prepare_noting(ws: Workspace) -> list[str]:
        seen["args"] = prepare(ws)
        return seen["args"]

    def check(ws: Workspace, outcome: Outcome) -> None:
        if also is not None:
            also(ws)
        run = run_of(ws)
        again = run_cli(seen["args"], subprocess_=False, env={}, timeout=300, cwd=ws.root)
        text = again.stderr + again.stdout
        assert again.code == 0, text[-3000:]
        assert f"resumed from {run / 'checkpoints' / f'step_{from_step}'} (step {from_step})" in text, text[-3000:]
        assert train_steps(run) == list(range(1, to_step + 1))
        layout.read(run / "checkpoints" / f"step_{to_step}")  # complete, every checksum as saved
    return prepare_noting, check


def extend_to_step_3_then(fault):
    """Fault: the finished run continued to a complete step_3 (so step_2 is the previous
    checkpoint), then ``fault`` applied to step_3."""
    def both(ws: Workspace) -> None:
        out = run_cli(on_run("trainer.max_steps=3")(ws), subprocess_=False, env={}, timeout=300, cwd=ws.root)
        assert out.code == 0, out.stderr[-3000:]
        fault(ws)
    return both


def checkpoints(run: Path) -> list[int]:
    return [c.step for c in layout.list_complete(run / "checkpoints")]


# ----------------------------------------------------------------------------- the table

def _new_run(ws: Workspace) -> Path:
    return ws.root / "new-run"


def _only_step_1(ws: Workspace) -> None:
    assert checkpoints(_new_run(ws)) == [1]
    assert not [d for d in (_new_run(ws) / "checkpoints").iterdir() if ".tmp-" in d.name]  # the dropped save


_rollout_prepare, _rollout_check = then_resumed(on_new("trainer.max_steps=3"), _new_run, from_step=1, to_step=3)
_update_prepare, _update_check = then_resumed(on_run("trainer.max_steps=4"), lambda ws: ws.run, from_step=3,
                                              to_step=4)
_second_prepare, _second_check = then_resumed(on_new("trainer.max_steps=3", "checkpoint.save_freq=1"), _new_run,
                                              from_step=1, to_step=3, also=_only_step_1)


def _no_new_checkpoint(ws: Workspace, outcome: Outcome) -> None:
    assert checkpoints(ws.run) == [2]  # (its files: the harness compares their digests)


def _diverged(ws: Workspace, outcome: Outcome) -> None:
    run = _new_run(ws)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    stop = [r for r in records if r.get("event") == "divergence"]
    assert len(stop) == 1 and stop[0]["step"] == max(train_steps(run)) <= 6  # the step it stopped at is kept
    onset = stop[0]["step"] - 2  # the first of the 3 consecutive steps
    # saved every step before the first sign; nothing of the diverged steps
    assert checkpoints(run) == list(range(1, onset)) and onset > 1
    layout.read(run / "checkpoints" / f"step_{onset - 1}")  # and it is intact


def _marker_left_alone(ws: Workspace, outcome: Outcome) -> None:
    assert (ws.run / SHARD).is_file()  # the incomplete checkpoint was not deleted


def _fallback(ws: Workspace, outcome: Outcome) -> None:
    assert checkpoints(ws.run) == [2, 3, 4]  # the damaged step_3 is left for the user, not deleted
    layout.read(ws.run / "checkpoints" / "step_4")
    assert train_steps(ws.run) == [1, 2, 3, 4]


def _fresh_metrics(original: Path):
    def check(ws: Workspace, outcome: Outcome) -> None:
        assert (ws.run / "metrics.jsonl.prev").read_bytes() == original.read_bytes()  # kept beside
        assert train_steps(ws.run) == [1]  # the new run's file: step 1 once, not appended
    return check


def _inf_in_model(ws: Workspace) -> None:
    from safetensors.torch import load_file, save_file

    path = ws.model / "model.safetensors"
    weights = load_file(path)
    weights["model.norm.weight"][:] = math.inf
    save_file(weights, path, metadata={"format": "pt"})


SIGNAL_CASES = [
    Case("sigterm_mid_rollout", "signals", _rollout_prepare, subprocess=True, exit=143,
         message=r"SIGTERM received during 'rollout'.*stopped by SIGTERM during step 2 \(abandoned before its update"
                 r".*emergency checkpoint of step 1 written; resume point: .*step_1 \(step 1\); run the same command",
         env=signals("rollout:2:TERM"), check=_rollout_check),
    Case("sigterm_mid_update", "signals", _update_prepare, subprocess=True, exit=143,
         message=r"SIGTERM received during 'update'.*stopped by SIGTERM at step 3: emergency checkpoint of step 3",
         env=signals("update:3:TERM"), may_change=("metrics.jsonl", "config.yaml"), check=_update_check),
    Case("sigint_mid_rollout", "signals", on_new("trainer.max_steps=2"), subprocess=True, exit=130,
         message=r"SIGINT received during 'rollout'.*stopped by SIGINT during step 2.*emergency checkpoint of step 1",
         env=signals("rollout:2:INT")),
    Case("second_sigterm_during_save", "signals", _second_prepare, subprocess=True, exit=143,
         message=r"stopped at once by a second SIGTERM; a checkpoint being written was dropped.*resume point: "
                 r".*step_1 \(step 1\)",
         env=signals("update:2:TERM,save:2:TERM"), check=_second_check),
    Case("sigterm_no_grace", "signals", on_run("trainer.max_steps=4", "trainer.signal_grace_s=0"), subprocess=True,
         exit=143, message=r"stopped by SIGTERM at step 3: no emergency checkpoint \(trainer.signal_grace_s=0\); "
                           r"resume point: .*step_2 \(step 2\)",
         env=signals("update:3:TERM"), may_change=("metrics.jsonl", "config.yaml"), check=_no_new_checkpoint),
]

CHECKSUM_CASES = [
    Case("corrupt_same_size_shard", "checksums", then(flip_byte(SHARD), on_run("trainer.max_steps=3")), exit=1,
         message=r"checkpoint file .*step_2/actor/__0_0\.distcp: checksum differs.*checkpoint\.on_corrupt=previous",
         may_change=(SHARD,), check=_no_new_checkpoint),
    Case("corrupt_shard_falls_back", "checksums",
         then(extend_to_step_3_then(flip_byte("checkpoints/step_3/actor/__0_0.distcp")),
              on_run("trainer.max_steps=4", "checkpoint.on_corrupt=previous")), exit=0,
         message=r"step_3 is damaged: .*checksum differs.*resuming from the previous complete checkpoint, step_2.*"
                 r"resumed from .*step_2 \(step 2\)",
         may_change=("metrics.jsonl", "config.yaml"), check=_fallback),
    Case("corrupt_shard_no_previous", "checksums",
         then(flip_byte(SHARD), on_run("trainer.max_steps=3", "checkpoint.on_corrupt=previous")), exit=1,
         message=r"(?=.*step_2 is damaged.*no earlier complete checkpoint)(?=.*no intact checkpoint to resume)",
         may_change=(SHARD,)),
    Case("truncated_shard", "checksums", then(truncate(SHARD), on_run("trainer.max_steps=3")), exit=1,
         message=r"__0_0\.distcp is \d+ bytes, \d+ when it was saved", may_change=(SHARD,)),
    Case("corrupt_checkpoint_config", "checksums",
         then(flip_byte(f"{STEP_2}/config.yaml", 0.2), on_run("trainer.max_steps=3")), exit=1,
         message=r"step_2/config\.yaml: checksum differs", may_change=(f"{STEP_2}/config.yaml",)),
    Case("missing_marker", "checksums", then(delete(MARKER), on_run("trainer.max_steps=3")), exit=1,
         message=r"step_2 has no readable COMPLETE marker .*not resuming from it, nor starting over on top of it",
         may_change=(MARKER,), check=_marker_left_alone),
    Case("garbage_marker", "checksums",
         then(lambda ws: (ws.run / MARKER).write_text("{"), on_run("trainer.max_steps=3")), exit=1,
         message=r"no readable COMPLETE marker", may_change=(MARKER,), check=_marker_left_alone),
    Case("old_marker_without_checksums_resumes", "checksums",
         then(edit_marker(hash=..., hashes=...), on_run("trainer.max_steps=3")), exit=0,
         message=r"resumed from .*step_2 \(step 2\)", may_change=(MARKER, "metrics.jsonl", "config.yaml")),
    Case("verify_intact_run", "verify", lambda ws: ["checkpoint", "verify", str(ws.run)], exit=0,
         message=r"OK   step_2/actor/__0_0\.distcp\n.*step_2: intact, \d+ files"),
    Case("verify_intact_step_dir", "verify", lambda ws: ["checkpoint", "verify", str(ws.run / STEP_2)], exit=0,
         message=r"step_2: intact"),
    Case("verify_corrupt_shard", "verify", then(flip_byte(SHARD), lambda ws: ["checkpoint", "verify", str(ws.run)]),
         exit=1, message=r"BAD  step_2/actor/__0_0\.distcp: checksum differs.*1 of \d+ files damaged",
         may_change=(SHARD,)),
    Case("verify_truncated_shard", "verify", then(truncate(SHARD), lambda ws: ["checkpoint", "verify", str(ws.run)]),
         exit=1, message=r"BAD  step_2/actor/__0_0\.distcp: \d+ bytes, \d+ when it was saved", may_change=(SHARD,)),
    Case("verify_missing_file", "verify",
         then(delete(f"{STEP_2}/rng.pt"), lambda ws: ["checkpoint", "verify", str(ws.run)]), exit=1,
         message=r"BAD  step_2/rng\.pt: missing", may_change=(f"{STEP_2}/rng.pt",)),
    Case("verify_old_marker", "verify",
         then(edit_marker(hash=..., hashes=...), lambda ws: ["checkpoint", "verify", str(ws.run)]), exit=0,
         message=r"OK   step_2/actor/__0_0\.distcp \(size only: no checksum recorded\).*checked by sizes only",
         may_change=(MARKER,)),
    Case("verify_nothing_there", "verify", lambda ws: ["checkpoint", "verify", str(ws.root / "nowhere")], exit=2,
         message=r"checkpoint .*nowhere does not exist"),
]

DIVERGENCE_CASES = [
    # (a resume cannot test this: a resumed run keeps the learning rate of its checkpoint's scheduler)
    Case("lr_1e6_diverges", "divergence", on_new("actor.optim.lr=1e6", "trainer.max_steps=9", "checkpoint.save_freq=1"),
         exit=1, message=r"diverged at step [3-6]: the policy is saturated: entropy .* of log\(vocabulary \d+\).*for 3 "
                         r"consecutive steps\. No checkpoint was written since step \d.*actor\.optim\.lr \(now 1e\+06\)",
         check=_diverged),
    Case("inf_weights_in_model", "divergence", then(_inf_in_model, on_new("trainer.max_steps=2")), exit=1,
         message=r"run stopped: the policy's logits hold NaN or infinity during generation"),
    Case("divergence_patience_zero", "divergence", on_new("trainer.divergence.patience=0"), exit=2,
         message=r"trainer\.divergence\.patience must be >= 1"),
    Case("negative_signal_grace", "signals", on_new("trainer.signal_grace_s=-1"), exit=2,
         message=r"trainer\.signal_grace_s must be a number of seconds >= 0"),
    Case("unknown_on_corrupt", "checksums", on_new("checkpoint.on_corrupt=ignore"), exit=2,
         message=r"checkpoint\.on_corrupt"),
]

MODEL_ONLY_CASES = [
    Case("model_only_auto_resume", "model_only", then(edit_marker(model_only=True), on_run("trainer.max_steps=3")),
         exit=2, message=r"holds weights-only checkpoints \(step_2.*checkpoint\.resume=never", may_change=(MARKER,)),
]

SLOW = {"sigint_mid_rollout", "second_sigterm_during_save", "sigterm_no_grace"}  # subprocesses
CASES = SIGNAL_CASES + CHECKSUM_CASES + DIVERGENCE_CASES + MODEL_ONLY_CASES


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.id in SLOW else [])
                                  for c in CASES])
def test_bad_run(case: Case, workspace: Workspace):
    run_case(case, workspace)


def test_model_only_start_over_keeps_the_old_metrics(workspace: Workspace, finished_run: Path):
    """checkpoint.resume=never in a directory of weights-only checkpoints: a new metrics.jsonl
    (step 1 once), the old one kept beside it; the weights-only checkpoint is not touched."""
    case = Case("model_only_start_over", "model_only",
                then(edit_marker(model_only=True), on_run("trainer.max_steps=1", "checkpoint.resume=never")), exit=0,
                message=r"kept as metrics\.jsonl\.prev", may_change=(MARKER, "metrics.jsonl", "config.yaml"),
                check=_fresh_metrics(finished_run / "metrics.jsonl"))
    run_case(case, workspace)


def test_weights_turned_infinite_by_an_update_stop_the_run(workspace: Workspace, monkeypatch):
    """An optimizer step that leaves a weight infinite (injected right after the real step) is
    reported by the workers' finiteness check after the update, and the run stops at that step,
    saving nothing."""
    import torch

    step = torch.optim.AdamW.step

    def step_then_poison(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].view(-1)[0] = math.inf
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_poison)
    case = Case("weights_inf_after_update", "divergence", on_run("trainer.max_steps=3"), exit=1,
                message=r"diverged at step 3: 1 trained weight tensor\(s\) hold NaN or infinity after the update",
                may_change=("metrics.jsonl", "config.yaml"), check=_no_new_checkpoint)
    run_case(case, workspace)


def test_the_table_has_its_categories():
    assert len(CASES) >= 20
    assert {c.category for c in CASES} >= {"signals", "checksums", "verify", "divergence", "model_only"}


@pytest.mark.slow
def test_sigterm_under_ray_leaves_no_ray_process(workspace: Workspace):
    """Under the Ray backend a SIGTERM stops the run the same way, and the Ray processes it
    started (every one names its session directory, here a private RAY_TMPDIR) are gone after."""
    import subprocess
    import tempfile
    import time

    with tempfile.TemporaryDirectory(prefix="fr", dir="/tmp") as ray_dir:  # short: Ray's socket paths
        case = Case("sigterm_under_ray", "signals",
                    on_new("trainer.max_steps=2", "trainer.backend=ray", "trainer.devices_per_node=1"),
                    subprocess=True, exit=143,
                    message=r"stopped by SIGTERM at step 1: emergency checkpoint of step 1 written",
                    env={**signals("update:1:TERM"), "RAY_TMPDIR": ray_dir})
        run_case(case, workspace)
        assert (Path(ray_dir) / "ray").is_dir()  # the run's Ray did use it
        for _ in range(50):  # the driver shut Ray down before it exited; allow the kernel a moment
            left = subprocess.run(["pgrep", "-f", ray_dir], capture_output=True, text=True).stdout.split()
            if not left:
                break
            time.sleep(0.2)
        assert not left, f"Ray processes left behind: {left}"
