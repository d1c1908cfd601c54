"""Helpers shared by integration tests (pytest puts tests/ on sys.path)."""

import importlib.util
import json
import sys
from pathlib import Path

from fitrl.config import load_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "arith.yaml")
DATA = ROOT / "examples" / "data"


def toy_config(model_dir, run_dir, *overrides):
    """The shipped toy-task config pointed at a test model and run directory. The memory plan is
    off (it costs ~0.7 s per new config; tests/test_preflight.py turns it on)."""
    return load_config(EXAMPLE, [
        f"actor.model.path={model_dir}", f"trainer.run_dir={run_dir}",
        f"data.train_files=[{DATA / 'arith_train.jsonl'}]", f"data.val_files=[{DATA / 'arith_val.jsonl'}]",
        "trainer.progress_bar=false", 'memory.plan=off', *overrides])


def read_metrics(run_dir, memory_events=False):
    """The records of a run's metrics.jsonl; without ``memory_events``, less the load's and the end's
    memory records (fitrl/telemetry/run_memory.py), which every run writes beside its steps."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if memory_events or r.get("event") != "memory"]


def tiny_rollout(model_dir):
    """A tiny policy (fp32, CPU) and its 8-sequence rollout of four chat prompts, 2 samples each,
    at most 6 tokens (seeded): the batch the actor tests add log-probs and advantages to."""
    import torch

    from fitrl.config.schema import FSDPConfig, ModelConfig, SamplingConfig
    from fitrl.data.batch import Batch
    from fitrl.models.loading import build_model, load_tokenizer
    from fitrl.rollout.hf import HFRollout

    mcfg = ModelConfig(path=str(model_dir))
    tok = load_tokenizer(mcfg)
    model = build_model("causal_lm", mcfg, FSDPConfig(), torch.device("cpu"))
    texts = ["What is 1 + 2?", "What is 7 + 5? Answer with a number.", "Hi", "What is 0 + 0?"]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"] for t in texts]
    torch.manual_seed(0)
    return model, HFRollout(model, tok).generate(Batch(fields={"prompt_ids": ids}), SamplingConfig(n=2, max_tokens=6))


def load_bench(name: str):
    """``bench/<name>.py`` as a module (bench/ is scripts, not a package)."""
    path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


FP32_UNIT_ROUNDOFF = 2.0 ** -24
ADAM_STEP_OPS = 8
"""Rounded float operations between a gradient and its weight's update in one AdamW step."""


def adam_step_tolerance(before: dict, after: dict, *, lr: float, eps: float, grad_norm: float, terms: int,
                        unit_roundoff: float = FP32_UNIT_ROUNDOFF) -> dict:
    """Per-element bounds on how far two computations' weights may differ after one AdamW step
    (no weight decay) from the same ``before`` weights, when their gradients differ only by the
    rounding of summing the same ``terms`` products in another order (other ranks, other
    micro-batches). ``after``: one computation's weights after the step, which says each
    element's gradient size.

    Adam's first step is ``-lr * g / (|g| + eps)`` (its bias corrections make ``m = g`` and
    ``v = g**2``), so an element's step ``s = |dw| / lr`` gives ``|g| = eps * s / (1 - s)``, and
    the step moves by ``lr * eps * dg / (|g| + eps)**2`` per ``dg`` of gradient: tiny where
    ``|g| >> eps``, up to the whole ``2 lr`` where the gradient is at its rounding noise (a sign
    may flip). ``dg`` is a sum's worst-case rounding: ``terms * u`` times the gradient's scale
    (its global norm). Each side also rounds the step itself, through :data:`ADAM_STEP_OPS`
    operations (both moments, the bias corrections, the square root, the division, the scaled
    add: up to ``ops * u * lr`` each side), and the weight it adds to (``u |w|`` each side)."""
    import torch

    dg = terms * unit_roundoff * grad_norm
    bounds = {}
    for name, w0 in before.items():
        w0 = w0.double()
        s = ((after[name].double() - w0).abs() / lr).clamp(max=1.0)
        g = eps * s / (1 - s).clamp(min=1e-12)
        near = (g - dg).clamp(min=0.0)  # the smallest gradient the rounding allows: the steepest slope
        moved = (lr * eps * dg / (near + eps) ** 2).clamp(max=2 * lr)
        rounding = 2 * unit_roundoff * (w0.abs() + ADAM_STEP_OPS * lr)
        bounds[name] = moved + rounding + torch.finfo(torch.float32).tiny
    return bounds


def assert_same_adam_step(state: dict, ref: dict, before: dict, *, label: str = "", **step) -> None:
    """``state`` is ``ref`` within :func:`adam_step_tolerance` (``step``: its keywords) everywhere."""
    assert set(state) == set(ref)
    bounds = adam_step_tolerance(before, ref, **step)
    worst, where = 0.0, ""
    for name, b in bounds.items():
        ratio = ((state[name].double() - ref[name].double()).abs() / b).max().item()
        if ratio > worst:
            worst, where = ratio, name
    assert worst <= 1.0, f"{label}: {where} differs by {worst:.2f}x its rounding bound"


def logprobs_and_grads(model, ids, mask, pos, R, *, temperature: float, entropy_grad: bool, **layout):
    """One :func:`fitrl.ops.logprob.response_logprobs` pass (``layout``: ``share_prompts``,
    ``pack``) and the gradients of a loss over its log-probs (and entropies, with
    ``entropy_grad``) on the real response tokens: (log-probs, entropies, gradients)."""
    import torch

    from fitrl.ops.logprob import response_logprobs

    live = mask[:, -R:].bool()
    adv = torch.randn(ids.shape[0], R, generator=torch.Generator().manual_seed(4))
    lp, ent = response_logprobs(model, ids, mask, pos, R, temperature=temperature, chunk_size=5, with_entropy=True,
                                entropy_grad=entropy_grad, **layout)
    loss = (lp * adv * live).sum() + ((ent * live).sum() if entropy_grad else 0.0)
    return lp.detach(), ent.detach(), torch.autograd.grad(loss, list(model.parameters()))


def assert_same_pass(plain, other, live) -> None:
    """Two :func:`logprobs_and_grads` results agree on the real tokens, to rounding."""
    import torch

    (lp0, ent0, g0), (lp1, ent1, g1) = plain, other
    assert torch.allclose(lp0[live], lp1[live], atol=2e-5), (lp0 - lp1)[live].abs().max()
    assert torch.allclose(ent0[live], ent1[live], atol=2e-5)
    for a, b in zip(g0, g1):  # summed in another order: rounding, relative to the tensor's norm
        assert (a - b).norm() <= 1e-5 * a.norm() + 1e-7, ((a - b).norm(), a.norm())
    assert any(a.abs().sum() > 0 for a in g0)


def assert_text_full_attention_only(can, model) -> None:
    """``can(model, position_ids, model_kwargs)`` (a split forward's applicability) holds for a
    text model's plain positions and for nothing with images, a multimodal rope's positions or
    sliding-window attention."""
    import copy

    import torch

    pos = torch.zeros(2, 4, dtype=torch.long)
    assert can(model, pos, None)
    assert not can(model, pos, {"pixel_values": torch.zeros(1)})  # images ride with the prompt
    assert not can(model, pos[:, None].expand(2, 3, 4), None)  # a multimodal rope's positions
    sliding = copy.deepcopy(model)
    if getattr(sliding.config, "layer_types", None):  # qwen2
        sliding.config.layer_types = ["sliding_attention"] * len(sliding.config.layer_types)
    else:  # llama: a Mistral-style window
        sliding.config.sliding_window = 16
    assert not can(sliding, pos, None)


def positions_run(model, fn) -> int:
    """The token positions the first decoder layer ran over ``fn()`` (a packed or shared-prompt
    forward runs fewer than a padded one)."""
    seen = []
    hook = model.model.layers[0].register_forward_hook(lambda m, args, out: seen.append(args[0].shape[:2].numel()))
    try:
        fn()
    finally:
        hook.remove()
    return sum(seen)
