"""What the token-exactness tests of both engines share (tests/test_agents.py,
tests/test_vllm_agent.py): a spy on an engine's turns, and the check of a 3-turn trajectory;
and the scripted engine and sleeping tool of the overlap test."""

from __future__ import annotations

import torch

from fitrl.agents import Environment, Step
from fitrl.config.schema import SamplingConfig
from fitrl.data.batch import Batch
from fitrl.rollout.agent import EnvTurnEncoder
from fitrl.rollout.engine import RolloutEngine


class Talk3(Environment):
    """Replies to the first two turns with a user message (reward 0.25 each); done after the
    third (reward 1.0): 1.5 in all."""

    def step(self, turn):
        if turn.index == 2:
            return Step(reward=1.0, done=True)
        return Step(messages=[{"role": "user", "content": f"go on {turn.index + 1}"}], reward=0.25)


def spy_on_turns(engine) -> list[list[list[int]]]:
    """Records, per generate call (a round of turns), each row's sampled ids through its end token."""
    sampled: list[list[list[int]]] = []
    real = engine.generate

    def spy(prompts, sampling):
        out = real(prompts, sampling)
        sampled.append([r[m.bool()].tolist() for r, m in zip(out["responses"], out["response_mask"])])
        return out

    engine.generate = spy
    return sampled


def check_three_turn_trajectories(out, sampled, tokenizer, end_id: int) -> int:
    """Every episode ran 3 turns; its trajectory is its sampled turns with Talk3's replies, each
    tokenized once, between them, and the loss mask covers the turns only. Returns how many turns
    re-encode to other ids than were sampled (> 0: a re-tokenizing rollout would fail here)."""
    stats = out["agent_stats"]
    assert all(s["turns"] == 3 and s["cut"] == "" for s in stats), \
        [(i, s["turns"], s["cut"]) for i, s in enumerate(stats) if s["turns"] != 3 or s["cut"]]
    encoder = EnvTurnEncoder(tokenizer, [], [end_id])
    replies = [tokenizer(encoder.text([{"role": "user", "content": f"go on {k}"}]), add_special_tokens=False)["input_ids"]
               for k in (1, 2)]
    differs = 0
    for i in range(len(out)):
        turns = [sampled[t][i] for t in range(3)]  # every episode is live in every round here
        expected = turns[0] + replies[0] + turns[1] + replies[1] + turns[2]
        n = int(out["attention_mask"][i].sum()) - len(out["prompt_ids"][i])
        assert out["responses"][i, :n].tolist() == expected
        assert out["response_mask"][i, :n].tolist() == (
            [1] * len(turns[0]) + [0] * len(replies[0]) + [1] * len(turns[1]) + [0] * len(replies[1]) + [1] * len(turns[2]))
        for ids in turns:
            body = ids[:-1]  # the turn's end token removed
            differs += tokenizer(tokenizer.decode(body, skip_special_tokens=True), add_special_tokens=False)["input_ids"] != body
    return differs


NAP_TOOL = '''
import time


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "rested"
'''


class NapEngine(RolloutEngine):
    """The "slow" episode naps 3 s once then answers; the "fast" one naps 0 s twice then answers.
    Records which episodes each generate call held."""

    def __init__(self, tokenizer, eos: int):
        self.tokenizer, self.eos, self.batches = tokenizer, eos, []

    @classmethod
    def from_config(cls, *a, **k):
        raise NotImplementedError

    def generate(self, prompts: Batch, sampling: SamplingConfig) -> Batch:
        texts = [self.tokenizer.decode(p) for p in prompts["prompt_ids"]]
        self.batches.append(["slow" if "slow" in t else "fast" for t in texts])
        out = []
        for t in texts:
            naps = [3] if "slow" in t else [0, 0]
            done = t.count("<tool_response>")
            reply = (f'<tool_call>{{"name": "nap", "arguments": {{"seconds": {naps[done]}}}}}</tool_call>'
                     if done < len(naps) else "5")
            out.append(self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.eos])
        width = max(map(len, out))
        r = torch.tensor([ids + [self.eos] * (width - len(ids)) for ids in out])
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in out])
        return Batch({"responses": r, "response_mask": mask, "finished": torch.ones(len(out), dtype=torch.long),
                      "rollout_logprobs": torch.full(r.shape, -1.0)})
