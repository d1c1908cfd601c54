"""Activations and logits by tracing the real step code on the ``meta`` device.

A model of the real width (hidden size, heads, MLP, vocabulary) but 2 and then 3 decoder layers
is built from its config on the ``meta`` device (no memory is allocated, so the real batch
and sequence length cost nothing: meta tensors are shapes) and fitrl's own log-prob code
(:func:`fitrl.ops.logprob.response_logprobs`, with its chunked lm_head) runs forward, and for
the update backward, inside :class:`fitrl.memory.live_bytes.StorageBytes`, which counts every
tensor storage the step creates, from its creation until it is freed. The transient of a phase
is that peak: the weights and gradients exist before (:mod:`fitrl.memory.states` gives them in
closed form). From two layers on it is linear in the depth (saved activations and KV grow per layer;
without autograd the peak is one layer's working set or the head, constant), so ``L`` layers
cost ``t(2) + (L - 2) * (t(3) - t(2))`` (checked against a traced 5-layer model in the tests); a
prefill of a plain decoder (:data:`PLAIN_KV_DECODERS`) grows by one layer's K/V, which is known, so
it is traced at two layers only.

Meta tensors are made to take a CPU tensor's memory paths (:func:`_as_on_cpu`), so the bytes
equal a trace under ``FakeTensorMode`` on a fake CPU, the reference the tests compare against
and the fallback when a model's code reads a tensor's value; the meta trace is 2-3x faster (a
first launch's start-up: bench/RESULTS.md, "The plan's traces on the meta device").

The traced rows have distinct prompts unless ``prompts`` says how many the micro-batch's rows
share: then the log-prob or update pass runs the shared-prompt forward
(``actor.share_prompts``, :mod:`fitrl.ops.shared_prompt`) on that many groups. An update holds
less (no activations of the prompt copies); a pass without gradients holds more, the prompts'
keys and values of every layer through the responses' pass, where the plain one keeps one
layer's working set. The planner asks for it only under jemalloc or tcmalloc in one process
(:meth:`fitrl.memory.run.Run.prompt_groups`): glibc's heap peak did not fall with it on every
model (bench/RESULTS.md, "Shared prompts") and on GPUs it is unmeasured, so there the plan stays
the plain forward's.

What the trace leaves out, on purpose: the policy loss and the per-token statistics (B, R)
tensors (the update traces ``(logp * advantages).sum()``; those tensors are 1/V of the logits),
and padding trimming (the traced batch has no padding columns; trimming is the identity).
FSDP2's gathered weights and gradient buffers are added in closed form by the planner.

A mixture of experts (Qwen3-MoE) is traced as built from its layout's keys
(:meth:`fitrl.models.decoder.MoeDecoder.config`): transformers' grouped experts forward sends
every token to its top-k experts as ``tokens x k`` rows, so what a layer holds follows k, not the
experts, whatever the routing (the router's logits and probabilities, ``tokens x E``, come with
it). Its grouped matmul's meta kernel takes only bf16, so the trace runs transformers' fallback
operator instead (:func:`_experts_by_shape`): the same output and the same two saved tensors, its
input rows and the expert weights.

With LoRA (``lora_rank > 0``) the traced model gets the same PEFT adapters as the policy
(:class:`fitrl.models.params.LoRA`, before gradient checkpointing, as fitrl/models/loading.py
applies them), and only the adapters get gradients: the trace then holds what PEFT's forward
keeps (each adapted layer's input for ``lora_A``, its ``tokens x r`` output for ``lora_B``, the
dropout copies when ``lora_dropout > 0``) and what the frozen base no longer saves.
"""

from __future__ import annotations

import contextlib
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from unittest import mock

from fitrl.config.roles import LoRAConfig

DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class TraceSpec:
    """One phase's micro-step on one device. ``text_config`` is a frozen tuple of (key, value)."""
    text_config: tuple
    phase: str                  # "logprob" (no grad), "update" (forward + backward), "prefill" (generate's first
                                # forward), "score" (a reward model's forward: fitrl/roles/model_reward.py),
                                # "values" / "value_update" (the critic's passes: fitrl/roles/critic.py)
    batch: int                  # sequences in the micro-batch
    seq_len: int                # prompt + response tokens per sequence (the prompt alone for prefill)
    response_len: int           # response tokens (log-probs are taken over these)
    dtype: str = "float32"      # compute dtype
    checkpointing: bool = False
    chunk: int = 1024           # actor.logprob_chunk_size
    entropy_grad: bool = False  # entropy in the loss (actor.entropy_coeff != 0)
    attn: str = "sdpa"
    lora_rank: int = 0          # LoRA adapters on (actor.lora.rank > 0)
    lora_targets: tuple = ()    # actor.lora.target_modules
    lora_dropout: float = 0.0   # actor.lora.dropout
    prompts: int = 0            # distinct prompts of the micro-batch when its rows share them (actor.share_prompts:
                                # each runs once, fitrl/ops/shared_prompt.py); 0: every row its own prompt


VALUE_PHASES = ("values", "value_update")
"""The critic's passes: its values without gradients, and its update (forward, backward)."""

PLAIN_KV_DECODERS = frozenset({"qwen2", "llama", "qwen3"})
"""Decoders whose prefill keeps one plain K/V pair per layer and nothing else that grows with
depth: their traced prefill grows by exactly one layer's cache from two layers to three (checked
per type in tests/test_plan_trace.py), so a deep model's prefill needs only the 2-layer trace."""


def transient_bytes(spec: TraceSpec, layers: int) -> int:
    """Peak bytes of the phase beyond weights and gradients, for a model of ``layers`` layers."""
    if layers <= 3:
        return _stored(spec, layers)
    two = _stored(spec, 2)
    per_layer = kv_layer_bytes(spec) if _plain_prefill(spec) else _stored(spec, 3) - two
    return two + (layers - 2) * per_layer


def kv_layer_bytes(spec: TraceSpec) -> int:
    """One decoder layer's K and V over the spec's batch and sequence, in its dtype (the spec's
    config always names its head dim: :meth:`fitrl.models.shape.ModelShape.text_config`)."""
    cfg = dict(spec.text_config)
    return 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * spec.batch * spec.seq_len * DTYPES[spec.dtype]


def _plain_prefill(spec: TraceSpec) -> bool:
    # (a first launch's start-up: one trace fewer per generating phase)
    return spec.phase == "prefill" and dict(spec.text_config).get("model_type") in PLAIN_KV_DECODERS


@lru_cache(maxsize=512)
def _stored(spec: TraceSpec, layers: int) -> int:
    """:func:`_traced`, read from fitrl's cache directory when the same code traced it before
    (:func:`fitrl.memory.cache.trace_key`)."""
    from fitrl.memory import cache

    key = cache.trace_key(spec, layers)
    peak = cache.load(key, cache.trace_dir())
    if not isinstance(peak, int):
        peak = _traced(spec, layers)
        cache.store(key, peak, cache.trace_dir(), keep=cache.TRACE_KEEP)
    return peak


@lru_cache(maxsize=512)
def _traced(spec: TraceSpec, layers: int, on: str = "meta") -> int:
    """The traced peak. ``on="meta"``: tensors on the ``meta`` device (2-3x faster than fake
    dispatch, which wraps the same shape kernels in Python: a first launch's start-up,
    bench/RESULTS.md), made to take the paths a CPU tensor takes (:func:`_as_on_cpu`), so its
    bytes equal ``on="fake"``'s (FakeTensorMode on a fake CPU), which stays the reference the
    tests compare against and the fallback for a model whose code reads a tensor's values."""
    if on == "meta":
        try:
            return _trace(spec, layers, "meta")
        except (RuntimeError, NotImplementedError):  # a value read (``.item()``) a meta tensor cannot give
            return _trace(spec, layers, "fake")
    return _trace(spec, layers, on)


def _trace(spec: TraceSpec, layers: int, on: str) -> int:
    # lazy: torch and transformers take seconds to import; `fitrl --help` must not wait for them
    import torch
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                              AutoModelForTokenClassification)

    import fitrl.ops.logprob as logprob_ops
    from fitrl.memory.live_bytes import StorageBytes

    cfg = dict(spec.text_config)
    cfg["num_hidden_layers"] = layers
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    dtype = getattr(torch, spec.dtype)
    attn = "sdpa" if spec.attn == "flash_attention_2" else spec.attn  # no flash kernels on CPU
    identity = lambda ids, mask, pos, r: (ids, mask, pos, r)  # noqa: E731  (no padding columns to trim)
    with _tensors_on(on) as made_on, mock.patch.object(logprob_ops, "trim_padding", identity), \
            _shared_prompts(spec, logprob_ops), _experts_by_shape():
        with made_on():
            if spec.phase == "score":  # a reward model: the decoder and a one-label score head
                config.num_labels, config.pad_token_id = 1, 0
                model = AutoModelForSequenceClassification.from_config(config, dtype=dtype, attn_implementation=attn)
            elif spec.phase in VALUE_PHASES:  # PPO's critic: a one-label head on every position (fitrl/roles/critic.py)
                config.num_labels = 1
                model = AutoModelForTokenClassification.from_config(config, dtype=dtype, attn_implementation=attn)
            else:
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
            if spec.lora_rank:
                _inject_fake_adapters(model, spec, dtype)
            B, T, R = spec.batch, spec.seq_len, spec.response_len
            ids = torch.zeros((B, T), dtype=torch.long)
            mask = torch.ones((B, T), dtype=torch.long)
            pos = torch.arange(T).expand(B, T)
            adv = torch.zeros((B, R))
            if spec.phase in ("update", "value_update"):
                for p in model.parameters():  # from the second micro-batch on, every gradient exists
                    if p.requires_grad:           # (LoRA: the adapters' only)
                        p.grad = torch.zeros_like(p)
        if spec.phase in ("update", "value_update"):
            if spec.checkpointing:  # as fitrl.models.loading does
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        else:
            model.eval()
        # weights, gradients and the inputs exist before: the tracker counts what the step creates
        tracker = StorageBytes()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        tracker.exclude([*model.parameters(), *model.buffers(), *grads, ids, mask, pos])
        with tracker:
            if spec.phase == "prefill":
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
            elif spec.phase == "score":
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=mask, use_cache=False)
            elif spec.phase == "values":
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=mask, use_cache=False)
            elif spec.phase == "value_update":  # fitrl.roles.critic.response_values, then the value loss
                values = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -R - 1:-1, 0].float()
                (values * adv).sum().backward()
                del values
            elif spec.phase == "logprob":
                with torch.no_grad():
                    logprob_ops.response_logprobs(model, ids, mask, pos, R, chunk_size=spec.chunk, with_entropy=True)
            else:
                logp, entropy = logprob_ops.response_logprobs(model, ids, mask, pos, R, chunk_size=spec.chunk,
                                                              with_entropy=True, entropy_grad=spec.entropy_grad)
                loss = (logp * adv).sum() + (entropy.sum() if spec.entropy_grad else 0.0)
                loss.backward()
                del logp, entropy, loss
    return tracker.peak


@contextmanager
def _shared_prompts(spec: TraceSpec, logprob_ops):
    """With ``spec.prompts`` groups (fewer than the rows) the pass takes the shared-prompt layout
    over consecutive, as even as possible groups (what the forward holds depends on their count
    only); the traced ids are all one value, so the real :func:`~fitrl.ops.logprob.choose_layout`
    could not tell them apart."""
    if not 0 < spec.prompts < spec.batch or spec.phase not in ("logprob", "update"):
        yield
        return
    import torch

    from fitrl.ops.shared_prompt import PromptGroups

    class Groups(PromptGroups):
        def record_skipped(self, attention_mask, prompt_len):  # a count for perf/*, read from values
            pass

    def layout(model, input_ids, *args, **kwargs):
        inverse = torch.arange(spec.batch) * spec.prompts // spec.batch  # (B,) each row's group
        rows = torch.searchsorted(inverse, torch.arange(spec.prompts))  # (G,) each group's first row
        return Groups(rows.to(input_ids.device), inverse.to(input_ids.device))

    with mock.patch.object(logprob_ops, "choose_layout", layout):
        yield


@contextmanager
def _experts_by_shape():
    """Routed experts through transformers' fallback grouped matmul (a custom operator with a
    shape-only fake kernel) rather than ``torch.nn.functional.grouped_mm``, whose meta kernel
    refuses fp32 inputs (the CPU kernel takes them). Both allocate the ``(rows, out)`` result and
    save the input rows and the weight for backward; a dense decoder never calls it."""
    import transformers.integrations.moe as moe

    with mock.patch.object(moe, "_can_use_grouped_mm", lambda *args: False):
        yield


@contextmanager
def _tensors_on(on: str):
    """Yields the context the model and its inputs are made in: the ``meta`` device, or a fake CPU
    (``on="fake"``: FakeTensorMode, on throughout). The step itself runs outside ``torch.device``,
    whose Python function mode would intercept its every call: its tensors are meta because its
    inputs are (transformers and fitrl make new tensors on their inputs' device)."""
    import torch

    if on == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            yield contextlib.nullcontext
        return
    with _as_on_cpu():
        yield lambda: torch.device("meta")


@contextmanager
def _as_on_cpu():
    """Meta tensors down the paths CPU tensors take, where the two differ in memory:

    - transformers skips building the 4-D attention mask when it reads the padding mask as all
      ones; a real rollout batch is left-padded (the mask exists), and fake tensors, which cannot
      be read, build it too: a meta tensor counts as unreadable here as well.
    - ``scaled_dot_product_attention`` picks its kernel by device, and meta has only the math
      path, which keeps the (B, heads, T, T) scores for backward; the CPU picks the fused flash
      kernel (asked here of small CPU tensors of the same kind: dtype, heads, head dims, mask),
      after turning a boolean mask into an additive one of the query's dtype, as done here."""
    import torch
    import torch.nn.functional as F
    import transformers.masking_utils as masking_utils

    readable = masking_utils.is_tracing
    sdpa = F.scaled_dot_product_attention

    def is_tracing(tensor=None) -> bool:
        return readable(tensor) or (isinstance(tensor, torch.Tensor) and tensor.is_meta)

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.is_meta and _cpu_picks_flash(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
            if attn_mask is not None and attn_mask.dtype == torch.bool:  # as sdpa does before its kernels
                attn_mask = torch.where(attn_mask, torch.scalar_tensor(0.0, dtype=query.dtype, device="meta"),
                                        torch.scalar_tensor(float("-inf"), dtype=query.dtype, device="meta"))
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    with mock.patch.object(masking_utils, "is_tracing", is_tracing), \
            mock.patch.object(F, "scaled_dot_product_attention", attention):
        yield


def _cpu_picks_flash(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> bool:
    import torch
    from torch.nn.attention import SDPBackend
    from torch.utils._python_dispatch import _disable_current_modes

    def small(t):  # one row, one position: what the choice reads is kept (dtype, rank, heads, head dim, grad)
        shape = [*(1 for _ in t.shape[:-3]), t.shape[-3], 1, t.shape[-1]] if t.dim() >= 3 else [1] * t.dim()
        return torch.zeros(shape, dtype=t.dtype, device="cpu").requires_grad_(t.requires_grad)

    with _disable_current_modes():  # these few bytes are not the step's: the storage counter must not see them
        mask = None if attn_mask is None else torch.zeros([1] * attn_mask.dim(), dtype=attn_mask.dtype, device="cpu")
        choice = torch._fused_sdp_choice(small(query), small(key), small(value), mask, dropout_p, is_causal,
                                         enable_gqa=enable_gqa)
    return choice == int(SDPBackend.FLASH_ATTENTION)


def _inject_fake_adapters(model, spec: TraceSpec, dtype) -> None:
    """The policy's LoRA adapters on a meta or FakeTensorMode model. PEFT moves each new module to
    its base layer's device and dtype with ``Module.to``, which cannot swap fake parameters (torch
    2.13 swaps, and fake tensors carry weakrefs): those moves are skipped (every traced tensor is on
    the one device already) and the adapters are cast to the model's dtype here instead, as new
    parameters."""
    import torch

    from fitrl.models.params import LoRA  # imports torch

    lora = LoRA(LoRAConfig(rank=spec.lora_rank, dropout=spec.lora_dropout, target_modules=list(spec.lora_targets)))
    with mock.patch.object(torch.nn.Module, "to", lambda self, *args, **kwargs: self), warnings.catch_warnings():
        # PEFT 0.21 doubles the rank of a MoE's fused gate_up experts through a pattern it then
        # reports as matching no module (it did match: tests/test_moe_decoder.py); not the plan's to print
        warnings.filterwarnings("ignore", message="The following (rank|alpha)_pattern keys", category=RuntimeWarning)
        lora.apply(model)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dtype != dtype:
                setattr(module, name, torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad))


def trace_spec(shape, *, phase: str, batch: int, seq_len: int, response_len: int, dtype: str = "float32",
               checkpointing: bool = False, chunk: int = 1024, entropy_grad: bool = False,
               attn: str = "sdpa", lora=None, prompts: int = 0) -> TraceSpec:
    """A :class:`TraceSpec` for a :class:`fitrl.models.shape.ModelShape`; ``lora``: the
    ``actor.lora`` config when the traced forward runs with adapters on; ``prompts``: the
    micro-batch's distinct prompts when its rows share them (0: none shared)."""
    cfg = shape.text_config(layers=1)
    adapters = (lora.rank, tuple(lora.target_modules), lora.dropout) if lora is not None and lora.enabled else (0, (), 0.0)
    return TraceSpec(tuple(sorted(cfg.items())), phase, batch, seq_len, response_len, dtype, checkpointing,
                     max(1, chunk), entropy_grad, attn, *adapters, prompts if 0 < prompts < batch else 0)


def model_transient(shape, phase: str, batch: int, seq_len: int, dtype: str, attn: str = "sdpa") -> int:
    """A no-grad pass of a model other than the policy (a reward model's ``score``, a judge's
    ``prefill``) over ``batch`` sequences of ``seq_len`` tokens, traced on its own shape."""
    spec = trace_spec(shape, phase=phase, batch=batch, seq_len=seq_len, response_len=1, dtype=dtype, attn=attn)
    return transient_bytes(spec, shape.layers)
