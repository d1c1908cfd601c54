"""The planned roles and processes are the built ones (fitrl/config/layout.py).

Each case runs ``fitrl.trainer.run._train_once`` up to where the trainer would be made, with
``make_group`` recording what it is asked to build (no model loads, no process starts), and
plans the same config in the mode ``_train_once`` handed the pre-flight plan: every role
planner's ``built`` (fitrl/memory/roles.py), and under Ray the plan's processes of their own,
must name exactly the groups built, and the trainer must get those groups (or, for LoRA's
reference, the policy); ``check_gpu_count`` must ask for exactly the devices they take. Every
example config is walked, and a matrix of the options that decide which roles a run builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, toy_config
from rich.console import Console

import fitrl.trainer.run as run_mod
from fitrl.config import ConfigError, load_config
from fitrl.config.choices import algorithm_needs
from fitrl.config.layout import run_layout
from fitrl.memory.model import Hardware
from fitrl.memory.roles import ROLE_PLANNERS
from fitrl.memory.run import Run
from fitrl.models.shape import ModelShape
from fitrl.planner import plan_config
from fitrl.trainer.sft import supervised_config

HOST = 64 * 2**30  # (the roles planned do not depend on the memory; a fixed figure keeps plans machine-independent)


class GroupsBuilt(Exception):
    """Raised where the trainer would be made, once the groups are built: the run goes no further."""

    def __init__(self, trainer: str, handles: dict):
        super().__init__(trainer)
        self.trainer, self.handles = trainer, handles


@dataclass
class Built:
    role: str
    name: str
    colocated_with: str | None
    ranks: int  # as make_group sizes a Ray group: the policy's world, or rollout.workers for the rollout workers


class FakeHandle:
    def __init__(self, role: str):
        self.role, self.group = role, object()

    def num_parameters(self) -> int:
        return 0


class FakeReward:
    """RewardSources without its scorers: what the run attaches to it."""
    attached: dict = {}

    def __init__(self, cfg, agent_reward: str = ""):
        FakeReward.attached = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def attach(self, reward_models, judges) -> None:
        FakeReward.attached = {"reward_model": reward_models, "judge": judges}


@pytest.fixture
def built_groups(monkeypatch):
    """Patches the run so that ``_train_once`` records its groups and stops once they are built;
    returns (groups built, what pre-flight was asked to plan)."""
    built: list[Built] = []
    planned: dict = {}

    def make_group(role, cfg, name, stack, colocate_with=None, models=None):
        built.append(Built(role, name, colocate_with.role if colocate_with else None,
                           cfg.rollout.workers if role == "rollout" else cfg.world_size))
        return FakeHandle(role)

    def preflight(cfg, console=None, supervised=False, models=None):
        planned.update(cfg=cfg, supervised=supervised)
        return None

    def trainer(name):
        def stop(cfg, **kwargs):
            raise GroupsBuilt(name, {k: kwargs.get(k) for k in ("policy", "ref", "critic", "rollout")})
        return stop

    for name, value in {"make_group": make_group, "preflight": preflight, "RewardSources": FakeReward,
                        "check_model_configs": lambda cfg, configs=None: None, "check_installed": lambda loggers: None,
                        "check_run_models": lambda cfg, configs=None: SimpleNamespace(pad_token_id=0),
                        "check_agent": lambda cfg, tok: None, "check_reward_sources": lambda cfg, models=None: None,
                        "build_datasets": lambda cfg, tok, models=None: (None, None), "check_shared": lambda path, group: None,
                        "RLTrainer": trainer("rl"), "SFTTrainer": trainer("supervised"),
                        # (the start-up line names the device: a CUDA config is described, not run, here)
                        "resolve_device": lambda device: torch.device("cpu" if device == "auto" else device)}.items():
        monkeypatch.setattr(run_mod, name, value)
    return built, planned


def check_built_is_planned(cfg, supervised: bool, built: list[Built], planned: dict, model_dir) -> None:
    cfg.memory.plan, cfg.trainer.num_threads = "off", 0  # (this process's torch threads stay as they are)
    if supervised:
        supervised_config(cfg)  # what `fitrl sft` does before the run (fitrl/trainer/run.py, _train_restarting)
    with pytest.raises(GroupsBuilt) as stopped:
        run_mod._train_once(cfg, Console(quiet=True), {}, supervised=supervised)
    names = [b.role for b in built]
    assert planned["supervised"] == supervised and planned["cfg"] is cfg
    assert stopped.value.trainer == ("supervised" if supervised else "rl")

    # the role planners, on the run the pre-flight plan is made for
    hw = Hardware.for_config(cfg, host_memory=HOST)
    plan_cfg = cfg.with_device_defaults(hw.device)
    run = Run(plan_cfg, hw, ModelShape.from_path(model_dir), None, algorithm_needs(plan_cfg),
              supervised=planned["supervised"])
    assert [p.name for p in ROLE_PLANNERS.in_order() if p.built(run)] == names

    # the plan itself: under Ray a process kind per role of its own, the rollout workers' count
    plan = plan_config(cfg, hw, supervised=planned["supervised"])
    assert plan.layout == run_layout(cfg, supervised)
    kinds = {p.kind: p.per_node for p in plan.processes if p.kind in ROLE_PLANNERS.names()}
    if cfg.trainer.backend == "ray":
        assert set(kinds) == {n for n in names if ROLE_PLANNERS.get(n).own_process}
        if "rollout" in names:
            assert kinds["rollout"] == next(b.ranks for b in built if b.role == "rollout")
    else:
        assert kinds == {}  # one process holds every role

    # what stands in is the policy, and the reward's model roles are the groups built
    layout = plan.layout
    for role in layout.roles:
        assert (role.name in names) == role.own_model
    handles = stopped.value.handles
    for name in ("ref", "critic", "rollout"):  # the trainer gets the groups built, or what stands in
        role = layout.role(name)
        assert (handles[name] is None) == (role is None)
        if role is not None:
            assert handles[name].role == role.model
    ref = layout.role("ref")
    if ref is not None and not ref.own_model:
        assert cfg.actor.lora.enabled and ref.model == "actor" and handles["ref"] is handles["policy"]
    for name in ("reward_model", "judge"):
        assert (FakeReward.attached[name] is not None) == (name in names)
    assert all(b.colocated_with == ("actor" if b.role not in ("actor", "rollout") else None) for b in built)

    # the devices a Ray cluster must have: the policy's world and each group's on devices of its own
    if cfg.trainer.backend == "ray":
        need = sum(b.ranks for b in built if b.colocated_with is None)
        run_mod.check_gpu_count(cfg, need, supervised)
        with pytest.raises(ConfigError):
            run_mod.check_gpu_count(cfg, need - 1, supervised)


# ------------------------------------------------------------------------------------------------
# every example config, pointed at the tiny model

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def local_models(cfg, model_dir: Path) -> None:
    """Every model directory of ``cfg`` the tiny model: the roles a run builds do not depend on it."""
    cfg.actor.model.path = str(model_dir)
    if cfg.ref.model is not None and cfg.ref.model.path:
        cfg.ref.model.path = str(model_dir)
    if cfg.teacher.model is not None and cfg.teacher.model.path:
        cfg.teacher.model.path = str(model_dir)
    for src in cfg.reward.sources.values():
        if src.kind != "function":
            src.model.path = str(model_dir)


@pytest.mark.parametrize("extra", [[], ["rollout.workers=2"], ["rollout.workers=2", "trainer.val_only=true"],
                                   ["trainer.backend=ray", "trainer.devices_per_node=2", "rollout.workers=2"]],
                         ids=["as-is", "workers", "val_only-workers", "ray-workers"])
@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_builds_what_it_plans(example, extra, tiny_model_dir, tmp_path, built_groups):
    supervised = example.stem.endswith("_sft")  # run by `fitrl sft`
    cfg = load_config(str(example), [f"trainer.run_dir={tmp_path / 'run'}", *extra])
    local_models(cfg, tiny_model_dir)
    check_built_is_planned(cfg, supervised, *built_groups, tiny_model_dir)


# ------------------------------------------------------------------------------------------------
# the options that decide the roles, on the toy config

RAY = ["trainer.backend=ray", "trainer.devices_per_node=2"]
ROLLOUT = {"colocated": [], "workers": ["rollout.workers=2"],
           "one_step_off": ["rollout.workers=2", "rollout.mode=one_step_off"],
           "async": ["rollout.workers=2", "rollout.mode=async"]}
MODES = {"rl": (False, []), "val_only": (False, ["trainer.val_only=true"]), "supervised": (True, [])}
ROLES = {"lora-kl": ["actor.lora.rank=8", "algorithm.use_kl_loss=true"],  # the policy stands in for the reference
         "kl": ["algorithm.use_kl_loss=true"],
         "ppo": ["algorithm.adv_estimator=gae"],
         "reward-model": ["reward.sources.rm.kind=model", "reward.sources.rm.model.path={model}"],
         "judge": ["reward.sources.j.kind=judge", "reward.sources.j.model.path={model}"],
         "vllm": ["rollout.engine=vllm"]}  # (configs only: nothing loads, so vLLM need not be installed)

BACKENDS = {"inprocess": [], "ray": RAY}
# every backend, mode and way of generating; then each role-deciding option with rollout workers in
# every backend and mode, and without them under Ray
CASES = {f"{backend}-{mode}-{rollout}": (MODES[mode][0], [*BACKENDS[backend], *MODES[mode][1], *ROLLOUT[rollout]])
         for backend in BACKENDS for mode in MODES for rollout in ROLLOUT}
CASES.update({f"{role}-{backend}-{mode}-workers": (MODES[mode][0], [*BACKENDS[backend], *MODES[mode][1],
                                                                    *ROLES[role], *ROLLOUT["one_step_off"]])
              for role in ROLES for backend in BACKENDS for mode in MODES})
CASES.update({f"{role}-ray-rl-colocated": (False, [*RAY, *ROLES[role]]) for role in ROLES})


@pytest.mark.parametrize("case", list(CASES))
def test_options_build_what_they_plan(case, tiny_model_dir, tmp_path, built_groups):
    supervised, overrides = CASES[case]
    cfg = toy_config(tiny_model_dir, tmp_path / "run", "trainer.device=cpu", "trainer.val_before_train=false",
                     *(o.format(model=tiny_model_dir) for o in overrides))
    check_built_is_planned(cfg, supervised, *built_groups, tiny_model_dir)


def test_the_layout_of_a_run_without_workers_it_would_not_start():
    """val_only and `fitrl sft` start no rollout workers: the layout says so, and the device count."""
    cfg = load_config(str(ROOT / "examples" / "arith.yaml"), [*RAY, "rollout.workers=2", "algorithm.use_kl_loss=true"])
    rl, val = run_layout(cfg), run_layout(load_config(str(ROOT / "examples" / "arith.yaml"),
                                                      [*RAY, "rollout.workers=2", "trainer.val_only=true"]))
    sft = run_layout(cfg, supervised=True)
    assert (rl.mode, val.mode, sft.mode) == ("rl", "validation", "supervised")
    assert rl.rollout.count == 2 and rl.rollout.engine == "hf" and rl.devices == 4 and rl.world_size == 2
    assert val.rollout is None and sft.rollout is None and val.devices == sft.devices == 2
    assert [r.name for r in rl.roles] == ["actor", "ref", "rollout"] and [r.name for r in sft.roles] == ["actor"]
    assert rl.reward == {"function": ("",)} and rl.device is None
