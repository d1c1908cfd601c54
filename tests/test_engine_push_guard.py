"""The rollout engine on a GPU node, as far as a CPU can see it (issue 59): the vLLM engine asleep
from its build at the level ``rollout.sleep_level`` gives (``auto``: from whether pushes follow),
custom all-reduce off in the shared TP layout, and a run stopped in one line, its last checkpoint
intact, when the engine's log-probs jump away from the trainer's after a push (weights corrupted
in the engine only: the HF engine on a copy here; the vLLM CPU engine in the ``vllm`` tier)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from helpers import read_metrics, toy_config

from fitrl.algo.mismatch import mismatch_jump
from fitrl.checkpoint import layout
from fitrl.config import load_config
from fitrl.config.schema import FSDPConfig, ModelConfig, RolloutConfig
from fitrl.core.errors import ConfigError, EngineBroken
from fitrl.rollout.engine import EngineContext
from fitrl.rollout.vllm_build import EngineLayout, llm_kwargs

LEAN = ("trainer.val_before_train=false", "trainer.val_freq=0", "data.val_files=[]", "reward.num_workers=0",
        "checkpoint.save_final=false", "checkpoint.save_freq=1")


# ------------------------------------------------------------------ the jump, on hand-made numbers

def test_first_step_is_judged_by_the_floor_alone():
    assert mismatch_jump(0.09, [], floor=0.1, factor=10.0) is None
    assert mismatch_jump(0.11, [], floor=0.1, factor=10.0) == 0.1


def test_a_steady_distance_moves_the_bound_a_jump_crosses_it():
    recent = [0.02, 0.03, 0.05]  # a bf16 engine's usual distance: median 0.03, bound 10 x 0.03
    assert mismatch_jump(0.25, recent, floor=0.1, factor=10.0) is None
    assert mismatch_jump(0.31, recent, floor=0.1, factor=10.0) == pytest.approx(0.3)
    assert mismatch_jump(0.05, [1e-7] * 5, floor=0.1, factor=10.0) is None  # 500 x, but below the floor


def test_non_finite_crosses_and_zero_floor_disables():
    assert mismatch_jump(math.nan, [1e-6], floor=0.1, factor=10.0) == 0.1
    assert mismatch_jump(math.inf, [], floor=0.1, factor=10.0) == 0.1
    assert mismatch_jump(50.0, [], floor=0.0, factor=10.0) is None


def test_mismatch_keys_are_checked():
    with pytest.raises(ConfigError, match="rollout.mismatch_stop_kl must be a finite number >= 0"):
        RolloutConfig(mismatch_stop_kl=-1.0)
    with pytest.raises(ConfigError, match="rollout.mismatch_stop_factor must be >= 1"):
        RolloutConfig(mismatch_stop_factor=0.5)


# ------------------------------------------------------------------ the sleep level

def test_sleep_level_auto_is_the_default_and_follows_the_pushes():
    cfg = load_config(None, [])
    assert cfg.rollout.sleep_level == "auto"
    level, why = cfg.rollout.sleep_level_for(pushes=True)
    assert level == 2 and "every update pushes the weights" in why
    level, why = cfg.rollout.sleep_level_for(pushes=False)
    assert level == 1 and "trainer.val_only" in why


@pytest.mark.parametrize("level", [0, 1, 2])
def test_an_explicit_sleep_level_is_kept(level):
    r = load_config(None, [f"rollout.sleep_level={level}"]).rollout
    assert r.sleep_level_for(pushes=True) == r.sleep_level_for(pushes=False) == (level, f"rollout.sleep_level={level}")


def test_an_unknown_sleep_level_is_one_line():
    with pytest.raises(ConfigError, match="rollout.sleep_level.*expects one of 'auto', 0, 1, 2"):
        load_config(None, ["rollout.sleep_level=3"])


class FakeLLM:
    """What VllmRollout asks of ``vllm.LLM``, recorded."""

    def __init__(self):
        self.calls: list[str] = []

    def collective_rpc(self, method, args=()):
        self.calls.append(method)
        if method == "fitrl_load_weights":
            return [sum(1 for _ in args[0])]
        return [""]  # fitrl_prepare: nothing missing

    def sleep(self, level):
        self.calls.append(f"sleep {level}")

    def wake_up(self, tags):
        self.calls.append(f"wake {tags[0]}")

    def reset_prefix_cache(self):
        self.calls.append("reset prefix cache")


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from fitrl.models.loading import build_model, load_tokenizer

    mcfg = ModelConfig(path=str(tiny_model_dir))
    return build_model("causal_lm", mcfg, FSDPConfig(), torch.device("cpu")), load_tokenizer(mcfg), mcfg.path


def fake_engine(policy, monkeypatch, *, device="cuda", pushes=True, **rollout):
    """A VllmRollout on ``FakeLLM`` (no vLLM), built as on a GPU: ``device`` is only named, never used."""
    from fitrl.rollout import vllm_engine

    llm = FakeLLM()
    monkeypatch.setattr(vllm_engine, "build_llm", lambda *args, **kwargs: llm)
    model, tokenizer, path = policy
    context = EngineContext(model_path=path, weights=lambda: iter(model.state_dict().items()),
                            device=torch.device(device), pushes=pushes)
    return vllm_engine.VllmRollout(model, tokenizer, RolloutConfig(engine="vllm", **rollout),
                                   inputs=vllm_engine.TEXT_INPUTS, context=context), llm


def test_engine_sleeps_once_built_at_level_2_in_a_training_run(policy, monkeypatch, capsys):
    engine, llm = fake_engine(policy, monkeypatch)
    assert llm.calls == ["fitrl_prepare", "sleep 2"]  # asleep before the other roles load
    assert not engine.awake and engine.stale  # dummy weights: the first wake pushes the trainer's
    line = capsys.readouterr().out.strip()
    assert line == ("vLLM engine: sleep level 2 from the start and between rollouts (KV cache freed, weights "
                    "discarded, pushed again at wake): rollout.sleep_level=auto: every update pushes the weights, "
                    "which would overwrite a host copy of them before the next rollout")
    llm.calls.clear()
    engine.wake()
    assert llm.calls == ["wake weights", "fitrl_load_weights", "reset prefix cache", "wake kv_cache"]
    engine.push_weights()  # (an update while awake: streamed at once)
    engine.sleep()
    assert llm.calls[-1] == "sleep 2" and engine.stale  # discarded: the next wake pushes again


def test_engine_of_a_validation_only_run_sleeps_at_level_1(policy, monkeypatch, capsys):
    engine, llm = fake_engine(policy, monkeypatch, pushes=False)
    assert llm.calls == ["fitrl_prepare", "sleep 1"]
    assert "sleep level 1" in capsys.readouterr().out
    engine.wake()
    engine.sleep()
    assert llm.calls[-1] == "sleep 1" and not engine.stale  # level 1 kept the pushed weights


def test_explicit_level_and_awake_engines(policy, monkeypatch, capsys):
    _, llm = fake_engine(policy, monkeypatch, sleep_level=1)
    assert llm.calls == ["fitrl_prepare", "sleep 1"]
    assert capsys.readouterr().out.strip().endswith(": rollout.sleep_level=1")
    engine, llm = fake_engine(policy, monkeypatch, sleep_level=0)
    assert llm.calls == ["fitrl_prepare"] and engine.awake
    engine, llm = fake_engine(policy, monkeypatch, device="cpu")
    assert llm.calls == ["fitrl_prepare"] and engine.awake  # vLLM's sleep mode needs CUDA
    assert "awake between rollouts (vLLM's sleep mode needs CUDA)" in capsys.readouterr().out


# ------------------------------------------------------------------ custom all-reduce

@pytest.mark.parametrize("mode,tp,off", [("own", 1, False), ("workers", 2, False), ("shared", 2, True)])
def test_custom_all_reduce_is_off_in_the_shared_layout_only(mode, tp, off):
    """shared: each TP shard is a Ray actor seeing its own GPU alone, where custom all-reduce's
    peer-to-peer buffers cannot be set up (veRL, EasyR1 pass the same)."""
    kwargs = llm_kwargs(RolloutConfig(engine="vllm", tensor_parallel_size=tp), EngineContext(model_path="m"),
                        EngineLayout(mode, tp, 0, tp if mode == "shared" else 1), cuda=True, sleep=True)
    assert kwargs.get("disable_custom_all_reduce", False) is off
    assert kwargs["tensor_parallel_size"] == tp and kwargs["enable_sleep_mode"]


# ------------------------------------------------------------------ a corrupted engine stops the run

def corrupt_after_push(monkeypatch, engine_cls, nth: int, corrupt) -> None:
    """``corrupt(engine)`` once, right after the engine's ``nth`` push (later pushes as they are)."""
    push, count = engine_cls.push_weights, [0]

    def push_then_corrupt(self):
        push(self)
        count[0] += 1
        if count[0] == nth:
            corrupt(self)

    monkeypatch.setattr(engine_cls, "push_weights", push_then_corrupt)


def scrambled_copy(engine) -> None:
    """The HF engine's module replaced by a copy whose weights are noise-ridden: the engine's
    weights are no longer the trainer's, which keeps its own."""
    model = copy.deepcopy(engine.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    engine.model = model


def assert_stopped_at_step_3_with_step_2_intact(error, run_dir, engine: str) -> None:
    text = str(error)
    assert "\n" not in text
    assert text.startswith(f"step 3: the policy's {engine} engine's log-probs of its samples are ")
    assert "right after the weight push and wake before step 3's rollout" in text
    assert "rollout.mismatch_stop_kl=0.1" in text and "Step 3 is not checkpointed" in text
    assert "resume point: " in text and "step_2 (step 2)" in text
    events = [r for r in read_metrics(run_dir) if r.get("event") == "engine_mismatch"]
    assert len(events) == 1 and events[0]["step"] == 3 and events[0]["rollout/kl"] > 0.1
    found = layout.list_complete(run_dir / "checkpoints")
    assert [c.step for c in found] == [1, 2]  # the step after the corrupted push was never saved
    assert not layout.damaged(layout.verify_files(found[-1].path, found[-1].meta))


@pytest.mark.parametrize("fold", [False, True], ids=["pass", "update"])
def test_hf_engine_corrupted_after_a_push_stops_the_run_and_the_last_checkpoint_resumes(
        tiny_model_dir, tmp_path, monkeypatch, fold):
    """The push after step 2's update leaves the engine with other weights than the trainer's:
    step 3's rollout/kl (the separate log-prob pass's, or the update's own forward's) jumps, the
    run stops at step 3's end, and step 2's checkpoint resumes the run to its end."""
    from fitrl.rollout.hf import HFRollout
    from fitrl.trainer.run import train

    run_dir = tmp_path / "run"
    source = ("actor.mini_batch_size=8",) if fold else ()  # one optimizer step: the update's forward compares
    cfg = toy_config(tiny_model_dir, run_dir, "trainer.max_steps=4", *LEAN, *source)
    assert cfg.old_logprob_source == ("update" if fold else "pass")
    corrupt_after_push(monkeypatch, HFRollout, 2, scrambled_copy)
    with pytest.raises(EngineBroken) as stop:
        train(cfg)
    assert_stopped_at_step_3_with_step_2_intact(stop.value, run_dir, "hf")
    monkeypatch.undo()
    history = train(toy_config(tiny_model_dir, run_dir, "trainer.max_steps=4", *LEAN, *source))
    steps = [h for h in history if "rollout/kl" in h]
    assert len(steps) == 4 and max(h["rollout/kl"] for h in steps[2:]) < 1e-3  # resumed from step 2


def test_no_stop_without_trainer_logprobs_or_when_disabled(tiny_model_dir, tmp_path, monkeypatch):
    from fitrl.rollout.hf import HFRollout
    from fitrl.trainer.run import train

    corrupt_after_push(monkeypatch, HFRollout, 1, scrambled_copy)
    history = train(toy_config(tiny_model_dir, tmp_path / "run", "trainer.max_steps=2", *LEAN,
                               "rollout.mismatch_stop_kl=0"))
    assert history[-1]["rollout/kl"] > 0.1  # the jump was there: the check was off


@pytest.mark.vllm
def test_vllm_engine_loading_wrong_weights_stops_the_run_and_the_last_checkpoint_resumes(tmp_path, monkeypatch):
    """The vLLM CPU engine: the push after step 2's update loads noise-ridden weights (the
    engine's copy only: vLLM's own load path, post-processing included); step 3 stops the run."""
    pytest.importorskip("vllm")
    from vllm_helpers import make_vllm_model, vllm_config

    from fitrl.rollout.vllm_engine import VllmRollout
    from fitrl.trainer.run import train

    model_dir, run_dir = make_vllm_model(tmp_path / "model"), tmp_path / "run"
    push = VllmRollout._push
    count = [0]

    def wrong_third_push(self):  # the first push is the first rollout's; the third follows step 2's update
        count[0] += 1
        if count[0] != 3:
            return push(self)
        weights, g = self.context.weights, torch.Generator().manual_seed(0)
        noisy = lambda: ((n, t + 0.5 * torch.randn(t.shape, generator=g).to(t)) for n, t in weights())  # noqa: E731
        object.__setattr__(self.context, "weights", noisy)  # (a frozen dataclass: swapped for this push only)
        try:
            push(self)
        finally:
            object.__setattr__(self.context, "weights", weights)

    monkeypatch.setattr(VllmRollout, "_push", wrong_third_push)
    cfg = vllm_config(model_dir, run_dir, "trainer.max_steps=4", *LEAN)
    with pytest.raises(EngineBroken) as stop:
        train(cfg)
    assert_stopped_at_step_3_with_step_2_intact(stop.value, run_dir, "vllm")
    monkeypatch.undo()
    history = train(vllm_config(model_dir, run_dir, "trainer.max_steps=4", *LEAN))
    assert [h.get("rollout/kl", 0.0) < 1e-3 for h in history][2:] == [True, True]
