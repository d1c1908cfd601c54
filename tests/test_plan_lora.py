"""The planner with LoRA (actor.lora.*): adapter states counted from the model shape, no reference
model, PEFT's forward traced, and the LoRA recommendation (fitrl/memory/)."""

from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from fitrl.config import load_config
from fitrl.config.choices import algorithm_needs
from fitrl.config.schema import FSDPConfig, LoRAConfig, ModelConfig, OptimConfig
from fitrl.planner import Hardware, plan_config
from fitrl.memory import calibration as C
from fitrl.memory.roles import resident, role_states
from fitrl.memory.run import Run
from fitrl.planner.recommend import candidates, recommend
from fitrl.models.shape import ModelShape, numel
from fitrl.memory.states import lora_layer_params, lora_states, trained_states
from fitrl.memory.trace import trace_spec, transient_bytes
from fitrl.models.loading import build_model
from fitrl.models.params import LoRA
from fitrl.ops.logprob import response_logprobs
from fitrl.roles.actor import build_optimizer

ROOT = Path(__file__).resolve().parent.parent
ARITH = str(ROOT / "examples" / "arith.yaml")
QWEN_7B = ROOT / "examples" / "failure_stories" / "models" / "qwen2.5-7b-instruct"

# hidden 8, 2 heads of 4 (q: 8 rows), 1 KV head (k, v: 4 rows), MLP 16, 2 layers
TINY = ModelShape.from_dict(dict(model_type="qwen2", hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=16, vocab_size=32))


class _NoHook:  # MemTracker's gradient hooks cannot attach to a frozen parameter: nothing to remove
    def remove(self) -> None:
        pass


NO_HOOK = _NoHook()


def test_adapter_counts_by_hand():
    # r * (in + out) with r = 2: q 2*(8+8), k and v 2*(8+4), o 2*(8+8), gate and up 2*(8+16), down 2*(16+8)
    per_layer = 32 + 24 + 24 + 32 + 48 + 48 + 48
    assert per_layer == 256
    assert sum(numel(s) for _, s in TINY.lora_tensors(2, ["all-linear"])) == 2 * per_layer
    assert lora_layer_params(TINY, 2, ["all-linear"]) == per_layer
    assert sum(numel(s) for _, s in TINY.lora_tensors(2, ["q_proj", "v_proj"])) == 2 * (32 + 24)
    assert ("model.layers.1.self_attn.k_proj.lora_B.default.weight", (4, 2)) in TINY.lora_tensors(2, ["all-linear"])
    assert TINY.lora_tensors(0, ["all-linear"]) == []
    assert not any("lm_head" in n or "embed" in n for n, _ in TINY.lora_tensors(2, ["all-linear"]))


def test_lora_states_by_hand():
    """Base: weights only (fp32); adapters: weights 4 + gradients 4 + AdamW 8 bytes, and a 4-byte
    ``step`` per adapter tensor (7 linears x 2 tensors x 2 layers)."""
    st = lora_states(TINY, 2, ["all-linear"])
    assert st.params == TINY.num_params * 4 + 512 * 4
    assert st.grads == 512 * 4
    assert st.optimizer == 512 * 8 + 28 * 4
    # sharded over 2 ranks, dim 0 as FSDP2 does: A (2, in) -> 1 row; B (out, 2) -> out/2 rows
    two = lora_states(TINY, 2, ["all-linear"], world=2)
    assert two.grads == 256 * 4 and two.params == trained_states(TINY, world=2).params + 256 * 4


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_llama_dir"])
@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"]])
def test_closed_forms_equal_a_real_peft_policy(fixture, targets, request):
    """The policy as PolicyWorker builds it (fitrl/models/params.py): the adapters' names and sizes,
    and after one AdamW step its weights, gradients and optimizer states equal lora_states."""
    path = request.getfixturevalue(fixture)
    shape = ModelShape.from_path(path)
    lora = LoRAConfig(rank=4, target_modules=targets)
    model = build_model("causal_lm", ModelConfig(path=str(path)), FSDPConfig(), torch.device("cpu"), params=LoRA(lora))
    trained = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    expected = dict(shape.lora_tensors(4, targets))
    assert trained == expected
    opt = build_optimizer(model, OptimConfig(lr=1e-3))
    ids = torch.randint(0, shape.vocab, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    st = lora_states(shape, 4, targets)
    assert st.params == sum(p.numel() * p.element_size() for p in model.parameters())
    assert st.grads == sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    assert st.optimizer == sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())


def _run(*overrides: str, path) -> Run:
    cfg = load_config(ARITH, [f"actor.model.path={path}", "algorithm.use_kl_loss=true", "actor.micro_batch_size=4",
                              *overrides])
    hw = Hardware(nodes=1, gpus_per_node=2, device="cuda")
    return Run(cfg, hw, ModelShape.from_path(path), None, algorithm_needs(cfg))


def test_no_reference_model_with_lora(tiny_model_dir):
    """KL on: full fine-tuning plans a reference model, LoRA none; the policy's weights are on the
    device in the reference phase (it computes the reference log-probs) even when offloaded."""
    ray = ("trainer.backend=ray", "trainer.devices_per_node=2", "actor.fsdp.offload_params=true")
    full, lora = _run(*ray, path=tiny_model_dir), _run(*ray, "actor.lora.rank=4", path=tiny_model_dir)
    assert set(role_states(full)) == {"actor", "ref"}
    assert set(role_states(lora)) == {"actor"}
    assert role_states(lora)["actor"][0] == lora_states(lora.shape, 4, ["all-linear"], world=2)
    assert role_states(full)["actor"][0] == trained_states(full.shape, world=2)  # LoRA off: as before
    assert resident("actor", lora.cfg.actor, "ref_logprob", lora)[0]      # weights on the device
    assert not resident("actor", full.cfg.actor, "ref_logprob", full)[0]  # offloaded: not its phase


@pytest.mark.slow
def test_plan_has_no_reference_parts_with_lora(tiny_model_dir):
    """Whole plans (traced): every phase of the LoRA plan is without reference states; its update
    holds the adapters' gradients only; the reference phase uses the policy's micro-batches."""
    hw = Hardware(nodes=1, gpus_per_node=1, device="cuda")
    cfg = lambda *o: load_config(ARITH, [f"actor.model.path={tiny_model_dir}", "algorithm.use_kl_loss=true",  # noqa: E731
                                         "ref.logprob_micro_batch_size=2", *o])
    full, lora = plan_config(cfg(), hw), plan_config(cfg("actor.lora.rank=4"), hw)
    parts = lambda p: {k for u in p.process("trainer").phases.values() for k in {**u.gpu, **u.host}}  # noqa: E731
    assert any(k.startswith("ref ") for k in parts(full))
    assert not any("ref " in k for k in parts(lora))
    adapters = sum(numel(s) for _, s in lora.shape.lora_tensors(4, ["all-linear"]))
    assert lora.process("trainer").phases["update"].gpu["grads"] == adapters * 4
    assert any("no reference model" in n for n in lora.notes)
    runtime = lambda p: p.process("trainer").phases["load"].host["runtime"]  # noqa: E731
    assert runtime(lora) - runtime(full) == C.PEFT_IMPORT_HOST  # only LoRA runs import PEFT
    ref, old = (lora.process("trainer").phases[ph].gpu["activations"] for ph in ("ref_logprob", "old_logprob"))
    assert ref <= old  # same micro-batch (the policy's), without the adapters' path


def test_lora_trace_equals_memtracker_on_a_real_peft_policy(tiny_model_dir):
    """PEFT's forward and backward traced on fake adapters (fitrl/memory/trace.py) hold what the
    real LoRA policy holds under MemTracker, within 0.1% and the batch's (B, T) int64 inputs
    (tests/test_plan_trace.py); the reference (adapters off) phase is the plain model's trace."""
    shape = ModelShape.from_path(tiny_model_dir)
    lora = LoRAConfig(rank=4)
    B, T, R = 4, 48, 32
    model = build_model("causal_lm", ModelConfig(path=str(tiny_model_dir)), FSDPConfig(), torch.device("cpu"),
                        params=LoRA(lora))
    model.train()
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    ids = torch.randint(0, shape.vocab, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1:, :2] = 0
    pos = torch.arange(T).expand(B, T)
    tracker = MemTracker()
    tracker.track_external(model)
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (NO_HOOK, NO_HOOK)
    with tracker:
        logp, _ = response_logprobs(model, ids, mask, pos, R, chunk_size=64, with_entropy=True)
        (logp * torch.zeros(B, R)).sum().backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    real = peak["Total"] - sum(v for k, v in peak.items() if getattr(k, "value", k) in ("Parameter", "Buffer", "Gradient"))
    spec = trace_spec(shape, phase="update", batch=B, seq_len=T, response_len=R, chunk=64, lora=lora)
    assert abs(transient_bytes(spec, shape.layers) - real) <= 1e-3 * real + 3 * B * T * 8
    plain = trace_spec(shape, phase="logprob", batch=B, seq_len=T, response_len=R, chunk=64)
    assert trace_spec(shape, phase="logprob", batch=B, seq_len=T, response_len=R, chunk=64, lora=LoRAConfig()) == plain


# ------------------------------------------------------------------------------ recommendation

def _seven_b(*overrides: str):
    """Qwen2.5-7B on one 80 GiB GPU, in-process, KL on: full fine-tuning needs ~113 GiB of
    weights, gradients and AdamW states; nothing but LoRA makes it fit."""
    cfg = load_config(ARITH, [f"actor.model.path={QWEN_7B}", "algorithm.use_kl_loss=true",
                              "actor.micro_batch_size=4", "actor.logprob_micro_batch_size=4",
                              "ref.logprob_micro_batch_size=4", *overrides])
    return plan_config(cfg, Hardware(nodes=1, gpus_per_node=1, gpu_memory=80 * C.GIB, host_memory=2048 * C.GIB))


@pytest.mark.slow
def test_lora_is_recommended_where_only_it_fits():
    plan = _seven_b()
    assert not plan.fits
    singles, combo = recommend(plan)
    fits = [r for r in singles if r.fits]
    assert [r.change.text for r in fits] == ["LoRA (actor.lora.rank=16)"], [r.change.text for r in singles]
    rec = fits[0]
    assert rec.change.overrides == [("actor.lora.rank", 16)] and "training change" in rec.change.cost
    # its effect: the optimizer states and gradients of 7.6B parameters, and the reference model, leave the GPU
    assert rec.gpu_delta < -80 * C.GIB
    assert not rec.plan.problems() and combo is None
    # ranked with the training changes: after every change that keeps the training as it is
    texts = [c.text for c in candidates(plan)]
    assert texts.index("LoRA (actor.lora.rank=16)") > texts.index("actor.model.gradient_checkpointing false -> true")


@pytest.mark.slow
def test_lora_is_not_offered_when_on_or_when_it_does_not_fit():
    assert not any("LoRA" in c.text for c in candidates(_seven_b("actor.lora.rank=8")))
    # the vLLM engine's plan does not model LoRA's merged-weight push (the failure stories are such runs)
    assert not any("LoRA" in c.text for c in candidates(_seven_b("rollout.engine=vllm")))
    # 32 GiB (28.8 usable): the frozen 7B base (28.4 GiB), CUDA context and activations do not fit either
    small = plan_config(_seven_b().cfg, Hardware(nodes=1, gpus_per_node=1, gpu_memory=32 * C.GIB,
                                                 host_memory=2048 * C.GIB))
    assert not plan_config(_seven_b("actor.lora.rank=16").cfg, small.hardware).fits
    assert not any("LoRA" in r.change.text for r in recommend(small)[0])
