"""A run's numbers as the planner derives them once from the config and hardware (:class:`Run`).
The phase modules (:mod:`.trainer`, :mod:`.services`) read them, with the roles' states and
processes (fitrl/memory/roles.py: ``role_states``, ``process_roles``, ``resident``), to build
:class:`~.model.ProcessPlan` objects (docs/architecture.md, "Memory model"). This module imports
neither the roles' nor the engines' planners: both take a :class:`Run`, so they sit above it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from fitrl.config import FitrlConfig
from fitrl.config.batch_sizes import BatchSizes
from fitrl.config.layout import RunLayout, run_layout
from fitrl.data.balance import micro_batches_by_tokens
from fitrl.memory import calibration as C
from fitrl.memory.lengths import Lengths
from fitrl.memory.model import Hardware
from fitrl.memory.sharding import sharding_plan
from fitrl.models.shape import ModelShape
from fitrl.models.vision import VisualInput
from fitrl.ops.sharing import full_attention
from fitrl.memory.states import DTYPE_BYTES, States, channel_payloads

if TYPE_CHECKING:  # fitrl.algo imports torch; the planner only holds its spec
    from fitrl.algo import AlgorithmSpec


@dataclass
class Run:
    """Numbers derived once from the config and hardware. ``lengths``: plan every sequence at
    these lengths (the expected ones) instead of the caps; what is allocated at the caps whatever
    the sequences hold (HF generate's KV cache) reads :attr:`cap_response_len`. ``supervised``: a
    ``fitrl sft`` run, the one fact about the processes a run starts that its config does not hold
    (:attr:`layout`)."""
    cfg: FitrlConfig
    hw: Hardware
    shape: ModelShape
    ref_shape: Optional[ModelShape]
    spec: AlgorithmSpec
    lengths: Optional[Lengths] = None
    supervised: bool = False

    @functools.cached_property
    def layout(self) -> RunLayout:
        """The roles and processes the run starts, as fitrl/trainer/run.py builds them: what each
        role planner's ``built`` reads (fitrl/memory/roles.py)."""
        return run_layout(self.cfg, self.supervised)

    @property
    def cuda(self) -> bool:
        return self.hw.device == "cuda"

    @property
    def glibc_heap(self) -> bool:
        """Are this CPU run's host transients glibc's heap (its measured factors and retention)?
        Not with ``plan.host_malloc=mmap``, nor under jemalloc or tcmalloc
        (``memory.host_allocator``): their update's RSS follows the traced live bytes (held-out
        corpus under each, bench/RESULTS.md "Host allocators"), so the plan counts those."""
        return (not self.cuda and self.cfg.plan.host_malloc == "glibc"
                and self.cfg.memory.host_allocator == "glibc")

    @property
    def lora(self):
        """``actor.lora`` when LoRA is on (adapters train, the base is frozen), else None."""
        lora = self.cfg.actor.lora
        return lora if lora.enabled else None

    @property
    def lora_targets(self) -> tuple[str, ...]:
        return tuple(self.lora.target_modules) if self.lora else ()

    @property
    def distributed(self) -> bool:
        """Under Ray: a rank per device, each role sharded by its backend (fitrl/memory/sharding.py)."""
        return self.cfg.trainer.backend == "ray"

    @property
    def world(self) -> int:
        return self.hw.nodes * self.hw.gpus_per_node if self.distributed else 1

    @property
    def weight_channel(self) -> bool:
        """Do the weights reach rollout workers of their own over the weight channel
        (``rollout.weight_transport`` resolved: ``auto`` is ``collective`` under Ray on CUDA;
        fitrl/distributed/weight_sync.py) rather than through rank 0's host and the object store?"""
        from fitrl.distributed.weight_sync import resolve_transport  # (torch: only when planning)

        r = self.cfg.rollout
        return self.layout.rollout is not None and self.distributed and resolve_transport(
            r.weight_transport, self.hw.device, self.cfg.trainer.backend) == "collective"

    def channel_bytes(self, side: str) -> int:
        """What one push over the weight channel holds beyond the weights (``side``: ``"rank0"``,
        ``"worker"``), at its largest, in the compute dtype (:func:`~fitrl.memory.states.channel_payloads`):
        rank 0 its bucket (``rollout.weight_bucket_mb``, made whole) and a tensor larger than a bucket,
        sent on its own from where FSDP2's gather left it; a worker one payload as it arrives on its
        device, and the one before it, still referenced until the receive loop takes the next
        (``WeightChannel.receive``): the largest two in a row (a bucket's at most the weights)."""
        bucket = int(self.cfg.rollout.weight_bucket_mb * 2**20)
        bucketed, payloads, alone = channel_payloads(self.shape, DTYPE_BYTES[self.compute_dtype], bucket)
        if side == "rank0":
            return (bucket if bucketed else 0) + alone
        return max([sum(payloads[i:i + 2]) for i in range(len(payloads))], default=0)

    @property
    def compute_dtype(self) -> str:
        a = self.cfg.actor
        return "bfloat16" if sharding_plan(a).mixed_precision(a) else a.model.dtype  # sharded, or by autocast

    @property
    def autocast(self) -> bool:
        """Mixed precision in one process: each forward holds autocast's bf16 copy of the weights."""
        return not self.distributed and sharding_plan(self.cfg.actor).mixed_precision(self.cfg.actor)

    @property
    def prompt_len(self) -> int:
        """Tokens a prompt is planned at: the cap, or the expected length."""
        return self.lengths.prompt if self.lengths else self.cfg.data.max_prompt_length

    @property
    def response_len(self) -> int:
        """Tokens a response is planned at: the cap, or the expected length."""
        return self.lengths.response if self.lengths else self.cfg.rollout.max_response_length

    @property
    def cap_response_len(self) -> int:
        """``rollout.max_response_length``, for what is sized by it before any token is generated."""
        return self.cfg.rollout.max_response_length

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def batch(self) -> BatchSizes:
        """The actor's batch sizes over this run's data-parallel ranks (fitrl/config/batch_sizes.py):
        the world over ``actor.ulysses_size`` (a sequence-parallel group's ranks hold the same
        sequences in the passes)."""
        return BatchSizes.of(self.cfg, max(1, self.world // self.ulysses))

    @property
    def ulysses(self) -> int:
        """Ranks each sequence of a pass is split over (``actor.ulysses_size``; 1 in one process)."""
        return self.cfg.actor.ulysses_size if self.distributed else 1

    @property
    def seqs_per_rank(self) -> int:
        return max(1, self.batch.sequences_per_rank)

    def generated_seqs(self, phase: str) -> int:
        """Sequences one rank generates in ``phase``: a validation call's, or the step's rollout."""
        if phase == "validation":
            return max(1, self.cfg.data.val_batch_size * self.cfg.rollout.val.n // self.world)
        return max(1, self.batch.sequences_per_step // self.world)  # generation splits over every rank

    @property
    def mini_seqs_per_rank(self) -> int:
        """Sequences of one optimizer step on a rank (``Actor.update``'s ``sequences_per_mini_batch``)."""
        return max(1, min(self.seqs_per_rank, self.batch.mini_batch_per_rank))

    def micro(self, size: int, update: bool = False) -> int:
        """Sequences in one forward: the count; or, with a token budget, what the actor's split
        (``Actor.partition``, fitrl/data/balance.py) puts in its largest micro-batch. The actor keeps
        every micro-batch's padded size (sequences x its longest) within the budget, as few
        micro-batches as that allows, balanced. At the caps the plan takes the worst any lengths up
        to them can make: the budget's worth, ``ceil(budget / seq_len)`` sequences of
        :attr:`seq_len` (short sequences come more to a micro-batch, never more padded tokens). At
        expected lengths it takes the split of equal sequences of that length (the typical step).
        Either way at most the sequences split together: a mini-batch in the update, the rank's
        whole batch for log-probs."""
        budget = self.cfg.actor.micro_batch_token_budget
        if not budget:
            return min(size, self.seqs_per_rank)
        seqs = self.mini_seqs_per_rank if update else self.seqs_per_rank
        if self.lengths is None:
            return max(1, min(seqs, -(-budget // max(1, self.seq_len))))
        return max(len(b) for b in micro_batches_by_tokens([self.seq_len] * seqs, budget))

    def prompt_groups(self, rows: int, update: bool = False) -> int:
        """Distinct prompts in the largest-planned micro-batch of ``rows`` sequences when the
        pass runs each once (``actor.share_prompts``, fitrl/ops/shared_prompt.py), or 0: traced
        as rows of their own. Planned only where the rows' order is known and a process's memory
        follows the live bytes the trace counts:

        - in one process, whose batch keeps a prompt's n samples consecutive (the engines'
          ``repeat_interleave``), split into consecutive micro-batches: no token budget (it groups
          by length) and, in the update, no ``actor.shuffle_mini_batches``; under Ray each rank's
          shard is ordered by length (``equal_count_shards``), which scatters the samples;
        - on a CPU host under jemalloc or tcmalloc (``memory.host_allocator``), whose RSS follows
          it (bench/RESULTS.md, "Session 35"): glibc's peak did not fall with sharing on every
          model (bench/RESULTS.md, "Shared prompts"), ``plan.host_malloc=mmap`` is glibc's plan
          without its factors (what bench/plan_accuracy.py fits them against), and on GPUs
          sharing is unmeasured;
        - where the forward can share (:func:`fitrl.ops.shared_prompt.can_share`): no images, no
          sliding window, no gradient checkpointing in the update.

        A window of ``rows`` consecutive rows starting at a multiple of ``rows`` (in the update:
        within a mini-batch, which starts at a group's first sample) touches
        ``(end - 1) // n - start // n + 1`` groups; the plan takes the most any window touches."""
        a, n = self.cfg.actor, self.cfg.rollout.n
        if (self.cuda or self.cfg.memory.host_allocator == "glibc" or self.distributed or not a.share_prompts or n < 2
                or a.micro_batch_token_budget or self.shape.vision is not None or not full_attention(self.shape.raw)
                or (update and (a.model.gradient_checkpointing or a.shuffle_mini_batches))):
            return 0
        span = self.mini_seqs_per_rank if update else self.seqs_per_rank
        rows = min(rows, span)
        groups = max((min(start + rows, span) - 1) // n - start // n + 1 for start in range(0, span, rows))
        return groups if groups < rows else 0

    def batch_bytes(self, seqs: int) -> int:
        """A rollout batch's token tensors for ``seqs`` sequences (closed form); its images are
        counted per prompt (:meth:`pixel_values_bytes`), not per sequence. A mixture of experts'
        batch from an engine that records its routing carries ``routed_experts`` too: int16 ids of
        each response token's experts, ``top_k`` per sparse layer (fitrl/rollout/hf.py records them
        for every MoE, whatever ``actor.routing_replay``; agent episodes carry none)."""
        per_response_token = C.BATCH_BYTES_PER_RESPONSE_TOKEN + 2 * self.routed_ids_per_token
        return seqs * (self.seq_len * C.BATCH_BYTES_PER_TOKEN + self.response_len * per_response_token)

    @property
    def routed_ids_per_token(self) -> int:
        """Recorded experts per response token in the batch's ``routed_experts`` (0: none recorded)."""
        r = self.cfg.rollout
        if not r.capabilities.records_routing or r.agent.enabled:
            return 0
        return getattr(self.shape.decoder, "routed_ids_per_token", 0)  # (a dense decoder routes nothing)

    # ------------------------------------------------------------------ images (docs/architecture.md, "Memory model")
    @property
    def images_per_prompt(self) -> int:
        """Images one prompt may carry, the worst case ``data.limit_images``, for a
        vision-language model (its config.json has a vision tower); 0 for a text model."""
        return self.cfg.data.limit_images if self.shape.vision is not None else 0

    @functools.cached_property
    def visual(self) -> Optional[VisualInput]:
        """The largest image the processor makes within ``data.max_pixels`` (the worst case of
        every image slot; None without images). Videos are not planned: nothing says whether the
        data has any, and a slot planned as ``data.max_frames`` frames would overstate every
        image-only run whose ``data.max_pixels`` is small."""
        v, d = self.shape.vision, self.cfg.data
        if v is None or not self.images_per_prompt:
            return None
        return v.largest_image(d.max_pixels, d.min_pixels)

    def pixel_values_bytes(self, prompts: int) -> int:
        """The fp32 ``pixel_values`` of ``prompts`` prompts, each with ``images_per_prompt`` of the
        largest input: per image (patches, 3 * 2 * p * p) fp32, ``patches * 3 * 2 * p * p * 4``
        bytes (a still image is repeated over the temporal patch of 2)."""
        return prompts * self.images_per_prompt * self.visual.pixel_values_bytes if self.visual else 0

    def image_processing_bytes(self) -> int:
        """What making one prompt's pixel values holds besides them
        (``PromptDataset.multi_modal_inputs``, one prompt at a time): its images decoded (PIL's
        RGBX and the processor's uint8 copy, 7 B per source pixel; sources counted at the
        ``data.max_pixels`` budget) and the processor's working copies
        (:data:`~fitrl.memory.calibration.IMAGE_PROCESSING_BYTES_PER_PIXEL` per resized pixel)."""
        visual = self.visual
        if visual is None:
            return 0
        resized = visual.height * visual.width
        return self.images_per_prompt * (self.cfg.data.max_pixels * C.IMAGE_DECODED_BYTES_PER_PIXEL
                                         + resized * C.IMAGE_PROCESSING_BYTES_PER_PIXEL)

    def prompts_received(self, phase: str) -> int:
        """Prompts whose images one trainer rank receives in ``phase``'s call under Ray (0 in-process,
        where nothing is pickled). Each rank unpickles its shard of the batch into tensors of its own;
        pickling keeps one copy of a prompt's images however many of its samples the shard holds
        (they point at one dict). ``generate`` gets 1/world of the step's prompts; the log-prob and
        update calls get ``seqs_per_rank`` sequences ordered by length
        (fitrl/data/balance.py, ``equal_count_shards``), which scatters a prompt's n samples over the
        ranks: up to one prompt per sequence, at most every prompt of the step."""
        if not self.distributed:
            return 0
        d = self.cfg.data
        if phase == "rollout":
            return -(-d.rollout_batch_size // self.world)
        if phase == "validation":
            return -(-d.val_batch_size // self.world)
        if phase in ("old_logprob", "ref_logprob", "teacher_logprob", "update"):
            return min(self.seqs_per_rank, d.rollout_batch_size)
        return 0
