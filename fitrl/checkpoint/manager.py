"""The driver's side of checkpoints: when to save, what goes in, what a resume restores.

A checkpoint ``RUN/checkpoints/step_N`` holds::

    COMPLETE             written last (see fitrl.checkpoint.layout): step, world size, files + sizes;
                         only once every rank's files are found here (fitrl.checkpoint.ranks)
    config.yaml          the resolved config of the run that saved it
    trainer_state.json   the trainer step, the data sampler's position, the KL coefficient,
                         Python's and NumPy's RNG states
    rng.pt               the driver's torch RNG states
    hf/                  config.json, generation_config.json and tokenizer files of the actor's
                         model directory: what `fitrl export` needs besides the weights
    actor/, critic/      each trained role's sharded state (fitrl.checkpoint.sharded)

The reference model is not saved: it is frozen and rebuilt from its path. Nor is a LoRA
policy's frozen base (``actor.lora.rank > 0``): ``actor/`` holds the adapters and their optimizer
state, and the marker says so (``adapter_only``, the adapters' settings, the base's directory)
for the resume check and for ``fitrl export``.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from rich.console import Console

from fitrl.checkpoint import disk, layout, ranks, rng
from fitrl.checkpoint.layout import Checkpoint, CheckpointError
from fitrl.config import ConfigError, FitrlConfig, config_to_dict, save_config
from fitrl.core.errors import CheckpointUsageError, Hung, Interrupted, RunDirError, RunStopped, UserError, WorkerFailed
from fitrl.core.nested import flatten
from fitrl.config.schema import DistillConfig, LoRAConfig, RolloutCorrectionConfig, TeacherConfig

# Settings that may change between a checkpoint and its resume without changing what the run
# computes (beyond float rounding): sizes of the work per forward, where and on how many ranks
# it runs, how long it goes on, logging, validation, and checkpointing itself. Model paths may
# move; the weights' names and shapes are checked when they are loaded.
RESUME_SAFE = [
    "trainer.max_steps", "trainer.backend", "trainer.nnodes", "trainer.devices_per_node", "trainer.ray_address",
    "trainer.num_threads", "trainer.device", "trainer.output_dir", "trainer.experiment_name", "trainer.run_dir",
    "trainer.val_*", "trainer.log_freq", "trainer.progress_bar", "checkpoint.*", "*.fsdp.*",
    "data.val_files", "data.val_batch_size", "reward.num_workers", "reward.timeout", "rollout.val.*",
    "*micro_batch_size", "*micro_batch_token_budget", "actor.logprob_chunk_size",
    "*.model.path", "*.model.tokenizer_path", "*.model.gradient_checkpointing", "*.model.attn_implementation",
    "memory.*",  # planning, telemetry and guard settings never change what is trained
    "plan.*",    # what-if inputs of the planner; a checkpoint saved before the section existed has none
    "trainer.peak_flops", "data.source_key", "reward.correct_key", "reward.correct_threshold",  # metrics only
    "trainer.divergence.*", "trainer.signal_grace_s",  # when a run stops, never what it trains
]  # actor.lora.* is not here: adapters of another rank, targets or scale are another model
# Sections added after checkpoints were written: a checkpoint without one was saved with its defaults.
ADDED_SECTIONS = {"actor.lora": LoRAConfig, "algorithm.rollout_correction": RolloutCorrectionConfig,
                  "algorithm.distill": DistillConfig, "teacher": TeacherConfig}
NOT_STORAGE = (UserError, RunStopped, WorkerFailed, Interrupted, Hung, KeyboardInterrupt, SystemExit)
"""Errors of a save that say what happened themselves: never read as the storage's fault."""
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.h5", "*.msgpack", "*.index.json")


class CheckpointManager:
    def __init__(self, cfg: FitrlConfig, run_dir: Path, console: Console):
        self.cfg, self.ckpt, self.run_dir, self.console = cfg, cfg.checkpoint, Path(run_dir), console
        self.root = self.run_dir / layout.CHECKPOINTS
        self.last_save_s: Optional[float] = None  # this run's latest save: how long an emergency save takes

    # ------------------------------------------------------------------ resuming

    def resume_point(self) -> Optional[Checkpoint]:
        """The checkpoint this run continues from (``checkpoint.resume``), config-checked; None
        to start at step 0. Interrupted saves in this run's directory are deleted after that
        check (the caller holds the run directory's lock): a run refused for its config changes
        nothing in the directory."""
        point = self._choose_resume_point()
        removed = layout.clean_partial(self.root)
        if removed:
            self.console.print(f"checkpoint: removed {len(removed)} incomplete save(s) left by an interrupted run: "
                               f"{', '.join(removed)}", highlight=False)
        return point

    def _choose_resume_point(self) -> Optional[Checkpoint]:
        stray = layout.incomplete(self.root)
        if stray:
            self.console.print(f"checkpoint: {', '.join(d.name for d in stray)} in {self.root}: no readable "
                               f"{layout.MARKER} marker, so not a complete checkpoint (a copy cut short, or a marker "
                               "removed by hand); left as it is", highlight=False)
        spec = self.ckpt.resume
        if spec == "never" or (spec == "auto" and not self.cfg.trainer.run_dir):
            return None
        if spec == "auto":
            found = layout.list_complete(self.root)
            if stray and not found:
                # starting at step 0 would replace it when the run reaches its step
                raise CheckpointError(f"{stray[-1]} has no readable {layout.MARKER} marker and {self.root} holds no "
                                      "complete checkpoint: not resuming from it, nor starting over on top of it. If "
                                      "it was copied, copy it again whole; otherwise move it away, or start over with "
                                      "checkpoint.resume=never")
            resumable = [c for c in found if not c.model_only]
            if not resumable:
                if found:
                    # Starting at step 0 here would append a second step 1, 2, ... to metrics.jsonl
                    # and replace these checkpoints (the weights this run was asked to keep) as the
                    # new run reaches their steps: a re-run of the same command must not do that
                    # silently, so the user picks what they meant.
                    raise ConfigError(
                        f"trainer.run_dir={self.run_dir} holds weights-only checkpoints ({found[-1].path.name}, saved "
                        "with checkpoint.model_only=true: no optimizer, data position or RNG states), which cannot be "
                        "resumed. To start over in this directory add checkpoint.resume=never (a new metrics.jsonl; "
                        "its checkpoints are replaced as the new run reaches their steps); to train on from those "
                        "weights, `fitrl export` the checkpoint and start a run in a new trainer.run_dir with "
                        "actor.model.path set to the export")
                return None
            point = self._first_intact(list(reversed(resumable)))
        else:
            point = layout.find(spec, verify=False)  # damage is handled below, as for auto
            if point.model_only:
                raise CheckpointUsageError(f"checkpoint {point.path} holds weights only (saved with "
                                           "checkpoint.model_only=true) and cannot be resumed; export it with "
                                           "`fitrl export` and start a new run from the exported directory")
            earlier = [c for c in layout.list_complete(point.path.parent) if c.step < point.step and not c.model_only]
            point = self._first_intact([point, *reversed(earlier)])
        self._check_config(point)
        self._check_parameters(point)  # before any model loads, whatever strict_config let through
        newer = [c.path.name for c in layout.list_complete(self.root) if c.step > point.step]
        if newer:
            self.console.print(f"checkpoint: {', '.join(newer)} in {self.root} are newer than the resume point; "
                               "they will be replaced as this run reaches their steps", highlight=False)
        return point

    def _first_intact(self, candidates: list[Checkpoint]) -> Checkpoint:
        """The first of ``candidates`` (newest first) whose files match their marker (sizes and
        checksums) and hold every rank's files (fitrl/checkpoint/ranks.py). A damaged one is
        refused, naming the file, unless ``checkpoint.on_corrupt=previous``: then it is reported
        and the next one tried."""
        for i, candidate in enumerate(candidates):
            try:
                point = layout.read(candidate.path)
                ranks.check_checkpoint(point.path, point.meta)  # files of every rank, listed in the marker or not
                return point
            except CheckpointError as e:
                if self.ckpt.on_corrupt != "previous":
                    raise CheckpointError(f"{e}; not resuming from it: checkpoint.on_corrupt=previous resumes from the "
                                          "newest earlier intact checkpoint instead, checkpoint.resume=never starts "
                                          "over") from None
                rest = candidates[i + 1:]
                self.console.print(f"checkpoint: {candidate.path.name} is damaged: {e}; "
                                   + (f"resuming from the previous complete checkpoint, {rest[0].path.name}, instead "
                                      "(checkpoint.on_corrupt=previous)" if rest else "no earlier complete checkpoint"),
                                   highlight=False)
        raise CheckpointError(f"no intact checkpoint to resume in {candidates[0].path.parent}: every complete one is "
                              "damaged (above); checkpoint.resume=never starts over")

    def _check_config(self, point: Checkpoint) -> None:
        path = point.path / "config.yaml"
        if not path.is_file():
            raise CheckpointError(f"checkpoint {point.path} has no config.yaml")
        saved = flatten(yaml.safe_load(path.read_text()) or {})
        for section, schema in ADDED_SECTIONS.items():
            if not any(k.startswith(section + ".") for k in saved):
                saved.update(flatten(config_to_dict(schema()), section + "."))
        now = flatten(config_to_dict(self.cfg))
        changed = [(k, saved.get(k, "(unset)"), now.get(k, "(unset)")) for k in sorted(set(saved) | set(now))
                   if not _same(k, saved.get(k, "(unset)"), now.get(k, "(unset)"))
                   # a resume-safe key added since the checkpoint was saved is no change worth a line
                   and not (k not in saved and any(fnmatch.fnmatchcase(k, p) for p in RESUME_SAFE))]
        unsafe = [c for c in changed if not any(fnmatch.fnmatchcase(c[0], p) for p in RESUME_SAFE)]
        text = ", ".join(f"{k} {old!r} -> {new!r}" for k, old, new in (unsafe or changed))
        if unsafe and self.ckpt.strict_config:
            raise ConfigError(f"checkpoint {point.path} was saved with a different config ({path}): {text}. Resume "
                              "with the saved settings, start over with checkpoint.resume=never, or accept the "
                              "change with checkpoint.strict_config=false")
        if changed:
            self.console.print(f"checkpoint: resuming with changed settings: {text}", highlight=False)

    def carry_metrics(self, point: Checkpoint) -> list[dict[str, float]]:
        """Make this run's metrics.jsonl the checkpoint run's records up to its step (dropping
        what an interrupted run wrote after it) and return the per-step history they hold."""
        dst = self.run_dir / "metrics.jsonl"
        src = point.run_dir / "metrics.jsonl" if point.run_dir else None
        if src is None or not src.is_file():  # a checkpoint copied away from its run: keep this run's records
            src = dst
        kept: list[dict] = []
        if src.is_file():
            lines = src.read_text().splitlines()
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:  # the last line may have been cut by a kill
                    continue
                if record.get("step", 0) <= point.step:
                    kept.append(record)
            if len(lines) > len(kept):
                self.console.print(f"metrics: dropped {len(lines) - len(kept)} record(s) written after step "
                                   f"{point.step} by the interrupted run", highlight=False)
        tmp = dst.with_name(dst.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, dst)
        # the per-step history (validation-only records, e.g. step 0's, and events are not steps)
        return [{k: v for k, v in r.items() if k != "step"} for r in kept
                if r.get("step", 0) >= 1 and "event" not in r
                and any(k != "step" and not k.startswith("val/") for k in r)]

    def restart_metrics(self) -> None:
        """A run starting at step 0 in a directory that holds an earlier ``metrics.jsonl``
        (``checkpoint.resume=never``, or a run stopped before its first checkpoint) gets a file
        of its own: appending would list steps 1, 2, ... twice. The old file is kept beside it."""
        path = self.run_dir / "metrics.jsonl"
        if path.is_file() and path.stat().st_size:
            kept = path.with_name("metrics.jsonl.prev")
            os.replace(path, kept)
            self.console.print(f"metrics: this run starts at step 0; the earlier {path.name} of this directory is "
                               f"kept as {kept.name}", highlight=False)

    def restore(self, point: Checkpoint, roles: dict[str, Any], *, weights_only: bool = False) -> Optional[dict]:
        """Load every role's state (on its ranks) and return the driver's state (None when
        ``weights_only``); the driver's RNGs are restored here."""
        self._check_parameters(point)
        for name, role in roles.items():
            if not (point.path / name).is_dir():
                raise CheckpointUsageError(f"checkpoint {point.path} has no {name}/ (saved without a {name}); "
                                           "resume with the settings it was saved with")
            role.load_checkpoint(str(point.path / name), weights_only)
        if weights_only:
            self.console.print(f"checkpoint: loaded the weights of {point.path} (step {point.step})", highlight=False)
            return None
        state = json.loads((point.path / "trainer_state.json").read_text())
        rng.set_python_numpy_state(state.pop("rng"))
        rng.set_torch_state(torch.load(point.path / "rng.pt", weights_only=True))
        saved_ws = point.meta.get("world_size")
        if saved_ws is not None and saved_ws != self.cfg.world_size:
            self.console.print(f"checkpoint: saved by {saved_ws} rank(s), resumed on {self.cfg.world_size}: the "
                               "weights and optimizer state are resharded; sampling streams differ per rank, so the "
                               "run continues statistically, not bit for bit", highlight=False)
        self.console.print(f"checkpoint: resumed from {point.path} (step {point.step})", highlight=False)
        return state

    def _check_parameters(self, point: Checkpoint) -> None:
        """A LoRA checkpoint (adapters only) resumes only a LoRA policy and a full one only full
        fine-tuning, whatever ``checkpoint.strict_config`` lets through."""
        lora = self.cfg.actor.lora
        if point.adapter_only == lora.enabled:
            return
        saved = (f"LoRA adapters only (actor.lora.rank={point.meta.get('lora', {}).get('rank')})"
                 if point.adapter_only else "the full policy (actor.lora.rank=0)")
        raise CheckpointUsageError(f"checkpoint {point.path} holds {saved} but this run has "
                                   f"actor.lora.rank={lora.rank}: resume with the actor.lora settings it was saved "
                                   "with, or start over with checkpoint.resume=never")

    # ------------------------------------------------------------------ saving

    def due(self, step: int) -> bool:
        f = self.ckpt.save_freq
        if step == self.cfg.trainer.max_steps:
            return self.ckpt.save_final or bool(f and step % f == 0)
        return bool(f and step % f == 0)

    def save(self, step: int, roles: dict[str, Any], trainer_state: dict, metrics: dict[str, float]) -> Path:
        """Write ``step_<step>`` atomically, then apply ``save_limit`` / ``keep_best``."""
        start = time.perf_counter()
        tmp = layout.begin(self.root, step)
        try:
            for name, role in roles.items():  # every rank writes its own shards into tmp/<name>
                role.save_checkpoint(str(tmp / name), self.ckpt.model_only)
            self._check_ranks(step, tmp, roles)  # before the marker: it lists what is here, not what should be
            save_config(self.cfg, str(tmp / "config.yaml"))
            (tmp / "trainer_state.json").write_text(json.dumps({**trainer_state, "rng": rng.python_numpy_state()}))
            torch.save(rng.torch_state(), tmp / "rng.pt")
            copy_hf_files(self.cfg, tmp / "hf")
            best = self.ckpt.keep_best
            meta = {"step": step, "world_size": self.cfg.world_size, "roles": list(roles),
                    "role_world_sizes": {name: role.world_size for name, role in roles.items()},
                    "model_only": self.ckpt.model_only, **adapter_meta(self.cfg),
                    "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "metrics": {best: metrics[best]} if best and best in metrics else {}}
            final = layout.finalize(tmp, meta)
        except BaseException as e:
            # An exception (not a kill): remove the partial save now rather than at the next start;
            # a full disk is told from the directory's free space before that frees it (disk.py).
            storage = None if isinstance(e, NOT_STORAGE) else disk.storage_failure(e, tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            if storage is None:
                raise
            raise RunDirError(self._not_saved(step, storage)) from e
        pruned = layout.prune(self.root, self.ckpt.save_limit, self.ckpt.keep_best, self.ckpt.keep_best_mode, final)
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file()) / 2**20
        note = f"; removed {', '.join(p.name for p in pruned)}" if pruned else ""
        self.last_save_s = time.perf_counter() - start
        self.console.print(f"checkpoint: {final} ({size:.1f} MiB in {self.last_save_s:.2f} s){note}",
                           highlight=False)
        return final

    def _not_saved(self, step: int, storage: str) -> str:
        """The one line of a save the storage refused: what it did, that nothing was lost, the fix."""
        previous = layout.list_complete(self.root)
        kept = (f"the newest checkpoint is still {previous[-1].path}, untouched (run the same command again to resume "
                f"from it)" if previous else "no earlier checkpoint exists")
        size = (f" (a checkpoint of this run takes {sum(previous[-1].meta.get('files', {}).values()) / 2**20:.1f} "
                f"MiB)" if previous else "")
        fewer = "" if self.ckpt.save_limit or len(previous) < 2 else ", or keep fewer with checkpoint.save_limit"
        return (f"checkpoint of step {step} not saved: {storage} in {self.root}; the partial save was removed and "
                f"{kept}. Free space there{size}{fewer}, or set trainer.run_dir to a disk with room")

    def _check_ranks(self, step: int, tmp: Path, roles: dict[str, Any]) -> None:
        """Every rank of every role left its files in ``tmp``, the directory this driver (and a
        resume) reads. A rank on a node whose ``trainer.run_dir`` is a disk of its own writes them
        there instead: marked complete, this checkpoint would hold part of the model."""
        missing = []
        for name, role in roles.items():
            missing += ranks.missing_in_role(tmp, name, role.world_size, role_state=not self.ckpt.model_only)
        if not missing:
            return
        groups = ranks.by_owner(missing)
        (role, rank), files = next(iter(groups.items()))
        others = [f"{r} rank {k}" for r, k in list(groups)[1:]]
        more = (f"; nor has it those of {', '.join(others[:8])}{' ...' if len(others) > 8 else ''}" if others else "")
        previous = layout.list_complete(self.root)
        kept = f"the newest checkpoint is still {previous[-1].path}" if previous else "no earlier checkpoint exists"
        lacks = ", ".join(Path(m.file).name + ("" if m.status == "missing" else f" ({m.status})") for m in files)
        raise RunDirError(
            f"checkpoint of step {step} not saved: the files of {role} rank {rank} ({_node_of(roles.get(role), rank)}) "
            f"are not where the driver (host {socket.gethostname()}) and a resume read them: {tmp / role} lacks "
            f"{lacks}{more}. trainer.run_dir must be one filesystem shared by every node (NFS, Lustre, ...), mounted "
            f"at the same path; the partial save was removed, {kept}")


def _node_of(role: Any, rank: Optional[int]) -> str:
    """Where a rank runs, as its group knows it: a Ray rank's node IP, else this process's host."""
    ips = getattr(getattr(role, "group", None), "node_ips", None)
    if ips and rank is not None and rank < len(ips):
        return f"node {ips[rank]}"
    return f"host {socket.gethostname()}" if rank == 0 and not ips else "node unknown"


def adapter_meta(cfg: FitrlConfig) -> dict:
    """What the marker says about the actor's weights: with LoRA, that they are the adapters only,
    their settings, and the base's directory (absolute: ``fitrl export`` may run elsewhere)."""
    lora = cfg.actor.lora
    if not lora.enabled:
        return {"adapter_only": False}
    return {"adapter_only": True, "base_model": str(Path(cfg.actor.model.path).resolve()),
            "lora": {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                     "target_modules": list(lora.target_modules)}}


def copy_hf_files(cfg: FitrlConfig, dest: Path) -> None:
    """Everything in the actor's model (and tokenizer) directory except the weights."""
    dest.mkdir(parents=True, exist_ok=True)
    model = cfg.actor.model
    for source in filter(None, [model.path, model.tokenizer_path]):
        for f in sorted(Path(source).iterdir()):
            if f.is_file() and not any(fnmatch.fnmatch(f.name, p) for p in WEIGHT_FILES):
                shutil.copy2(f, dest / f.name)


def _same(key: str, old: Any, new: Any) -> bool:
    """Equal settings; data files count as equal when they are the same files (a relative and
    an absolute path to one file, as the same command run from another directory gives)."""
    if old == new:
        return True
    if key.endswith("_files") and isinstance(old, list) and isinstance(new, list):
        return [os.path.realpath(p) for p in old] == [os.path.realpath(p) for p in new]
    return False
