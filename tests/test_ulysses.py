"""Ulysses sequence parallelism (fitrl/distributed/ulysses.py): on 2 gloo ranks, the same
log-probs, loss, gradient norm and updated weights as one rank, alone and under FSDP2."""

import pickle
import queue as queue_module
import re
import time

import pytest
import torch
import torch.multiprocessing as mp

from fitrl.config.schema import ActorConfig, AlgorithmConfig
from fitrl.distributed.process_group import free_port
from fitrl.distributed.heads import check_heads
from fitrl.roles.actor import Actor
from test_packing import rl_batch


def test_heads_must_divide():
    assert check_heads(4, 2, 2) is None
    assert check_heads(4, None, 4) is None  # no GQA: as many key/value heads
    assert "4 must divide the model's attention heads (4) and key/value heads (2); use a divisor of 2" in \
        check_heads(4, 2, 4)


def run_ranks(fn, world, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 300
        while True:  # a rank that fails ends the wait (its traceback is on stderr)
            try:
                out = pickle.loads(queue.get(timeout=1))
                break
            except queue_module.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not failed and time.monotonic() < deadline, f"rank exit codes {failed}"
    finally:
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return out


def prompts_only_in_the_first_half(vocab):
    """Long prompts, short responses: the first rank of 2 predicts no response token at all."""
    from fitrl.data.batch import Batch
    from test_packing import mixed_batch

    ids, mask, pos, R = mixed_batch(vocab, prompts=(20, 20, 19, 20), responses=(2, 1, 3, 2), seed=3)
    response_mask = mask[:, -R:].clone()
    g = torch.Generator().manual_seed(3)
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, -R:],
                  "response_mask": response_mask, "advantages": torch.randn(4, 1, generator=g) * response_mask,
                  "old_logprobs": -torch.rand(4, R, generator=g) - 2.0, "ref_logprobs": -torch.rand(4, R, generator=g) - 2.0})


@pytest.mark.slow
@pytest.mark.parametrize("fsdp,make,checkpointing", [
    (False, rl_batch, False), (True, prompts_only_in_the_first_half, False),
    # a checkpointed layer runs forward again in backward: it must exchange heads again
    (True, rl_batch, True),
], ids=["replicated", "fsdp2-one-rank-without-responses", "fsdp2-checkpointing"])
def test_two_ranks_update_like_one(tiny_model_dir, fsdp, make, checkpointing):
    from transformers import AutoModelForCausalLM

    from fsdp_spawn import ulysses_update_on_rank

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = make(model.config.vocab_size)
    actor = Actor(model, ActorConfig(micro_batch_size=4, packing=True), AlgorithmConfig(use_kl_loss=True),
                  total_steps=1, max_response_length=12)
    logp1 = actor.compute_logprob(batch, temperature=1.0)["old_logprobs"]
    metrics1 = actor.update(batch, sequences_per_mini_batch=len(batch), temperature=1.0)
    state1 = model.state_dict()

    logp2, metrics2, state2 = run_ranks(ulysses_update_on_rank, 2, str(tiny_model_dir), batch, 2, fsdp, checkpointing)
    live = batch["response_mask"].bool()
    assert torch.allclose(logp1[live], logp2[live], atol=2e-5), (logp1 - logp2)[live].abs().max()
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert metrics2[key] == pytest.approx(metrics1[key], rel=1e-4, abs=1e-7), key
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    for name, w in state1.items():
        moved = (w - before[name]).abs().max()
        assert (state2[name] - w).abs().max() <= 1e-3 * moved + 1e-7, name  # lr 1e-6: the step is what differs


@pytest.mark.parametrize("overrides,message", [
    (["actor.ulysses_size=2"], "actor.ulysses_size=2 must divide the world size (1 rank(s)"),
    (["trainer.backend=ray", "trainer.devices_per_node=2", "actor.ulysses_size=4"],
     "actor.ulysses_size=4 must divide the world size (2 rank(s)"),
    (["trainer.backend=ray", "trainer.devices_per_node=2", "actor.ulysses_size=2", "algorithm.adv_estimator=gae"],
     "the critic has no sequence parallelism yet"),
    (["actor.ulysses_size=0"], "actor.ulysses_size must be >= 1"),
])
def test_config_refuses_what_it_cannot_split(overrides, message):
    from fitrl.config.loader import load_config
    from fitrl.core.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


@pytest.mark.parametrize("config,attn,message", [
    ({"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2}, "sdpa",
     "4 must divide the model's attention heads (4) and key/value heads (2); use a divisor of 2"),
    ({"model_type": "qwen2_5_vl", "num_attention_heads": 4}, "sdpa", "a vision-language model's images"),
    ({"model_type": "qwen2", "num_attention_heads": 4, "use_sliding_window": True, "sliding_window": 64}, "sdpa",
     "sliding-window attention"),
    ({"model_type": "qwen2", "num_attention_heads": 4}, "flash_attention_2", "use sdpa or eager"),
])
def test_model_refusals_name_the_model_and_why(config, attn, message):
    from fitrl.config.roles import ModelConfig
    from fitrl.core.errors import ModelDirError
    from fitrl.models.check import check_sequence_parallel

    model = ModelConfig(path="/models/x", attn_implementation=attn)
    with pytest.raises(ModelDirError, match=re.escape(message)) as e:
        check_sequence_parallel(config, model, "actor.model", 4)
    assert str(e.value).startswith("actor.ulysses_size=4 cannot split actor.model.path='/models/x': ")
    check_sequence_parallel({"model_type": "qwen2", "num_attention_heads": 8, "num_key_value_heads": 4},
                            ModelConfig(path="/models/x"), "actor.model", 4)  # divisible: no refusal


def test_dispatch_gives_a_group_one_shard_and_keeps_one_result():
    from fitrl.data.batch import Batch
    from fitrl.workers.group import RoleHandle, WorkerGroup, dispatch

    class Worker:
        @dispatch("dp", sequence_parallel=True)
        def passes(self, batch):
            return batch

        @dispatch("dp")
        def generate(self, batch):
            return batch

    class Recorder(WorkerGroup):
        world_size, worker_cls = 4, Worker

        def call_all(self, method, per_rank_args, kwargs):
            self.seen = [args[0]["x"].tolist() for args in per_rank_args]
            return [args[0] for args in per_rank_args]

    group = Recorder()
    handle = RoleHandle(group, sequence_parallel=2)
    batch = Batch({"x": torch.arange(8)})
    assert handle.passes(batch)["x"].tolist() == list(range(8))  # each group's result once, in order
    assert group.seen == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    handle.generate(batch)  # generation splits over every rank
    assert group.seen == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="groups of 3 do not divide 4 ranks"):
        RoleHandle(group, sequence_parallel=3)
