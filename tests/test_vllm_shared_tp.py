"""One vLLM engine shared by two policy ranks (rollout.tensor_parallel_size=2 with 2 ranks): each
rank holds one TP shard in its own process (vLLM's external_launcher over the policy's gloo
group), no worker process is started, pushes of the FSDP2-sharded trainer's weights leave the
engine computing the trainer's log-probs, each rank gets the rollouts of its own prompts, and
shutting the engine down leaves the policy's process group working (CPU, .venv-vllm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from helpers import ROOT  # noqa: E402
from vllm_helpers import make_vllm_model  # noqa: E402

RANK = """
import json, os, sys
sys.path[:0] = [os.path.join(sys.argv[3], "tests")]
import psutil, torch
from fitrl.distributed.process_group import DistEnv, init_distributed
from fitrl.roles.workers import PolicyWorker
from vllm_helpers import prompts_from, trainer_logprobs, vllm_config

rank = int(os.environ["RANK"])
init_distributed(DistEnv(rank, 2, rank, 2, "127.0.0.1", int(os.environ["MASTER_PORT"])), "gloo")
torch.manual_seed(100 + rank)  # ranks' RNG streams differ, as in training
w = PolicyWorker(vllm_config(sys.argv[1], sys.argv[2], "rollout.tensor_parallel_size=2", "rollout.temperature=0.7",
                             "rollout.top_k=20", "rollout.max_response_length=8"), rank=rank, world_size=2)
engine = w.rollout
out = {"mode": engine.layout.mode, "group": engine.layout.group,
       "children": [c.name() for c in psutil.Process().children(recursive=True) if "python" not in c.name()]}
out["vocab"] = w.model.config.vocab_size
out["embed_rows"] = engine.llm.collective_rpc(
    lambda worker: worker.model_runner.get_model().model.embed_tokens.weight.shape[0])[0]
seq = [5, 17, 42, 99, 3, 250, 7, 12, 400, 8]
out["gap_first"] = float((engine.sequence_logprobs([seq])[0] - trainer_logprobs(w.model, seq)).abs().max())
with torch.no_grad():
    for p in w.model.parameters():
        p.add_(torch.randn_like(p) * 0.05)  # each rank moves its own FSDP2 shard
engine.push_weights()
out["gap_after_push"] = float((engine.sequence_logprobs([seq])[0] - trainer_logprobs(w.model, seq)).abs().max())
prompts = prompts_from(w, 8)
mine = prompts.index(list(range(rank * 3, rank * 3 + 3 + rank)))  # 3 prompts on rank 0, 4 on rank 1
rollout = w.generate(mine, w.cfg.rollout.sampling())
old = w.compute_logprob(rollout)["old_logprobs"]
mask = rollout["response_mask"]
out["gap_rollout"] = float(((old - rollout["rollout_logprobs"]).abs() * mask).max())
out["own_prompts"] = [list(p) for p in rollout["prompt_ids"]] == [list(p) for p in mine.repeat_interleave(
    w.cfg.rollout.n)["prompt_ids"]]
out["responses"] = rollout["responses"].shape[0]
engine.release()
out["group_alive"] = torch.distributed.is_initialized()
torch.distributed.barrier()
json.dump(out, open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w"))
"""


def test_two_ranks_share_one_tensor_parallel_engine(tmp_path):
    from fitrl.distributed.process_group import free_port

    model = make_vllm_model(tmp_path / "model")
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(model), str(run), str(ROOT)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    results = [json.loads((run / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert res["mode"] == "shared" and res["group"] == [0, 1]
        assert not any("VLLM" in name or "Worker" in name for name in res["children"]), res["children"]
        assert res["embed_rows"] == -(-res["vocab"] // 64) * 64 // 2, res  # half the (padded) vocabulary per shard
        assert res["gap_first"] <= 1e-4 and res["gap_after_push"] <= 1e-4, res
        assert res["gap_rollout"] <= 1e-4 and res["own_prompts"], res
        assert res["responses"] == (3 + r) * 8  # rollout.n=8 per prompt: rank 0 had 3 prompts, rank 1 had 4
        assert res["group_alive"]
