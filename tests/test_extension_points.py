"""Every extension owns its whole footprint (fitrl/trainer/complete.py): a registered rollout
engine has its memory planner beside it, under the same name, and a plan of a run on it includes
what its planner says it holds; a vision-language family describes its tower (memory, FLOPs) and
its media processing; every model type's family describes its decoder, of the row's kind (dense
or mixture of experts); a model-holding role has its memory planner and its line in the run
layout. A dummy engine, family, decoder and role show the check can fail, then pass."""

import io
import json
import math
import shutil
from dataclasses import dataclass

import pytest
from rich.console import Console

import fitrl.rollout  # noqa: F401  (registers the built-in engines)
from fitrl.memory import calibration as C
from fitrl.memory.engines import ENGINE_PLANNERS, EnginePlanner
from fitrl.memory.model import PHASES, ProcessPlan, Usage
from fitrl.planner import Hardware, plan_config
from fitrl.planner.report import process_table
from fitrl.config import ConfigError
from fitrl.config.layout import ROLE_LINES, RoleLine, run_layout
from fitrl.trainer.complete import missing_counterparts
from fitrl.rollout.engine import ROLLOUT_ENGINES, RolloutEngine
from fitrl.core.model_types import MODEL_TYPES, ModelType
from fitrl.data.media import RowMedia
from fitrl.models.decoder import DenseLayout
from fitrl.models.families import CAUSAL_LM, MODEL_FAMILIES, QWEN_VL, ModelFamily
from fitrl.models.flops import FlopsShape
from fitrl.memory.roles import ROLE_PLANNERS, RolePlanner
from fitrl.memory.states import States
from fitrl.models.shape import ModelShape, numel
from fitrl.models.vision import VisualInput
from fitrl.roles.workers import ROLES
from fitrl.trainer.run import make_group
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


# ------------------------------------------------------------------------------------------------
# A vision-language family: its tower (memory plan, FLOPs) and media processing live beside it


@dataclass(frozen=True)
class DummyTower:
    """A tower of one linear layer over each patch, and a merger."""
    kind: str = "dummy_vl"
    depth: int = 1
    hidden: int = 256
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2
    in_chans: int = 3

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    def tensors(self):
        per_patch = self.in_chans * self.temporal_patch * self.patch * self.patch
        return [("visual.embed.weight", (self.hidden, per_patch)), ("visual.merger.weight", (64, self.hidden * 4))]

    def forward_flops(self, patches: int) -> int:
        return 2 * patches * sum(numel(s) for _, s in self.tensors())

    def activation_widths(self, grad, checkpointing):
        return ((3, self.hidden),) if grad else ((1, self.hidden),)

    def largest_image(self, max_pixels: int, min_pixels: int = 0) -> VisualInput:
        side = max(1, math.isqrt(max_pixels) // self.factor) * self.factor
        return VisualInput(self, 1, side, side)


class DummyMedia:
    """Text-only rows pass through unchanged."""
    model_type, supports_video = "dummy_vl", False

    def check_tokenizer(self, tokenizer):
        pass

    def read_row_media(self, source, row, messages, *, opts, base_dir):
        return messages, RowMedia()

    def expand_placeholders(self, text, image_tokens, video_tokens):
        return text

    def model_inputs(self, images, videos, media, opts, source):
        return {}


class HalfFamily(ModelFamily):
    """Builds, shards and describes its decoder (borrowed from the causal LM) but has no planner or
    media twins."""
    name = "dummy_vl"
    model_types = frozenset({"dummy_vl"})

    def builders(self, head, model):
        return CAUSAL_LM.builders(head, model)

    def blocks_to_shard(self, model):
        return CAUSAL_LM.blocks_to_shard(model)

    def decoder_layout(self, model_type):
        return CAUSAL_LM.decoder_layout(model_type)


class WholeFamily(HalfFamily):
    def vision_tower(self, config):
        return DummyTower(hidden=config["vision_config"]["hidden_size"])

    def media_spec(self, model_path):
        return DummyMedia()


@pytest.fixture
def dummy_vl_row(monkeypatch):
    monkeypatch.setitem(MODEL_TYPES, "dummy_vl", ModelType("dummy_vl", "qwen2", vision=True))
    yield
    if "dummy_vl" in MODEL_FAMILIES:
        MODEL_FAMILIES.remove("dummy_vl")


def test_every_builtin_family_has_its_tower_and_media():
    assert missing_counterparts() == []
    assert {n for n, t in MODEL_TYPES.items() if t.vision} == set(QWEN_VL.model_types)


def test_a_vision_language_family_without_twins_fails_the_check_then_plans_with_them(dummy_vl_row, tiny_model_dir,
                                                                                      tmp_path):
    model = tmp_path / "dummy-vl"
    shutil.copytree(tiny_model_dir, model)
    text = json.loads((model / "config.json").read_text())
    config = {**text, "model_type": "dummy_vl", "text_config": {**text, "model_type": "qwen2"},
              "vision_config": {"hidden_size": 256}}
    (model / "config.json").write_text(json.dumps(config))
    cfg = toy_config(model, tmp_path / "run", "trainer.device=cpu", "trainer.val_before_train=false")
    hw = Hardware.cpu(host_memory=64 * C.GIB)

    assert missing_counterparts() == ["vision-language model type 'dummy_vl' is claimed by no model family "
                                      "(fitrl/models/families/, ModelFamily.model_types)"]
    with pytest.raises(ValueError, match="'dummy_vl' is a vision-language model whose family describes no vision"):
        plan_config(cfg, hw)  # never a plan without the tower's memory

    MODEL_FAMILIES.add("dummy_vl", HalfFamily())
    assert missing_counterparts() == [
        "model family 'dummy_vl' describes no vision tower (its tensors and FLOPs, for the memory plan) of "
        "'dummy_vl' (ModelFamily.vision_tower)",
        "model family 'dummy_vl' describes no media processing (images to model inputs, for the data path) of "
        "'dummy_vl' (ModelFamily.media_spec)"]

    MODEL_FAMILIES.remove("dummy_vl")
    MODEL_FAMILIES.add("dummy_vl", WholeFamily())
    assert missing_counterparts() == []
    plan = plan_config(cfg, hw)
    tower = sum(numel(s) for _, s in DummyTower().tensors())
    assert plan.shape.num_params == ModelShape.from_dict(text).num_params + tower
    text_plan = plan_config(toy_config(tiny_model_dir, tmp_path / "run2", "trainer.device=cpu",
                                       "trainer.val_before_train=false"), hw)
    update, text_update = (p.process("trainer").phases["update"].host for p in (plan, text_plan))
    # the tower's fp32 weights, gradients and AdamW moments (and a step count per tensor) are in the
    # plan, and its activations
    steps = 4 * len(DummyTower().tensors())
    assert [update[k] - text_update[k] for k in ("params", "grads", "optimizer")] == [4 * tower, 4 * tower,
                                                                                       8 * tower + steps]
    assert plan.peaks()["update"][1] > text_plan.peaks()["update"][1] + 16 * tower
    assert FlopsShape.of(plan.shape).vision_flops([16]) == DummyTower().forward_flops(16)


# ------------------------------------------------------------------------------------------------
# A decoder: described by the family that claims the model type, of the kind its row declares


class NoDecoderFamily(ModelFamily):
    """Builds and shards (borrowed from the causal LM) but describes no decoder."""
    name = "dummy_lm"
    model_types = frozenset({"dummy_lm"})

    def builders(self, head, model):
        return CAUSAL_LM.builders(head, model)

    def blocks_to_shard(self, model):
        return CAUSAL_LM.blocks_to_shard(model)


class DenseFamily(NoDecoderFamily):
    def decoder_layout(self, model_type):
        return DenseLayout(qkv_bias=True)  # Qwen2's layout, spelled out: the tiny model is a Qwen2


@pytest.fixture
def dummy_lm_dir(tiny_model_dir, tmp_path):
    """The tiny model under model_type ``dummy_lm`` (its language model a Qwen2's: what the memory
    trace builds); the test enters the row and the family, the fixture takes them out."""
    model = tmp_path / "dummy-lm"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "dummy_lm"}))
    yield model
    MODEL_TYPES.pop("dummy_lm", None)
    if "dummy_lm" in MODEL_FAMILIES:
        MODEL_FAMILIES.remove("dummy_lm")


def test_every_builtin_model_type_has_its_decoder():
    assert missing_counterparts() == []
    assert {t.kind for t in MODEL_TYPES.values()} == {"dense", "moe"}  # qwen3_moe: tests/test_moe_decoder.py
    with pytest.raises(ValueError, match="kind='mixture'; valid: dense, moe"):
        ModelType("dummy_lm", "qwen2", kind="mixture")
    assert all(QWEN_VL.decoder_layout(n) is CAUSAL_LM.decoder_layout(t.decoder)
               for n, t in MODEL_TYPES.items() if t.vision)  # a VL model's language model is its text family's


def test_a_moe_row_without_its_decoder_fails_the_check_and_is_never_planned_as_dense(dummy_lm_dir, tmp_path):
    MODEL_TYPES["dummy_lm"] = ModelType("dummy_lm", "qwen2", kind="moe")
    cfg = toy_config(dummy_lm_dir, tmp_path / "run", "trainer.device=cpu", "trainer.val_before_train=false")
    hw = Hardware.cpu(host_memory=64 * C.GIB)
    # unclaimed, the causal LM's Qwen2 layout is dense: not the row's kind
    assert missing_counterparts() == [
        "model type 'dummy_lm' has a moe decoder (fitrl/core/model_types.py) and model family 'causal_lm' describes "
        "a dense one (ModelFamily.decoder_layout, fitrl/models/decoder.py)"]

    MODEL_FAMILIES.add("dummy_lm", NoDecoderFamily())
    assert missing_counterparts() == [
        "model type 'dummy_lm' has a moe decoder (fitrl/core/model_types.py) and model family 'dummy_lm' describes "
        "none (ModelFamily.decoder_layout, fitrl/models/decoder.py)"]
    with pytest.raises(ValueError, match="'dummy_lm' has a moe decoder .* family 'dummy_lm' describes no decoder"):
        plan_config(cfg, hw)  # never a dense plan of a mixture of experts
    with pytest.raises(ValueError, match="has a moe decoder"):
        FlopsShape.from_path(dummy_lm_dir)  # nor a dense FLOP count

    MODEL_FAMILIES.remove("dummy_lm")
    MODEL_FAMILIES.add("dummy_lm", DenseFamily())  # a dense description does not plan a moe row either
    assert len(missing_counterparts()) == 1
    with pytest.raises(ValueError, match="family 'dummy_lm' describes a dense decoder"):
        plan_config(cfg, hw)


def test_a_dense_row_with_its_decoder_passes_and_plans(dummy_lm_dir, tiny_model_dir, tmp_path):
    MODEL_TYPES["dummy_lm"] = ModelType("dummy_lm", "qwen2")
    MODEL_FAMILIES.add("dummy_lm", NoDecoderFamily())
    assert missing_counterparts() == [
        "model type 'dummy_lm' has a dense decoder (fitrl/core/model_types.py) and model family 'dummy_lm' describes "
        "none (ModelFamily.decoder_layout, fitrl/models/decoder.py)"]

    MODEL_FAMILIES.remove("dummy_lm")
    MODEL_FAMILIES.add("dummy_lm", DenseFamily())
    assert missing_counterparts() == []
    hw = Hardware.cpu(host_memory=64 * C.GIB)
    plan = plan_config(toy_config(dummy_lm_dir, tmp_path / "run", "trainer.device=cpu",
                                  "trainer.val_before_train=false"), hw)
    qwen2 = plan_config(toy_config(tiny_model_dir, tmp_path / "run2", "trainer.device=cpu",
                                   "trainer.val_before_train=false"), hw)
    assert plan.shape.tensors() == qwen2.shape.tensors()  # the family's layout, tensor for tensor
    assert plan.process("trainer").phases["update"].host == qwen2.process("trainer").phases["update"].host
    flops = [FlopsShape.from_path(d).forward_flops(8, 8) for d in (dummy_lm_dir, tiny_model_dir)]
    assert flops[0] == flops[1]

    # a config that routes experts is not a dense model, whatever its row says
    config = json.loads((dummy_lm_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"config.json describes a mixture of experts \(num_experts=8\)"):
        ModelShape.from_dict({**config, "num_experts": 8})


# ------------------------------------------------------------------------------------------------
# A model-holding role: its workers and its memory planner under one name


class DummyRolePlanner(RolePlanner):
    """A frozen 64 MiB model of its own (built in every run: its layout line says so), computing in
    the update."""
    name, title = "dummy", "dummy rank (Ray actor)"

    def states(self, run):
        return States(64 * 2**20), run.cfg.ref  # (sharded and offloaded as the reference's section says)

    def active_phases(self, run):
        return {"update"}


@pytest.fixture
def dummy_role():
    ROLES.add("dummy", object)
    yield
    ROLES.remove("dummy")
    if "dummy" in ROLE_PLANNERS:
        ROLE_PLANNERS.remove("dummy")


@pytest.fixture
def dummy_line(monkeypatch):
    """The dummy role's line in the run layout: built in every run."""
    monkeypatch.setitem(ROLE_LINES, "dummy", RoleLine(lambda facts: True))


def test_every_builtin_role_has_its_planner():
    assert missing_counterparts() == []
    assert ROLES.names() == ROLE_PLANNERS.names() == ["actor", "critic", "judge", "ref", "reward_model", "rollout",
                                                  "teacher"]


@pytest.mark.parametrize("backend", ["inprocess", "ray"])
def test_a_role_without_a_planner_fails_the_check_then_plans_with_one(dummy_role, dummy_line, backend, tiny_model_dir,
                                                                      tmp_path):
    assert missing_counterparts() == ["role 'dummy' has no memory planner (fitrl/memory/roles.py, ROLE_PLANNERS)"]
    with pytest.raises(ValueError, match="role 'dummy' has no memory planner"):
        make_group("dummy", None, "dummy", None)  # never run unplanned

    ROLE_PLANNERS.add("dummy", DummyRolePlanner())
    assert missing_counterparts() == []
    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.device=cpu", f"trainer.backend={backend}",
                     "trainer.val_before_train=false")
    plan = plan_config(cfg, Hardware.cpu(host_memory=64 * C.GIB))
    if backend == "ray":  # a process of its own on each device, beside the trainer rank
        held = plan.process("dummy").phases
        assert "dummy params" not in plan.process("trainer").phases["update"].host
        table = Console(width=200, record=True, file=io.StringIO())
        table.print(process_table(plan))
        assert "dummy rank (Ray actor)" in table.export_text()
    else:  # in one process the trainer holds it
        held = plan.process("trainer").phases
    assert all(held[ph].host["dummy params"] == 64 * 2**20 for ph in plan.phases)


def test_a_role_without_a_layout_line_fails_the_check_then_is_built_by_it(dummy_role, monkeypatch, tiny_model_dir,
                                                                         tmp_path):
    """A role registered with its workers and its planner but no line in the run layout would never
    be built (the layout is the only place that says when): the check names it."""
    ROLE_PLANNERS.add("dummy", DummyRolePlanner())
    assert missing_counterparts() == ["role 'dummy' has no line in the run layout (fitrl/config/layout.py, "
                                      "ROLE_LINES): no run would build it"]
    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.device=cpu", "trainer.val_before_train=false")
    assert run_layout(cfg).role("dummy") is None

    monkeypatch.setitem(ROLE_LINES, "dummy", RoleLine(lambda facts: facts.mode == "rl"))
    assert missing_counterparts() == []
    assert run_layout(cfg).builds("dummy") and run_layout(cfg, supervised=True).role("dummy") is None


def test_a_layout_line_without_its_role_fails_the_check(monkeypatch):
    monkeypatch.setitem(ROLE_LINES, "dummy", RoleLine(lambda facts: True))
    assert missing_counterparts() == ["run layout line 'dummy' builds a role that is not registered "
                                      "(fitrl/roles/workers.py, ROLES)"]
