"""Engines declare what they can do (fitrl/core/engines.py) and report through one helper
(fitrl/rollout/engine.py, ``GENERATION``): the capability table answers for the built-in engines
as the name tests it replaced did, a dummy engine's declaration is what the call sites act on, and
an engine whose long generate goes through the helper beats for the hang watchdog while one that
bypasses it is declared hung."""

from types import SimpleNamespace

import pytest
import torch

import fitrl.rollout  # noqa: F401  (registers the built-in engines)
from fitrl.config import ConfigError
from fitrl.config.rollout import RolloutConfig
from fitrl.config.run import TrainerConfig
from fitrl.config.schema import FSDPConfig, ModelConfig, SamplingConfig
from fitrl.core.engines import ENGINE_CAPABILITIES, EngineCapabilities, engine_capabilities
from fitrl.data.batch import Batch
from fitrl.memory import calibration as C
from fitrl.memory.engines import ENGINE_PLANNERS, EnginePlanner
from fitrl.models.loading import build_model, load_tokenizer
from fitrl.planner import Hardware, plan_config
from fitrl.rollout.agent import check_agent
from fitrl.rollout.engine import GENERATION, ROLLOUT_ENGINES, GenerationHooks, RolloutEngine
from fitrl.rollout.hf import HFRollout
from fitrl.rollout.vllm_engine import heartbeat_bar
from fitrl.roles.rollout_worker import RolloutWorker
from fitrl.telemetry import guard as guard_module
from fitrl.telemetry import memory as mem
from fitrl.telemetry import progress as progress_module
from fitrl.telemetry.guard import GUARD, GuardSettings, MemoryPressure
from fitrl.telemetry.progress import PROGRESS
from fitrl.trainer.complete import missing_counterparts
from fitrl.trainer.watchdog import HangWatchdog
from helpers import toy_config

# ------------------------------------------------------------------------------------------------
# The table answers as the name tests did


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_the_table_answers_as_the_names_did(name):
    caps = engine_capabilities(name)
    assert caps == ROLLOUT_ENGINES.get(name).capabilities  # the class's declaration, entered on registration
    assert caps.holds_own_weights == (name != "hf")  # roles/rollout_worker.py: own_copy
    assert caps.tensor_parallel == (name == "vllm")  # rollout/agent.py: check_agent
    assert caps.tensor_parallel == (name != "hf")  # config/schema.py: check_rollout_placement
    assert caps.sleeps == (name == "vllm")  # trainer/run.py: vllm_sleeps
    if caps.holds_own_weights:  # memory/model.py: Plan.band's label
        assert f"the {caps.called(name)} engine" == "the vLLM engine"
    for workers in (0, 1):  # config/rollout.py: RolloutConfig.trainer_engine
        assert RolloutConfig(engine=name, workers=workers).trainer_engine == ("hf" if workers else name)


def test_an_unknown_engine_is_named_with_the_registered_ones():
    with pytest.raises(ConfigError, match=r"unknown rollout engine rollout.engine='vlm'; did you mean 'vllm'\?"):
        engine_capabilities("vlm")
    assert missing_counterparts() == []


@pytest.mark.parametrize("name,raises", [("hf", False), ("vllm", True)])
def test_rollout_workers_refuse_a_sharded_engine(name, raises, tiny_model_dir, tmp_path):
    args = (tiny_model_dir, tmp_path, "rollout.workers=1", f"rollout.engine={name}", "rollout.tensor_parallel_size=2")
    if raises:
        with pytest.raises(ConfigError, match="one engine on one device"):
            toy_config(*args)
    else:
        toy_config(*args)


# ------------------------------------------------------------------------------------------------
# A dummy engine's declaration is what the call sites act on


class InPlace(RolloutEngine):
    """Generates with the module it is given: the defaults."""

    @classmethod
    def from_config(cls, model, tokenizer, cfg, **kw):
        return cls()

    def generate(self, prompts, sampling):
        return prompts


class OwnCopy(InPlace):
    capabilities = EngineCapabilities(holds_own_weights=True, sleeps=True, tensor_parallel=True, title="Dummy")


class Planner(EnginePlanner):
    def syncs_weights(self, cfg) -> bool:
        return cfg.rollout.capabilities.holds_own_weights


@pytest.fixture
def dummies():
    for name, engine in (("in_place", InPlace), ("own_copy", OwnCopy)):
        ROLLOUT_ENGINES.add(name, engine)
        ENGINE_PLANNERS.add(name, type(f"{name}_planner", (Planner,), {"name": name}))
    yield
    for name in ("in_place", "own_copy"):
        ROLLOUT_ENGINES.remove(name)
        ENGINE_PLANNERS.remove(name)
    assert "own_copy" not in ENGINE_CAPABILITIES  # removed with the engine


def test_registering_an_engine_enters_its_capabilities(dummies):
    assert engine_capabilities("own_copy") is OwnCopy.capabilities
    assert engine_capabilities("in_place") == EngineCapabilities()
    assert missing_counterparts() == []


def test_the_config_reads_the_declaration(dummies, tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="one engine on one device"):
        toy_config(tiny_model_dir, tmp_path, "rollout.workers=1", "rollout.engine=own_copy",
                   "rollout.tensor_parallel_size=2")
    cfg = toy_config(tiny_model_dir, tmp_path, "rollout.workers=1", "rollout.engine=in_place",
                     "rollout.tensor_parallel_size=2")  # (tensor_parallel_size does not apply to it)
    assert cfg.rollout.trainer_engine == "in_place"  # no second engine copy to avoid on the trainer's ranks
    cfg = toy_config(tiny_model_dir, tmp_path, "rollout.workers=1", "rollout.engine=own_copy")
    assert cfg.rollout.trainer_engine == "hf"
    assert toy_config(tiny_model_dir, tmp_path, "rollout.engine=own_copy").rollout.trainer_engine == "own_copy"


def test_a_rollout_worker_holds_a_model_only_for_an_engine_without_weights(dummies, tiny_model_dir, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setattr(GUARD, "settings", GUARD.settings)  # (the worker configures this process's guard)
    for name, own in (("own_copy", True), ("in_place", False)):
        worker = RolloutWorker(toy_config(tiny_model_dir, tmp_path, "rollout.workers=1", f"rollout.engine={name}"),
                               rank=0, world_size=1)
        assert worker.own_copy is own
        assert isinstance(worker.engine, OwnCopy if own else InPlace)
        # an engine with weights of its own gets a module of shapes only; one without, the weights
        assert next(worker.model.parameters()).is_meta is own


def test_the_plan_band_names_an_engine_with_weights_of_its_own(dummies, tiny_model_dir, tmp_path):
    hw = Hardware(nodes=1, gpus_per_node=1, gpu_memory=80 * C.GIB, host_memory=512 * C.GIB)
    bands = {name: plan_config(toy_config(tiny_model_dir, tmp_path, f"rollout.engine={name}"), hw).band("gpu")[1]
             for name in ("own_copy", "in_place", "hf", "vllm")}
    assert bands["own_copy"] == "assumed: the Dummy engine not calibrated"
    assert bands["vllm"] == "assumed: the vLLM engine not calibrated"
    assert bands["in_place"] == bands["hf"] == "measured: one H100, HF engine"


@pytest.mark.parametrize("name,raises", [("own_copy", True), ("in_place", False)])
def test_an_agent_refuses_an_engine_sharded_over_ranks(dummies, name, raises, tiny_model_dir, tmp_path):
    cfg = toy_config(tiny_model_dir, tmp_path, f"rollout.engine={name}", "rollout.tensor_parallel_size=2",
                     "trainer.backend=ray", "trainer.devices_per_node=2", "data.apply_chat_template=true",
                     "rollout.agent.env=tools", "rollout.agent.tools=[calculator]")
    tokenizer = load_tokenizer(cfg.actor.model)
    if raises:
        with pytest.raises(ConfigError, match="the ranks of one engine would run different episodes"):
            check_agent(cfg, tokenizer)
    else:
        check_agent(cfg, tokenizer)


# ------------------------------------------------------------------------------------------------
# A long generate beats through the helper, and the check can fail

STEP_S = 300.0
"""Seconds of the fake clock one decode step (one forward) takes: ``STEPS`` of them outlast the
watchdog's default limit, and two fit in it."""
STEPS = 8


class Clock:
    """The clock the heartbeats read (fitrl/telemetry/progress.py), moved by hand: an hour-long
    generate in milliseconds, judged by the watchdog's own check."""

    def __init__(self, monkeypatch):
        self.now = 1000.0
        monkeypatch.setattr(progress_module, "time", SimpleNamespace(monotonic=lambda: self.now))
        monkeypatch.setattr(PROGRESS, "phase", PROGRESS.phase)
        monkeypatch.setattr(PROGRESS, "thread", PROGRESS.thread)
        PROGRESS.enter("rollout")
        limit = TrainerConfig().hang_timeout_s
        assert STEPS * STEP_S > limit > 2 * STEP_S
        self.fired: list[float] = []
        self.watchdog = HangWatchdog(lambda phase: limit, lambda timeout: [], report=lambda text, event: "")
        self.watchdog.fire = lambda phase, limit, ranks: self.fired.append(PROGRESS.idle_s())

    def work(self, *_) -> None:
        """One decode step's work, then the watchdog looks (it wakes every few seconds in a run)."""
        self.now += STEP_S
        self.watchdog.check()


@pytest.fixture
def clock(monkeypatch):
    return Clock(monkeypatch)


class LongGenerate(InPlace):
    """A generate of ``STEPS`` decode steps, each the clock's ``work``, through the helper or not."""

    def __init__(self, work, helper: bool):
        self.work, self.helper = work, helper

    def generate(self, prompts, sampling):
        GENERATION.safe_point()
        for _ in (GENERATION.steps(range(STEPS)) if self.helper else range(STEPS)):
            self.work()
        return prompts


@pytest.mark.parametrize("helper", [True, False])
def test_a_long_generate_beats_only_through_the_helper(clock, helper):
    before = PROGRESS.beats
    LongGenerate(clock.work, helper).generate(Batch(fields={"prompt_ids": [[1]]}), SamplingConfig())
    if helper:
        assert clock.fired == [] and PROGRESS.beats - before == STEPS
    else:
        assert clock.fired and PROGRESS.beats == before  # declared hung half-way
        assert clock.fired[0] >= TrainerConfig().hang_timeout_s


@pytest.mark.parametrize("helper", [True, False])
def test_the_helper_reads_the_memory_guard(monkeypatch, helper):
    monkeypatch.setattr(GUARD, "settings", GuardSettings(enabled=True, min_available_bytes=8 * mem.GIB))
    monkeypatch.setattr(GUARD, "_last_poll", 0.0)
    monkeypatch.setattr(mem, "node_available_bytes", lambda: mem.GIB)  # (module attribute: the guard reads it)
    monkeypatch.setattr(guard_module.RECORDER, "want_uss", lambda: None)
    engine = LongGenerate(lambda: None, helper)
    engine.generate = lambda prompts, sampling: [None for _ in (GENERATION.steps(range(STEPS)) if helper
                                                                else range(STEPS))]
    if helper:
        with pytest.raises(MemoryPressure, match="host memory low"):
            engine.generate(None, None)
        with pytest.raises(MemoryPressure):
            GENERATION.safe_point()
    else:
        engine.generate(None, None)


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    return build_model("causal_lm", cfg, FSDPConfig(), torch.device("cpu")), tok


@pytest.mark.parametrize("decode", ["loop", "generate"])
@pytest.mark.parametrize("helper", [True, False])
def test_the_hf_engine_beats_through_the_helper(hf_engine, clock, monkeypatch, decode, helper):
    """Each forward of the tiny model is a minute: the HF engine's generate (both decode paths)
    beats through the helper; with the helper's step made silent, the watchdog fires."""
    model, tok = hf_engine
    if not helper:
        monkeypatch.setattr(GenerationHooks, "step", staticmethod(lambda guard=True: None))
    handle = model.register_forward_hook(clock.work)
    try:
        torch.manual_seed(0)
        out = HFRollout(model, tok, decode=decode).generate(Batch(fields={"prompt_ids": [[1, 2, 3]]}),
                                                            SamplingConfig(n=1, max_tokens=STEPS, ignore_eos=True))
    finally:
        handle.remove()
    assert out["responses"].shape[1] == STEPS
    assert (clock.fired == []) is helper


def test_the_vllm_engine_beats_per_finished_request(clock):
    """vLLM's own loop reports each finished request to its progress bar, which beats (no guard
    reading: raising there would leave vLLM half-way)."""
    bar = heartbeat_bar(total=STEPS)
    for _ in range(STEPS):
        clock.work()
        bar.update(1)
    bar.close()
    assert clock.fired == []
