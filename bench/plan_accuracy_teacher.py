"""bench/plan_accuracy.py's distillation teacher (``--teacher``): the random teacher columns a
policy's update reads when its teacher runs in another world, and the teacher's own ranks (the
plan's teacher process under Ray). Spawned processes import this module by name (the bench's
directory is on their path, as the parent's)."""

from __future__ import annotations

import json

from plan_accuracy import measured_phases, rank_setup


def teacher_columns(batch, k: int, vocab: int, g) -> dict:
    """Random teacher columns of the real shapes and dtypes (fitrl/roles/teacher.py) for a policy's
    update whose teacher runs in another world: log-probs, and with ``k`` top-k log-probs (each
    below log 1/(2k), so that the rest's bucket is a probability) and ids."""
    import math

    import torch

    shape = batch["responses"].shape
    out = {"teacher_logprobs": -torch.rand(shape, generator=g)}
    if k:
        out.update(teacher_topk_logprobs=-math.log(2 * k) - torch.rand(*shape, k, generator=g),
                   teacher_topk_ids=torch.randint(0, vocab, (*shape, k), generator=g))
    return out


def teacher_rank_main(rank: int, world: int, port: int, case: dict, model_dir: str, queue, teacher_dir: str) -> None:
    """One of the teacher's own ranks (the plan's teacher process under Ray): its FSDP2 shard of the
    teacher, its share of a rollout-layout batch (as the HF engine makes it, fitrl/rollout/layout.py:
    left-padded prompts of random ids, every response ``R`` tokens), one warm-up pass, then the
    measured one."""
    import torch
    import torch.distributed as dist

    c, cfg = rank_setup(rank, world, port, case, model_dir, teacher_dir)
    from fitrl.core.padding import left_pad
    from fitrl.data.batch import Batch
    from fitrl.models.loading import load_tokenizer
    from fitrl.roles.teacher import TeacherWorker
    from fitrl.rollout.layout import rollout_batch

    teacher = TeacherWorker(cfg, rank=rank, world_size=world)
    pad = load_tokenizer(cfg.actor.model).pad_token_id
    g = torch.Generator().manual_seed(rank)
    vocab = teacher.vocab - 8
    lengths = torch.randint(c.prompt_len // 2, c.prompt_len + 1, (c.prompts // world,), generator=g).tolist()
    lengths[0] = c.prompt_len
    prompts = Batch(fields={"prompt_ids": [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]})
    seqs = prompts.repeat_interleave(c.n)
    ids, mask = left_pad(seqs["prompt_ids"], pad, c.prompt_len)
    responses = torch.randint(10, vocab, (len(seqs), c.response_len), generator=g)
    ones = torch.ones_like(responses)
    batch = rollout_batch(prompts, seqs, ids, mask, responses, ones, ones, torch.zeros(len(seqs), dtype=torch.long),
                          torch.zeros(responses.shape), pad_id=pad, inputs=teacher.inputs)
    teacher.compute_teacher_logprob(batch)  # warm-up: the allocator as from the second step on

    def run(phase: str) -> None:
        lp = teacher.compute_teacher_logprob(batch)
        del lp

    queue.put(json.dumps({"rank": rank} | measured_phases(["teacher"], run)))
    dist.barrier()
    dist.destroy_process_group()
