"""What a rollout engine costs: the interface its planner implements and the registry it is kept in.

Each engine's planner lives beside the engine (``fitrl/rollout/<engine>_plan.py``) and registers
under the engine's own name (``rollout.engine``), so the memory model and the planner never
branch on an engine's name: they ask the engine's planner (docs/architecture.md, "Adding a
rollout engine"). ``tests/test_extension_points.py`` fails when a registered engine has no planner.

A planner answers, for a :class:`~fitrl.memory.run.Run`:

- which phases the engine adds (``weight_sync`` when it holds a copy of the weights of its own);
- what it holds inside a trainer rank's process in each phase (:meth:`EnginePlanner.in_trainer`);
- the processes of its own it runs beside the trainer ranks, and any host growth per step
  (:meth:`EnginePlanner.processes`);
- its lines in the plan's notes, and whether its load maps the checkpoint's pages;
- the changes the recommender may try on it (:meth:`EnginePlanner.candidates`), in the
  recommender's speed tiers (:data:`TIERS`).

:func:`active_phases` (the phases a run has) lives here, above the plan's types in
:mod:`.model`, because one of them is the engine's to say.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from fitrl.config.layout import run_layout
from fitrl.core.errors import ConfigError
from fitrl.core.registry import Registry
from fitrl.memory.change import Change
from fitrl.memory.model import PHASES, ROLE_PHASES, ProcessPlan, Usage

if TYPE_CHECKING:  # (fitrl.algo imports torch; the planner only holds its spec)
    from fitrl.algo import AlgorithmSpec
    from fitrl.config import FitrlConfig
    from fitrl.memory.model import Plan
    from fitrl.memory.run import Run

ENGINE_PLANNERS: Registry = Registry("rollout engine planner", "rollout.engine")

TIERS = ("faster", "slower", "cache")
"""Where an engine's candidate changes go in the recommender's speed order
(fitrl/planner/recommend.py): ``faster`` among the changes that speed the run up, ``slower`` with
the slight slow-downs before the batch halvings, ``cache`` after them (smaller caches)."""

EMULATED_ENGINE_KEYS = ("free_cache_engine", "separate_processes", "swap_space_gib")
"""``plan.emulate`` keys that describe another framework's vLLM engine on GPUs."""


class EnginePlanner:
    """The memory of one rollout engine; the defaults are an engine with no memory of its own
    beyond what the trained model holds (a subclass overrides what its engine adds)."""

    name = ""
    plans_lora = False
    """Its plan models LoRA's effect on generation (the recommender offers LoRA only then)."""

    def syncs_weights(self, cfg) -> bool:
        """The engine holds weights of its own, pushed after each update: a ``weight_sync`` phase."""
        return False

    def in_trainer(self, run: "Run", phase: str, usage: Usage, dev: str) -> None:
        """Add what the engine holds in a trainer rank's process in ``phase`` (``dev``: "gpu" or "host")."""

    def in_worker(self, run: "Run", phase: str, usage: Usage, dev: str) -> None:
        """Add a generation's working memory in a rollout worker of its own (``rollout.workers``:
        fitrl/roles/rollout_worker.py), which holds a whole copy of the weights."""
        raise ConfigError(f"rollout.engine={self.name} has no plan for rollout workers of its own (rollout.workers)")

    def worker_copy(self, run: "Run") -> Optional[int]:
        """An engine with a copy of the weights of its own, in a rollout worker: the bytes it holds
        on the worker's device through the whole run (its weights, its cache). None: the engine
        computes with the worker's module, whose weights are the role's states."""
        return None

    def worker_host(self, run: "Run") -> dict[str, int]:
        """Host memory such an engine holds in a rollout worker in every phase, beyond
        :meth:`worker_copy` (its runtime, on a GPU run)."""
        return {}

    def processes(self, run: "Run", notes: list[str]) -> tuple[list[ProcessPlan], int]:
        """Processes of its own beside the trainer ranks, and the host bytes a node gains per step."""
        unused_engine_emulation(run, notes, f"rollout.engine={self.name}")
        return [], 0

    def notes(self, run: "Run") -> list[str]:
        """Its lines in the plan's notes."""
        return []

    def lora_note(self, run: "Run") -> str:
        """What the LoRA note adds about this engine ("" for nothing)."""
        return ""

    def maps_checkpoint(self, run: "Run") -> bool:
        """Loading the engine maps the checkpoint file (its pages counted once per node)."""
        return False

    def candidates(self, plan: "Plan", tier: str) -> list[Change]:
        """Changes the recommender may try, for ``tier`` (:data:`TIERS`)."""
        return []


def engine_planner(cfg, where: str = "trainer") -> EnginePlanner:
    """The planner of the engine the policy's ranks run (``where="trainer"``:
    ``rollout.trainer_engine``) or a rollout worker of its own runs (``"worker"``:
    ``rollout.engine``); a :class:`~fitrl.core.errors.ConfigError` naming the registered ones when
    it has none (fitrl/rollout/__init__.py registers the built-in ones)."""
    r = cfg.rollout
    return ENGINE_PLANNERS.get(r.engine if where == "worker" else getattr(r, "trainer_engine", r.engine))()


def unused_engine_emulation(run: "Run", notes: list[str], where: str) -> None:
    """``plan.emulate``'s engine behaviours describe another framework's vLLM engine on GPUs; an
    engine planner that does not read them says so rather than plan as if they held."""
    em, default = run.cfg.plan.emulate, type(run.cfg.plan.emulate)()
    keys = [k for k in EMULATED_ENGINE_KEYS if getattr(em, k) != getattr(default, k)]
    if keys:
        notes.append(f"{', '.join('plan.emulate.' + k for k in keys)} ignored with {where}: they emulate another "
                     "framework's vLLM engine on GPUs")


def active_phases(cfg: FitrlConfig, spec: AlgorithmSpec) -> list[str]:
    """The phases a run has (no reference phase without KL, no teacher's without distillation, no
    weight sync for an engine without weights of its own ...), in :data:`~fitrl.memory.model.PHASES` order."""
    ck = getattr(cfg, "checkpoint", None)
    reward = getattr(cfg, "reward", None)  # a reward model's or a judge's phase: only with one
    skip = {"reward": reward is None or not any(s.kind != "function" for s in reward.sources.values()),
            "ref_logprob": not spec.reference,
            "old_logprob": cfg.old_logprob_source != "pass",
            "weight_sync": not (engine_planner(cfg).syncs_weights(cfg) or getattr(cfg.rollout, "workers", 0)),
            "validation": not cfg.data.val_files,
            "checkpoint_save": ck is None or not (ck.save_freq or ck.save_final)}
    layout = run_layout(cfg)  # a role's own phase (the teacher's) where the run builds it
    skip.update({ph: not layout.builds(role) for ph, role in ROLE_PHASES.items()})
    return [ph for ph in PHASES if not skip.get(ph, False)]
