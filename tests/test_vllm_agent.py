"""Multi-turn episodes on the vLLM engine (CPU tier; skipped where vLLM is absent): the
trajectory is the sampled ids plus each environment reply tokenized once, and the trainer's
log-probs over it equal the engine's at every model token (the HF engine's: tests/test_agents.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from fitrl.roles.workers import PolicyWorker  # noqa: E402
from fitrl.rollout.agent import EnvTurnEncoder  # noqa: E402
from vllm_helpers import make_vllm_model, prompts_from, vllm_config  # noqa: E402

ENV = '''
from fitrl.agents import Environment, Step

class Talk3(Environment):
    def step(self, turn):
        if turn.index == 2:
            return Step(reward=1.0, done=True)
        return Step(messages=[{"role": "user", "content": f"go on {turn.index + 1}"}])
'''


def test_vllm_episodes_are_token_exact_and_their_logprobs_are_the_trainers(tmp_path):
    model_dir = make_vllm_model(tmp_path / "tiny-qwen2-hd32")
    # a random model almost never samples its end-of-turn token: half of the vocabulary ends
    # a turn here too, so that three-turn episodes finish within a few tokens per turn
    gen = json.loads((model_dir / "generation_config.json").read_text())
    config = json.loads((model_dir / "config.json").read_text())
    first = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    gen["eos_token_id"] = first + list(range(100, config["vocab_size"] - 20, 2))
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    (tmp_path / "talk.py").write_text(ENV)
    worker = PolicyWorker(vllm_config(model_dir, tmp_path / "run", "rollout.temperature=1.0",
                                      "rollout.max_response_length=128", f"rollout.agent.env={tmp_path}/talk.py:Talk3",
                                      "rollout.agent.max_turns=3", "rollout.agent.max_tokens_per_turn=24",
                                      "rollout.n=2"), rank=0, world_size=1)
    engine = worker.agent.engine
    sampled = []
    real = engine.generate

    def spy(prompts, sampling):
        out = real(prompts, sampling)
        sampled.append([r[m.bool()].tolist() for r, m in zip(out["responses"], out["response_mask"])])
        return out

    engine.generate = spy
    out = worker.generate(prompts_from(worker, 4), worker.cfg.rollout.sampling())
    tok = worker.tokenizer
    stats = out["agent_stats"]
    assert all(s["turns"] == 3 and s["cut"] == "" for s in stats), [(i, s["turns"], s["cut"]) for i, s in enumerate(stats) if s["turns"] != 3 or s["cut"]]
    encoder = EnvTurnEncoder(tok, [], [first[0]])
    differs = 0
    for i in range(len(out)):
        turns = [sampled[t][i] for t in range(3)]
        replies = [tok(encoder.text([{"role": "user", "content": f"go on {k}"}]), add_special_tokens=False)["input_ids"]
                   for k in (1, 2)]
        expected = turns[0] + replies[0] + turns[1] + replies[1] + turns[2]
        n = int(out["attention_mask"][i].sum()) - len(out["prompt_ids"][i])
        assert out["responses"][i, :n].tolist() == expected
        for ids in turns:
            body = ids[:-1]  # the turn's end token removed
            differs += tok(tok.decode(body, skip_special_tokens=True), add_special_tokens=False)["input_ids"] != body
    assert differs > 0  # this tokenizer does not round-trip sampled ids: a re-tokenizing rollout fails above
    trainer = worker.compute_logprob(out)["old_logprobs"]
    mask = out["response_mask"]
    assert float(((trainer - out["rollout_logprobs"]).abs() * mask).max()) <= 1e-4
