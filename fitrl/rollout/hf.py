"""Rollout on the trained module itself (CPU and GPU): the default :class:`RolloutEngine`.

It generates with the trained module itself (under FSDP2 its full weights are gathered once per
call), so it never holds a second copy and weight pushes, sleep and wake are no-ops. The batch
layout it returns is documented in :mod:`fitrl.rollout.engine`. Two decode paths, picked by
``rollout.decode``: ``loop`` (:func:`fitrl.rollout.decode.decode_loop`, our own loop on the
model's forward, in which finished rows leave the batch) and ``generate`` (HF ``generate``; the
one path for vision-language models).

Sampling (temperature, top-k, top-p) is :func:`fitrl.rollout.decode.sample_step` on both paths;
under ``generate`` it runs in our own logits processor, and HF's own processors are switched
off: a checkpoint's ``generation_config.json`` (Qwen ships top_k=20, top_p=0.8,
temperature=0.7, repetition_penalty=1.05) must never change what a config asked for silently.
The recorded log-prob is that of the tempered distribution *before* top-k/top-p truncation,
which is what the trainer recomputes (as veRL does).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from fitrl.config.schema import SamplingConfig
from fitrl.core.engines import EngineCapabilities
from fitrl.core.padding import left_pad
from fitrl.data.batch import Batch
from fitrl.distributed.sharding import gathered_for_generation
from fitrl.models.families.base import TEXT_INPUTS, ModelInputs
from fitrl.models.moe_routing import Routers, RoutingRecorder
from fitrl.ops.token_origin import ORIGINS
from fitrl.rollout.decode import decode_loop, loop_unsupported, raise_if_nonfinite, sample_step
from fitrl.rollout.engine import GENERATION, ROLLOUT_ENGINES, RolloutEngine
from fitrl.rollout.layout import assemble_rollout, eos_ids


class SampleAndRecord(LogitsProcessor):
    """Applies temperature / top-k / top-p and records the log-prob of each sampled token.

    The token sampled at step t is only known at step t+1 (it is the last of ``input_ids``),
    so we keep one (B, V) log-softmax pending and gather from it one step later; memory stays
    one vocabulary row per sequence instead of all R steps' logits.
    """

    def __init__(self, sampling: SamplingConfig, eos_ids: list[int] = (), never_ids: list[int] = ()):
        self.sampling = sampling
        self.eos_ids = list(eos_ids)
        self.never_ids = list(never_ids)  # never sampled (ModelInputs.never_generate)
        self.pending: Optional[torch.Tensor] = None  # (B, V) fp32 log-probs of the last step
        self.logprobs: list[torch.Tensor] = []  # one (B,) per generated token
        self.nonfinite: Optional[torch.Tensor] = None  # () bool on the device: a NaN/+inf logit was seen

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # a decode step: a heartbeat, and a (time-limited, local) guard reading: within a long
        # micro-batch the KV cache grows token by token, and this stops it before the OS does
        GENERATION.step()
        if self.pending is not None:
            self._gather(input_ids[:, -1])
        # the math both decode paths share; a NaN/+inf logit is noted without a sync and reported in finish()
        scores, self.pending, seen = sample_step(scores, self.sampling, self.eos_ids, self.never_ids)
        if ORIGINS.listening:  # the next forward runs each row's token t (a MoE's recorded routing: RoutingRecorder)
            rows = torch.arange(scores.shape[0], device=scores.device)[:, None]
            ORIGINS.feed(rows * self.sampling.max_tokens + len(self.logprobs))
        self.nonfinite = seen if self.nonfinite is None else self.nonfinite | seen
        return scores

    def _gather(self, tokens: torch.Tensor) -> None:
        self.logprobs.append(self.pending.gather(-1, tokens[:, None]).squeeze(-1))
        self.pending = None

    def finish(self, last_tokens: torch.Tensor, num_generated: int) -> torch.Tensor:
        raise_if_nonfinite(self.nonfinite)
        if self.pending is not None:
            self._gather(last_tokens)
        # generate may undo deferred steps at the end; keep one log-prob per returned token
        return torch.stack(self.logprobs[:num_generated], dim=1)


@ROLLOUT_ENGINES.register("hf")
class HFRollout(RolloutEngine):
    capabilities = EngineCapabilities(holds_own_weights=False, sleeps=False, tensor_parallel=False, title="HF",
                                      records_routing=True)

    def __init__(self, model: torch.nn.Module, tokenizer, *, micro_batch_size: int = 64,
                 inputs: ModelInputs = TEXT_INPUTS, decode: str = "generate"):
        """``inputs``: the model family's positions and extra inputs (images) for ``model``.
        ``decode``: ``"loop"`` or ``"generate"``. :meth:`from_config` passes ``rollout.decode``;
        an engine built directly (tests, benchmarks) keeps HF ``generate`` unless asked. ``loop``
        falls back to ``generate`` where :attr:`loop_unsupported` names a reason (images)."""
        if decode not in ("loop", "generate"):
            raise ValueError(f"decode must be 'loop' or 'generate', got {decode!r}")
        self.model = model
        self.inputs = inputs
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
        self.eos_ids = eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.loop_unsupported = ("a model with extra inputs (images)" if inputs is not TEXT_INPUTS
                                 else loop_unsupported(model))
        """Why ``decode="loop"`` falls back to ``generate`` for this model (None: it does not)."""
        self.decode = "loop" if decode == "loop" and self.loop_unsupported is None else "generate"
        """The decode path generation takes."""
        self.routers = Routers.of(model)
        """A mixture of experts' routers, whose choice for every sampled token is recorded; None: dense."""
        # generate() fills every unset field from model.generation_config and then from HF's
        # global defaults (top_k=50): replace the checkpoint's and pass neutral values below.
        model.generation_config = GenerationConfig(eos_token_id=self.eos_ids, pad_token_id=self.pad_id)

    @classmethod
    def from_config(cls, model, tokenizer, cfg, *, inputs=TEXT_INPUTS, context=None) -> "HFRollout":
        return cls(model, tokenizer, micro_batch_size=cfg.micro_batch_size, inputs=inputs, decode=cfg.decode)

    @torch.no_grad()
    def generate(self, prompts: Batch, sampling: SamplingConfig) -> Batch:
        """prompts: fields ``prompt_ids`` (list[list[int]]) and any per-prompt fields, which are
        repeated ``n`` times so each sequence carries its prompt's answer, uid, ..."""
        device = next(self.model.parameters()).device
        seqs = prompts.repeat_interleave(sampling.n)
        width = max(len(p) for p in seqs["prompt_ids"])
        prompt_ids, prompt_mask = left_pad(seqs["prompt_ids"], self.pad_id, width)
        responses, logprobs, routed = [], [], []
        was_training = self.model.training
        self.model.eval()
        try:
            with gathered_for_generation(self.model):  # sharded: full weights once, not per token
                for start in range(0, len(seqs), self.micro_batch_size):
                    # safe point: only this phase's work is lost. Local: generation runs no
                    # collective, and ranks may have different numbers of micro-batches
                    GENERATION.safe_point()
                    sl = slice(start, start + self.micro_batch_size)
                    ids = prompt_ids[sl].to(device)
                    # the micro-batch's images (one concatenated copy per sequence), made in the
                    # call so that they are freed before the next micro-batch makes its own
                    with self._recording(len(ids), sampling.max_tokens, device) as recorder:
                        r, lp = self._generate_micro(ids, prompt_mask[sl].to(device), sampling,
                                                     self.inputs.generate_extra(ids, seqs.index(sl), device))
                    responses.append(r)
                    logprobs.append(lp)
                    if recorder is not None:
                        routed.append(recorder.result(r.shape[1]))  # (b, r, layers, k)
        finally:
            self.model.train(was_training)
        return assemble_rollout(prompts, seqs, prompt_ids.to(device), prompt_mask.to(device), responses, logprobs,
                                eos_ids=self.eos_ids, pad_id=self.pad_id, inputs=self.inputs, tokenizer=self.tokenizer,
                                routed_experts=routed if self.routers is not None else None)

    def _recording(self, rows: int, width: int, device: torch.device):
        """A MoE's :class:`RoutingRecorder` around one generate call (nothing for a dense model)."""
        if self.routers is None:
            return contextlib.nullcontext()
        return RoutingRecorder(self.routers, rows, width, device)

    def _generate_micro(self, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingConfig,
                        extra: dict[str, torch.Tensor]):
        if self.decode == "loop":  # text only: no ``extra``
            return decode_loop(self.model, ids, mask, sampling, eos_ids=self.eos_ids, pad_id=self.pad_id,
                               never_ids=self.inputs.never_generate)
        recorder = SampleAndRecord(sampling, self.eos_ids, self.inputs.never_generate)
        config = GenerationConfig(
            do_sample=not sampling.greedy,
            # Sampling happens in `recorder`; every HF processor is explicitly neutral. Warpers
            # (top-k ...) act only when sampling; setting them for greedy decoding draws a warning.
            **(dict(temperature=1.0, top_k=0, top_p=1.0, min_p=None, typical_p=1.0, epsilon_cutoff=0.0,
                    eta_cutoff=0.0) if not sampling.greedy else {}),
            repetition_penalty=1.0, no_repeat_ngram_size=0, min_length=0,
            max_new_tokens=sampling.max_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            bos_token_id=None,
        )
        seq = self.model.generate(
            input_ids=ids, attention_mask=mask, generation_config=config,
            logits_processor=LogitsProcessorList([recorder]), **extra,
        )
        responses = seq[:, ids.shape[1]:]
        logprobs = recorder.finish(seq[:, -1], responses.shape[1])
        return responses, logprobs
