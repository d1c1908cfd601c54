"""Multi-turn episodes on the vLLM engine (CPU tier; skipped where vLLM is absent): the
trajectory is the sampled ids plus each environment reply tokenized once, and the trainer's
log-probs over it equal the engine's at every model token (the HF engine's: tests/test_agents.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from fitrl.roles.workers import PolicyWorker  # noqa: E402
from agent_helpers import check_three_turn_trajectories, spy_on_turns  # noqa: E402
from vllm_helpers import make_vllm_model, prompts_from, vllm_config  # noqa: E402


def test_vllm_episodes_are_token_exact_and_their_logprobs_are_the_trainers(tmp_path):
    model_dir = make_vllm_model(tmp_path / "tiny-qwen2-hd32")
    # a random model almost never samples its end-of-turn token: half of the vocabulary ends
    # a turn here too, so that three-turn episodes finish within a few tokens per turn
    gen = json.loads((model_dir / "generation_config.json").read_text())
    config = json.loads((model_dir / "config.json").read_text())
    first = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    gen["eos_token_id"] = first + list(range(100, config["vocab_size"] - 20, 2))
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    env = f"{Path(__file__).parent / 'agent_helpers.py'}:Talk3"
    worker = PolicyWorker(vllm_config(model_dir, tmp_path / "run", "rollout.temperature=1.0",
                                      "rollout.max_response_length=128", f"rollout.agent.env={env}",
                                      "rollout.agent.max_turns=3", "rollout.agent.max_tokens_per_turn=24",
                                      "rollout.n=2"), rank=0, world_size=1)
    try:
        sampled = spy_on_turns(worker.agent.engine)
        out = worker.generate(prompts_from(worker, 4), worker.cfg.rollout.sampling())
        assert check_three_turn_trajectories(out, sampled, worker.tokenizer, first[0]) > 0
        trainer = worker.compute_logprob(out)["old_logprobs"]
        mask = out["response_mask"]
        assert float(((trainer - out["rollout_logprobs"]).abs() * mask).max()) <= 1e-4
    finally:  # now, not whenever the collector gets to it: vLLM's teardown resets its global state
        worker.agent.close()
        worker.rollout.release()
