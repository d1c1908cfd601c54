"""Every extension owns its whole footprint (fitrl/planner/complete.py): a registered rollout
engine has its memory planner beside it, under the same name, and a plan of a run on it includes
what its planner says it holds. A dummy engine shows the check can fail, then pass."""

import pytest

import fitrl.rollout  # noqa: F401  (registers the built-in engines)
from fitrl.memory import calibration as C
from fitrl.memory.engines import ENGINE_PLANNERS, EnginePlanner
from fitrl.memory.model import PHASES, ProcessPlan, Usage
from fitrl.planner import Hardware, plan_config
from fitrl.config import ConfigError
from fitrl.planner.complete import missing_counterparts
from fitrl.rollout.engine import ROLLOUT_ENGINES, RolloutEngine
from helpers import toy_config


class DummyEngine(RolloutEngine):
    @classmethod
    def from_config(cls, model, tokenizer, cfg, **kw):
        return cls()

    def generate(self, prompts, sampling):
        raise NotImplementedError


class DummyPlanner(EnginePlanner):
    """An engine with a 1 GiB cache in the trainer while it generates and a process of its own."""
    name = "dummy"

    def syncs_weights(self, cfg) -> bool:
        return True

    def in_trainer(self, run, phase, usage, dev):
        if phase in ("rollout", "validation"):
            usage.add(dev, "dummy cache", C.GIB)

    def processes(self, run, notes):
        phases = {ph: Usage() for ph in PHASES}
        for u in phases.values():
            u.add("host", "dummy server", 2 * C.GIB)
        return [ProcessPlan("dummy", 1, phases)], 0


@pytest.fixture
def dummy_engine():
    ROLLOUT_ENGINES.add("dummy", DummyEngine)
    yield
    ROLLOUT_ENGINES.remove("dummy")
    if "dummy" in ENGINE_PLANNERS:
        ENGINE_PLANNERS.remove("dummy")


def test_every_builtin_engine_has_its_planner():
    assert missing_counterparts() == []
    assert ROLLOUT_ENGINES.names() == ["hf", "vllm"]


def test_the_engine_choice_is_the_registry(dummy_engine, tiny_model_dir, tmp_path):
    """rollout.engine is checked against the registered engines when the config loads (no second
    list of names in the schema): a new engine is a valid choice once registered."""
    with pytest.raises(ConfigError, match=r"unknown rollout engine rollout.engine='vlm'; did you mean 'vllm'\? "
                                          r"\(valid: dummy, hf, vllm\)"):
        toy_config(tiny_model_dir, tmp_path, "rollout.engine=vlm")
    assert toy_config(tiny_model_dir, tmp_path, "rollout.engine=dummy").rollout.engine == "dummy"


def test_an_engine_without_a_planner_fails_the_check_then_plans_with_one(dummy_engine, tiny_model_dir, tmp_path):
    assert missing_counterparts() == ["rollout engine 'dummy' has no memory planner (fitrl/memory/engines.py, "
                                      "ENGINE_PLANNERS)"]
    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.device=cpu", "trainer.val_before_train=false",
                     "rollout.engine=dummy")
    hw = Hardware.cpu(host_memory=64 * C.GIB)
    with pytest.raises(Exception, match="unknown rollout engine planner rollout.engine='dummy'"):
        plan_config(cfg, hw)  # never a plan without the engine's memory

    ENGINE_PLANNERS.add("dummy", DummyPlanner)
    assert missing_counterparts() == []
    plan = plan_config(cfg, hw)
    trainer = plan.process("trainer")
    assert trainer.phases["rollout"].host["dummy cache"] == C.GIB
    assert "dummy cache" not in trainer.phases["update"].host
    assert plan.process("dummy").host_peak() == 2 * C.GIB
    assert "weight_sync" in plan.phases  # the engine holds weights of its own
    node = plan.node_host("rollout")  # what the verdict reads: the node's peak holds both
    assert node["dummy cache"] == C.GIB and node["dummy server"] == 2 * C.GIB
    assert plan.peaks()["rollout"][1] == sum(node.values()) > 3 * C.GIB
