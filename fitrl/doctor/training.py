"""Rungs ``fsdp`` and ``checkpoint``: the policy's rank as a run builds it (fitrl/roles/workers.py,
``PolicyWorker``: FSDP2 shard and rank-0 broadcast, AdamW, the offload between phases), on the
tiny model, at the node's world size, with each offload mode this device has.

- fsdp: the gathered weights equal the checkpoint's; one supervised step (gradient clipping
  over the sharded gradients, the AdamW update); the optimizer's states where the update reads
  them; the weight stream a push drains (``full_tensor()`` of every shard).
- checkpoint: after a step, save; a fresh worker (a resume, or a restart) loads it: the same
  weights, states in place, and one more step works. This is what a fused AdamW's ``step`` or a
  moment left on the host fails, with the parameters back on the GPU.
"""

from __future__ import annotations

import math

import torch

from fitrl.doctor.child import RankContext
from fitrl.doctor.ladder import Failure, Passed

# (name, overrides, devices it means something on): on a CPU device the offload between phases is
# a no-op (fitrl/roles/offload.py), so only FSDP2's own CPU offload is exercised there
OFFLOAD_CASES = (
    ("no offload", (), ("cpu", "cuda")),
    ("fsdp.cpu_offload", ("actor.fsdp.cpu_offload=true",), ("cpu", "cuda")),
    ("offload between phases", ("actor.fsdp.offload_params=true", "actor.fsdp.offload_optimizer=true"), ("cuda",)),
)
NOT_HERE = "CUDA only: on a CPU device the offload between phases is a no-op (fitrl/roles/offload.py)"
PROMPTS = ["What is 1 + 2? Answer with a number.", "What is 7 + 5? Answer with a number.", "Hi", "What is 0 + 0?"]
PROMPTS_PER_RANK = 2


def policy_config(ctx: RankContext, *overrides: str):
    """A run's config for the policy on the tiny model: this session's ranks as the Ray backend's
    (one node), two prompts per rank per optimizer step, the device's defaults filled in."""
    from fitrl.config import load_config

    n = PROMPTS_PER_RANK * ctx.world
    cfg = load_config(None, [
        f"actor.model.path={ctx.model_dir}", f"trainer.device={ctx.device_type}", "trainer.backend=ray",
        "trainer.nnodes=1", f"trainer.devices_per_node={ctx.world}", f"data.rollout_batch_size={n}",
        f"actor.mini_batch_size={n}", f"actor.micro_batch_size={PROMPTS_PER_RANK}", "rollout.n=2",
        "rollout.max_response_length=8", "data.max_prompt_length=64", "memory.plan=off", "trainer.seed=0",
        *overrides])
    return cfg.with_device_defaults(ctx.device_type)


def build_worker(ctx: RankContext, *overrides: str):
    from fitrl.roles.workers import PolicyWorker

    ctx.group()
    return PolicyWorker(policy_config(ctx, *overrides), rank=ctx.rank, world_size=ctx.world)


def prompts_for(worker, rank: int):
    """This rank's prompts with answers (a supervised step's input, as ``fitrl sft`` makes it)."""
    from fitrl.data.batch import Batch

    tok = worker.tokenizer
    texts = [PROMPTS[(rank * PROMPTS_PER_RANK + i) % len(PROMPTS)] for i in range(PROMPTS_PER_RANK)]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for t in texts]
    return Batch(fields={"prompt_ids": ids, "answer": [str(3 + i) for i in range(len(texts))]})


def step(worker, ctx: RankContext, case: str) -> float:
    """One supervised optimizer step; its loss (finite, or a Failure)."""
    metrics = worker.sft_update(prompts_for(worker, ctx.rank))
    loss = metrics.get("sft/nll", float("nan"))  # the targets' negative log-likelihood
    norm = metrics.get("actor/grad_norm", 0.0)
    if not (math.isfinite(loss) and math.isfinite(norm)):
        raise Failure(f"{case}: a step's loss {loss} / gradient norm {norm} is not finite",
                      "the kernels compute garbage on this device: check the attention rung and the driver")
    return float(loss)


def states_in_place(worker, case: str) -> None:
    """The AdamW states where the next update reads them (moments beside their parameters, a
    fused kernel's ``step`` too), checked inside an update's phase, as the update sees them."""
    from fitrl.distributed.host_device import optimizer_state_misplaced

    with worker.offload.phase(needs_optimizer=True):
        wrong = optimizer_state_misplaced(worker.actor.optimizer)
    if wrong:
        raise Failure(f"{case}: {len(wrong)} optimizer state tensor(s) on the wrong device, e.g. {wrong[0]}",
                      "the first update would fail (a resume or restart with offload): update fitrl")


def full_weights(worker) -> dict[str, torch.Tensor]:
    """Every weight unsharded on the host (rank 0; the others get what FSDP2 hands them)."""
    return {k: v.float() for k, v in worker.state_dict().items()}


def _checkpoint_weights(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}


def fsdp(ctx: RankContext) -> Passed:
    return _each_case(ctx, OFFLOAD_CASES, _fsdp_case, "shard, gather, a step and the push stream")


def checkpoint(ctx: RankContext) -> Passed:
    # the offload modes: where resumes went wrong
    return _each_case(ctx, OFFLOAD_CASES[1:], _checkpoint_case, "save, resume into a fresh worker (same weights, "
                      "optimizer states in place) and one more step,")


def _each_case(ctx: RankContext, cases, run_case, what: str) -> Passed:
    """``run_case(ctx, case, overrides)`` for each of ``cases`` this device has, its data kept under
    the case's name, and the case's memory given back before the next one builds (its workers went
    with its frame); ``what``: what the rung did, for its line."""
    done, data = [], {"skipped": {}}
    for case, overrides, where in cases:
        if ctx.device_type not in where:
            data["skipped"][case] = NOT_HERE
            continue
        data[case] = run_case(ctx, case, overrides)
        done.append(case)
        _free()
    not_run = "".join(f"; {case}: skipped, CUDA only" for case in data["skipped"])
    return Passed(f"{ctx.world} rank(s) on {ctx.device_type}: {what} with {', '.join(done)}{not_run}", data)


def _fsdp_case(ctx: RankContext, case: str, overrides: tuple[str, ...]) -> dict:
    worker = build_worker(ctx, *overrides)
    gathered = full_weights(worker)
    if ctx.rank == 0:  # the rank-0 broadcast into every rank's shards, gathered back
        source = _checkpoint_weights(ctx.model_dir)
        common = sorted(set(source) & set(gathered))
        off = [k for k in common if not torch.equal(source[k], gathered[k])]
        if not common or off:
            raise Failure(f"{case}: the gathered weights are not the checkpoint's ({len(off)} of {len(common)} "
                          f"differ, e.g. {off[:1] or 'no common names'})",
                          "the rank-0 broadcast or the gather is broken on this backend: see the collective rung")
    loss = step(worker, ctx, case)
    states_in_place(worker, case)
    pushed = worker.inference_weights("bfloat16")  # the weight push's stream: full_tensor() of every shard
    if ctx.rank == 0 and not pushed:
        raise Failure(f"{case}: the weight stream a push drains came back empty")
    return {"loss": loss, "pushed_tensors": len(pushed or {})}


def _checkpoint_case(ctx: RankContext, case: str, overrides: tuple[str, ...]) -> dict:
    import torch.distributed as dist

    worker = build_worker(ctx, *overrides)
    step(worker, ctx, case)
    path = ctx.work / "checkpoint" / case.replace(" ", "-").replace(".", "-") / "actor"
    worker.save_checkpoint(str(path))
    saved = full_weights(worker)
    del worker
    _free()
    dist.barrier()
    resumed = build_worker(ctx, *overrides)  # a resume, or an automatic restart, builds afresh
    resumed.load_checkpoint(str(path))
    back = full_weights(resumed)
    if ctx.rank == 0:
        off = [k for k in saved if not torch.equal(saved[k], back.get(k, torch.empty(0)))]
        if off:
            raise Failure(f"{case}: {len(off)} weight(s) differ after the resume, e.g. {off[0]}",
                          "the checkpoint did not restore the shards: `fitrl checkpoint verify` the run's")
    states_in_place(resumed, f"{case}, after the resume")
    return {"loss_after_resume": step(resumed, ctx, f"{case}, after the resume")}


def _free() -> None:
    """Give a dropped case's memory back before the next case builds (its weights on the device)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
