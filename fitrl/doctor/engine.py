"""Rung ``engine``: the rollout engine a run on this node would use, on the tiny policy.

vLLM where it imports (else the HF engine, naming why vLLM was not used): build it beside the
trained module (``PolicyWorker``, as a run does), generate, sleep and wake, perturb the trainer's
weights and push them; after each step the engine's log-probs of the tokens it sampled must equal
the trainer's for the same tokens within the engine's precision. A push that did not arrive, or
weights corrupted by a wake (the peers' most reported breakage in 2026), shows as a gap of the
size of the perturbation instead.
"""

from __future__ import annotations

import torch

from fitrl.doctor.child import RankContext
from fitrl.doctor.ladder import Failure, Passed
from fitrl.doctor.training import PROMPTS, policy_config

TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2}
"""Mean |engine - trainer| log-prob over the sampled tokens that still agrees: fp32 kernels differ
by rounding (the vLLM CPU tier's max is 1e-4), bf16 ones by bf16's 3 significant digits. A
missed push moves it by the perturbation's :data:`MOVED` at least."""
MOVED = 10.0
"""The perturbation must move the trainer's own log-probs by this many tolerances, or the check
after the push could not tell a missed push from a good one."""


def engine_choice() -> tuple[str, str]:
    """(engine, why): vLLM where it imports, else the HF engine and vLLM's import error."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # absent, or built for another torch / CUDA: its error says which
        return "hf", f"vLLM not importable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    return "vllm", ""


def engine(ctx: RankContext) -> Passed:
    from fitrl.data.batch import Batch
    from fitrl.roles.workers import PolicyWorker

    name, why = engine_choice()
    extra = ("rollout.kv_cache_memory=1GiB",) if name == "vllm" else ()  # a tiny model: a small KV cache builds fast
    cfg = policy_config(ctx, f"rollout.engine={name}", "trainer.backend=inprocess", "trainer.devices_per_node=1",
                        "rollout.temperature=1.0", "rollout.max_response_length=16", *extra)
    worker = PolicyWorker(cfg, rank=0, world_size=1)
    tok = worker.tokenizer
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for t in PROMPTS]
    prompts, sampling = Batch(fields={"prompt_ids": ids}), cfg.rollout.sampling()
    dtype = worker.engine_context().dtype
    tol = TOLERANCE.get(dtype, TOLERANCE["bfloat16"])
    gaps = {}

    def check(stage: str, fix: str):
        out = worker.generate(prompts, sampling)  # wake, generate, sleep: as a rollout phase does
        mean, top = gap(worker, out)
        gaps[stage] = {"mean": mean, "max": top}
        if not mean <= tol:
            raise Failure(f"{name} engine, {stage}: its log-probs of its own samples differ from the trainer's by "
                          f"{mean:.3g} on average (max {top:.3g}; {dtype} agrees within {tol:g})", fix, {"gaps": gaps})
        return out

    out = check("after the build", "the engine computes another model than the trainer's: check the model "
                "directory's config and the engine's dtype (rollout.* keys)")
    worker.rollout.sleep()
    worker.rollout.wake()
    check("after sleep and wake", "the engine's weights or buffers were lost across sleep/wake: try "
          "rollout.sleep_level=1, or rollout.enforce_eager=true (CUDA graphs reading freed memory); report it "
          "with the vLLM version")
    before = worker.compute_logprob(out)["old_logprobs"]
    with torch.no_grad():  # an update's worth of change, and more: every weight moved by twice its spread
        for p in worker.model.parameters():
            p.add_(torch.randn_like(p) * (2.0 * float(p.float().std()) if p.numel() > 1 else 0.0))
    moved = masked_mean((worker.compute_logprob(out)["old_logprobs"] - before).abs(), out["response_mask"])
    if not moved >= MOVED * tol:
        raise Failure(f"perturbing the trainer's weights moved its log-probs by only {moved:.3g}: the check after "
                      "the push could not see a missed one", "a doctor bug: report it")
    worker.rollout.push_weights()
    check("after the weight push", "the push did not reach the engine's weights (or reached them wrong): "
          "rollout.* layout keys; report it with the vLLM version")
    worker.rollout.release()
    skipped = f"; {why}, the HF engine instead" if why else ""
    return Passed(f"{name} engine ({dtype}) on {ctx.device_type}: build, generate, sleep, wake and push, the "
                  f"engine's log-probs within {max(g['mean'] for g in gaps.values()):.2g} of the trainer's "
                  f"(tolerance {tol:g}; the push moved them by {moved:.2g}){skipped}",
                  {"engine": name, "dtype": dtype, "gaps": gaps, "perturbation": moved, "vllm_skipped": why})


def gap(worker, out) -> tuple[float, float]:
    """Mean and max |engine - trainer| log-prob of the sampled response tokens."""
    trainer = worker.compute_logprob(out)["old_logprobs"]
    diff = (trainer - out["rollout_logprobs"]).abs()
    mask = out["response_mask"].bool()
    return masked_mean(diff, mask), float(diff[mask].max()) if mask.any() else 0.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    mask = mask.bool()
    return float(x[mask].mean()) if mask.any() else 0.0
