"""Multi-turn episodes on the vLLM engine (CPU tier; skipped where vLLM is absent): the
trajectory is the sampled ids plus each environment reply tokenized once, and the trainer's
log-probs over it equal the engine's at every model token (the HF engine's: tests/test_agents.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

EPISODES = """
import json, sys
from pathlib import Path
sys.path[:0] = [sys.argv[2]]
from agent_helpers import check_three_turn_trajectories, spy_on_turns
from fitrl.roles.workers import PolicyWorker
from vllm_helpers import make_vllm_model, prompts_from, vllm_config

tmp = Path(sys.argv[1])
model_dir = make_vllm_model(tmp / "tiny-qwen2-hd32")
# a random model almost never samples its end-of-turn token: half of the vocabulary ends a turn
# here too, so that three-turn episodes finish within a few tokens per turn
gen = json.loads((model_dir / "generation_config.json").read_text())
vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
first = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
gen["eos_token_id"] = first + list(range(100, vocab - 20, 2))
(model_dir / "generation_config.json").write_text(json.dumps(gen))
env = f"{Path(sys.argv[2]) / 'agent_helpers.py'}:Talk3"
worker = PolicyWorker(vllm_config(model_dir, tmp / "run", "rollout.temperature=1.0", "rollout.max_response_length=128",
                                  f"rollout.agent.env={env}", "rollout.agent.max_turns=3",
                                  "rollout.agent.max_tokens_per_turn=24", "rollout.n=2"), rank=0, world_size=1)
sampled = spy_on_turns(worker.agent.engine)
out = worker.generate(prompts_from(worker, 4), worker.cfg.rollout.sampling())
assert check_three_turn_trajectories(out, sampled, worker.tokenizer, first[0]) > 0
trainer = worker.compute_logprob(out)["old_logprobs"]
gap = float(((trainer - out["rollout_logprobs"]).abs() * out["response_mask"]).max())
assert gap <= 1e-4, gap
worker.agent.close()
print("CHECKED")
"""


def test_vllm_episodes_are_token_exact_and_their_logprobs_are_the_trainers(tmp_path):
    """In a process of its own: an engine built and released here breaks the engines the later
    test modules build in this process (vLLM's parallel state is process-global)."""
    tests = str(Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", EPISODES, str(tmp_path), tests], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "CHECKED" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
