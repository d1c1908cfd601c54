"""What each model-holding role costs: its memory planner, registered under the role's name
beside the role's workers (``fitrl.roles.ROLES``), as an engine's planner is beside its engine.

Whether a run builds a role is the run's layout's to say (fitrl/config/layout.py, ``Run.layout``:
what fitrl/trainer/run.py builds too). A role's planner says the states each of its ranks holds (weights,
gradients, optimizer, sharded as its sharding backend's options say: fitrl/memory/sharding.py), the phases in which it computes (its
weights on the device when ``offload_params`` moves them out between phases), the passes whose
traced transients are its process's (:mod:`.trainer`), and whether under Ray it is a worker group
of its own (a process per device, colocated rank by rank on the policy's bundles). The phase
modules read these through :func:`role_states`, :func:`process_roles` and :func:`resident` (at
the end of this module): nothing in ``fitrl/memory/`` branches on a role's name besides it.
``fitrl/trainer/complete.py`` checks that every role has its planner and every planner its role.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fitrl.core.registry import Registry
from fitrl.memory.distill import teacher_topk_pass
from fitrl.memory.engines import engine_planner
from fitrl.memory.model import ACTOR_PHASES, Usage
from fitrl.memory.sharding import sharding_plan
from fitrl.memory.states import (DTYPE_BYTES, WEIGHT_CHANNEL, States, frozen_states, layer_bytes, lora_states,
                                 root_bytes, trained_states)
from fitrl.memory.trace import model_transient, trace_spec, transient_bytes
from fitrl.models.config_json import read_config_json
from fitrl.models.shape import ModelShape

if TYPE_CHECKING:  # (fitrl/memory/run.py imports no planner: a Run is below the roles)
    from fitrl.memory.run import Run


class RolePlanner(ABC):
    """The memory of one role's ranks."""

    name: str = ""
    title: str = ""
    """How the plan's table names the role's process of its own (under Ray)."""
    own_process: bool = True
    """Under Ray a worker group of its own (the policy's is the trainer rank itself)."""
    own_device: bool = False
    """Under Ray its ranks sit on bundles (devices) of their own, not the policy's: a device's peak
    is theirs alone (:meth:`fitrl.memory.model.Plan.peaks`)."""
    process_group: bool = True
    """Under Ray its ranks join a ``torch.distributed`` world of their own (FSDP2's collectives;
    NCCL on CUDA: :func:`fitrl.memory.gpu_terms.communicators`)."""

    def built(self, run: Run) -> bool:
        """Whether the run builds this role as a model of its own: the run's layout
        (fitrl/config/layout.py) lists it, and no other role stands in for it (LoRA's reference)."""
        return run.layout.builds(self.name)

    @abstractmethod
    def states(self, run: Run) -> tuple[States, Any]:
        """Per-rank states of the role and its config section (whose ``sharding`` names the
        backend that says where they live: None for a role never sharded nor offloaded)."""

    @abstractmethod
    def active_phases(self, run: Run) -> set[str]:
        """The phases in which the role computes: its weights are on the device then."""

    def passes(self, run: Run) -> set[str]:
        """The phases whose traced log-prob or update transients its process holds (:mod:`.trainer`)."""
        return set()

    def own_pass(self, run: Run, phase: str) -> dict[str, int]:
        """What the role's own model computes with in ``phase`` beyond the policy's passes (a
        reward model's scoring forward, a judge's generation): usage entries and their bytes."""
        return {}

    def own_host(self, run: Run, phase: str) -> dict[str, int]:
        """Host memory the role holds in ``phase`` beyond its states, wherever its model computes."""
        return {}

    def params_label(self, run: Run) -> str:
        """What the plan's tables call the ``params`` of its states."""
        return "params"

    def per_node(self, run: Run) -> int | None:
        """Its processes on the busiest node when not one per trainer device (None)."""
        return None

    def communicators(self, run: Run, section) -> int:
        """NCCL communicators its rank holds beyond its process's default group: its sharding
        backend's (a hybrid mesh across nodes: its two dimensions)."""
        return sharding_plan(section).communicators(run, section)

    def channel_communicators(self, run: Run) -> int:
        """NCCL communicators its rank holds outside any ``torch.distributed`` world: the weight
        channel's (fitrl/distributed/weight_sync.py), the policy's and each rollout worker's when
        :attr:`~fitrl.memory.run.Run.weight_channel` (counted on every trainer rank: the device
        planned is the fullest, rank 0's)."""
        return 0


ROLE_PLANNERS: Registry[RolePlanner] = Registry("role memory planner", "")
"""The plan lists the roles' states (and processes) in registration order: policy, reference, teacher,
critic (the run layout's order: fitrl/config/layout.py)."""


class PolicyPlanner(RolePlanner):
    """The policy (actor): trained (or LoRA adapters on a frozen base) in every run, in the
    trainer rank itself."""
    name, title, own_process = "actor", "trainer rank", False

    def states(self, run: Run) -> tuple[States, Any]:
        cfg, a = run.cfg, run.cfg.actor
        n, pinned = sharding_plan(a).world(run, a), sharding_plan(a).pinned(run, a)
        if run.lora:  # the frozen base and the adapters; the adapters alone have gradients and AdamW states
            return lora_states(run.shape, run.lora.rank, run.lora_targets, n, cfg.actor.model.dtype, pinned), a
        return trained_states(run.shape, n, cfg.actor.model.dtype, pinned=pinned,
                              frozen_vision=cfg.actor.model.freeze_vision_tower), a

    def active_phases(self, run: Run) -> set[str]:
        return ACTOR_PHASES | ({"ref_logprob"} if run.lora else set())  # LoRA: the policy computes the reference

    def passes(self, run: Run) -> set[str]:
        return {"old_logprob", "update"} | ({"ref_logprob"} if run.lora else set())

    def communicators(self, run: Run, section) -> int:
        return _with_sequence_group(run, super().communicators(run, section))

    def channel_communicators(self, run: Run) -> int:
        return int(run.weight_channel)

    def own_pass(self, run: Run, phase: str) -> dict[str, int]:  # (the update batch's copy on the device)
        return self.own_host(run, phase) if run.cuda else {}

    def own_host(self, run: Run, phase: str) -> dict[str, int]:  # the teacher's top-k in its update batch
        built = phase == "update" and run.layout.builds("teacher")
        return {"top-k buffers": _topk_bytes(run, run.seqs_per_rank)} if built else {}


def _with_sequence_group(run: Run, n: int) -> int:
    """``n`` communicators and the sequence-parallel group the policy's and the reference's ranks
    split their passes over (``actor.ulysses_size`` > 1: fitrl/distributed/ulysses.py)."""
    return n + (run.ulysses > 1)


class ReferencePlanner(RolePlanner):
    """The frozen reference model for the KL term; with LoRA the policy with its adapters off
    stands in for it (no model of its own)."""
    name, title = "ref", "reference rank (Ray actor)"

    def states(self, run: Run) -> tuple[States, Any]:
        cfg, r = run.cfg, run.cfg.ref
        dtype = (cfg.ref.model or cfg.actor.model).dtype
        return frozen_states(run.ref_shape or run.shape, sharding_plan(r).world(run, r), dtype,
                             pinned=sharding_plan(r).pinned(run, r)), r

    def active_phases(self, run: Run) -> set[str]:
        return {"ref_logprob"}

    def passes(self, run: Run) -> set[str]:
        return {"ref_logprob"}

    def communicators(self, run: Run, section) -> int:
        return _with_sequence_group(run, super().communicators(run, section))


TOPK_ENTRY_BYTES = 4 + 8
"""One entry of the teacher's top-k: its fp32 log-prob and its int64 id (fitrl/roles/teacher.py)."""


def _topk_bytes(run: Run, seqs: int) -> int:
    """The teacher's top-k log-probs and ids of ``seqs`` sequences' responses (0 without top-k)."""
    return seqs * run.response_len * run.cfg.algorithm.distill.top_k * TOPK_ENTRY_BYTES


class TeacherPlanner(RolePlanner):
    """On-policy distillation's teacher (fitrl/roles/teacher.py): frozen weights of its own shape and
    dtype, sharded like the reference's; in ``teacher_logprob`` its log-prob pass over its share
    of the rollout (traced on its own shape, micro-batches and compute dtype), its full weights in
    flight when sharded, the batch it gets and the top-k buffers it returns (tokens x k x 12 bytes).
    Under Ray a process of its own on the policy's bundles, each rank 1/world of the step's sequences."""
    name, title = "teacher", "teacher rank (Ray actor)"

    @staticmethod
    def _shape(run: Run) -> ModelShape:
        return _source_shape(run.cfg.teacher.model.path, "teacher.model.path")

    def states(self, run: Run) -> tuple[States, Any]:
        t = run.cfg.teacher
        sh = sharding_plan(t)
        return frozen_states(self._shape(run), sh.world(run, t), t.model.dtype, pinned=sh.pinned(run, t)), t

    def active_phases(self, run: Run) -> set[str]:
        return {"teacher_logprob"}

    @staticmethod
    def _seqs(run: Run) -> int:
        """Sequences one teacher rank scores: the step's over every rank (``dispatch("dp")``)."""
        return max(1, -(-run.batch.sequences_per_step // run.world))

    def own_pass(self, run: Run, phase: str) -> dict[str, int]:
        if phase != "teacher_logprob":
            return {}
        t, a, shape = run.cfg.teacher, run.cfg.actor, self._shape(run)
        sh = sharding_plan(t)
        dtype = "bfloat16" if sh.mixed_precision(t) else t.model.dtype
        seqs = self._seqs(run)
        b = min(t.logprob_micro_batch_size, seqs)
        spec = trace_spec(shape, phase="logprob", batch=b, seq_len=run.seq_len, response_len=run.response_len,
                          dtype=dtype, chunk=a.logprob_chunk_size, attn=t.model.attn_implementation)
        traced = transient_bytes(spec, shape.layers)
        logits = min(traced, 2 * min(a.logprob_chunk_size, b * run.response_len) * shape.vocab * 4)  # two (chunk, V) fp32
        out = {"activations": traced - logits, "logits": logits,
               "top-k buffers": teacher_topk_pass(run, seqs, b, traced)}  # (its outputs while it runs)
        cb = DTYPE_BYTES[dtype]
        if run.distributed:
            out["gathered weights"] = sh.gathered(root_bytes(shape, cb), layer_bytes(shape, cb), shape.num_params * cb)
        elif sh.mixed_precision(t):  # autocast casts a frozen weight at each use: the largest matrix at a time
            out["autocast weights"] = max(shape.vocab, shape.intermediate) * shape.hidden * cb
        if run.cuda:
            out["batch"] = run.batch_bytes(seqs)
        return out

    def own_host(self, run: Run, phase: str) -> dict[str, int]:
        if phase != "teacher_logprob":
            return {}
        seqs = self._seqs(run)
        # what it receives, and on CUDA what it returns to the host (on CPU that is own_pass's)
        return {"batch": run.batch_bytes(seqs), "top-k buffers (host)": _topk_bytes(run, seqs) if run.cuda else 0}


class CriticPlanner(RolePlanner):
    """The value model of PPO: fp32 weights and AdamW states; a Ray rank of its own holds its
    traced values and update passes (:func:`fitrl.memory.trainer._critic_pass`)."""
    name, title = "critic", "critic rank (Ray actor)"

    def states(self, run: Run) -> tuple[States, Any]:
        c = run.cfg.critic
        return trained_states(run.shape, sharding_plan(c).world(run, c), "float32", pinned=sharding_plan(c).pinned(run, c)), c

    def active_phases(self, run: Run) -> set[str]:
        return {"old_logprob", "update"}


def _sources(run: Run, kind: str) -> list[tuple[Any, ModelShape]]:
    """The run's ``reward.sources`` of ``kind`` with their models' shapes (config.json only)."""
    return [(src, _source_shape(src.model.path, f"reward.sources.{name}.model.path"))
            for name, src in run.cfg.reward.sources.items() if src.kind == kind]


def _source_shape(path: str, key: str) -> ModelShape:
    """A source model's shape, its ``config.json`` read once per version of the file: a plan asks
    for it in every phase, and the recommender plans again for every change it tries."""
    file = Path(path) / "config.json"
    return _shape_of(path, key, file.stat().st_mtime_ns if file.is_file() else 0)


@lru_cache(maxsize=64)
def _shape_of(path: str, key: str, version: int) -> ModelShape:
    return ModelShape.from_dict(read_config_json(path, key))


def _scored_seqs(run: Run, phase: str) -> int:
    """Sequences one rank scores in ``phase``: the step's rollout, or a validation call's."""
    return run.generated_seqs("validation") if phase == "validation" else run.seqs_per_rank


class _ModelRewardPlanner(RolePlanner):
    """The models of ``reward.sources`` of one kind (fitrl/roles/model_reward.py): frozen weights in
    each source's dtype, on the device in the phases that score (the step's ``reward``, and
    validation), sharded over the ranks like the reference's; with several sources the first's
    sharding options say where they all live between phases."""
    kind = ""
    generates = False
    """A ``generate`` call per micro-batch (a judge's): sharded weights are gathered for the whole call."""

    def states(self, run: Run) -> tuple[States, Any]:
        sources = _sources(run, self.kind)
        params = sum(self._weights(run, src, shape) for src, shape in sources)
        return States(params), sources[0][0]

    def _weights(self, run: Run, src, shape: ModelShape) -> int:
        sh = sharding_plan(src)
        return frozen_states(shape, sh.world(run, src), src.model.dtype, pinned=sh.pinned(run, src)).params

    def active_phases(self, run: Run) -> set[str]:
        return {"reward"} | ({"validation"} if run.cfg.data.val_files else set())

    def own_pass(self, run: Run, phase: str) -> dict[str, int]:
        if phase not in self.active_phases(run):
            return {}
        parts: dict[str, int] = {}
        for src, shape in _sources(run, self.kind):  # one source at a time: the largest
            own = self._pass(run, phase, src, shape)
            if run.distributed:
                cb = DTYPE_BYTES[src.model.dtype]
                own["gathered weights"] = sharding_plan(src).gathered(
                    self._root(shape, cb), layer_bytes(shape, cb), shape.num_params * cb, generation=self.generates)
            for k, v in own.items():
                parts[k] = max(parts.get(k, 0), v)
        return parts

    def _root(self, shape: ModelShape, dtype_bytes: int) -> int:
        return root_bytes(shape, dtype_bytes)

    def _pass(self, run: Run, phase: str, src, shape: ModelShape) -> dict[str, int]:
        raise NotImplementedError


class RewardModelPlanner(_ModelRewardPlanner):
    """Reward models: one forward per micro-batch, no KV cache, one score per sequence; a
    sequence-classification model has a one-label score head instead of the LM head."""
    name, title, kind = "reward_model", "reward model rank (Ray actor)", "model"

    @staticmethod
    def _lm_head(shape: ModelShape, dtype_bytes: int) -> int:
        """The untied LM head a causal LM's shape counts and a reward model has not (its score head
        is hidden x 1; a tied embedding stays)."""
        return 0 if shape.tied else shape.vocab * shape.hidden * dtype_bytes

    def _weights(self, run: Run, src, shape: ModelShape) -> int:
        head = self._lm_head(shape, DTYPE_BYTES[src.model.dtype]) // sharding_plan(src).world(run, src)
        return super()._weights(run, src, shape) - head

    def _root(self, shape: ModelShape, dtype_bytes: int) -> int:
        return super()._root(shape, dtype_bytes) - self._lm_head(shape, dtype_bytes)

    def _pass(self, run: Run, phase: str, src, shape: ModelShape) -> dict[str, int]:
        b = min(src.micro_batch_size, max(1, _scored_seqs(run, phase)))
        cap = src.max_length or run.seq_len
        return {"activations": model_transient(shape, "score", b, cap, src.model.dtype, src.model.attn_implementation)}


JUDGE_TEMPLATE_CHARS_PER_TOKEN = 2
"""A grading template's tokens, bounded from its characters before any tokenizer loads (English
text runs 3-4 characters a token; 2 leaves room for the chat template's own tokens)."""


class JudgePlanner(_ModelRewardPlanner):
    """LLM judges: ``generate`` over micro-batches of grading prompts (the run's caps plus the
    template), greedy, ``max_tokens`` new tokens: a growing KV cache, the prefill's transients or
    the fp32 scores of the vocabulary, whichever is larger; sharded, the full weights."""
    name, title, kind = "judge", "judge rank (Ray actor)", "judge"
    generates = True

    def _pass(self, run: Run, phase: str, src, shape: ModelShape) -> dict[str, int]:
        b = min(src.micro_batch_size, max(1, _scored_seqs(run, phase)))
        prompt = (src.max_length or run.seq_len) + len(src.template) // JUDGE_TEMPLATE_CHARS_PER_TOKEN
        cb = DTYPE_BYTES[src.model.dtype]
        kv = b * (prompt + src.max_tokens) * shape.kv_bytes_per_token(cb)
        prefill = model_transient(shape, "prefill", b, prompt, src.model.dtype, src.model.attn_implementation)
        prefill -= b * prompt * shape.kv_bytes_per_token(cb)  # (counted in the cache)
        return {"kv cache": kv, "activations": max(prefill, 2 * b * shape.vocab * 4)}


OVERLAPPED_PHASES = {"rollout", "reward", "weight_sync", "old_logprob", "ref_logprob", "teacher_logprob", "update"}
"""The phases of a step a rollout worker may generate in when ``rollout.mode`` overlaps it."""


class RolloutPlanner(RolePlanner):
    """Rollout workers of their own (``rollout.workers``, fitrl/roles/rollout_worker.py): a whole
    copy of the policy's weights each in its compute dtype (no gradients, no optimizer; with an
    engine holding a copy of its own, that engine:
    :meth:`~fitrl.memory.engines.EnginePlanner.worker_copy`), the engine's generation of the
    worker's share of the step (:meth:`~fitrl.memory.engines.EnginePlanner.in_worker`) and one
    version of the weights in the mailbox. Under Ray, actors on bundles (devices) of their own; in
    one process, a thread of the trainer's process, generating in every phase of the step when
    ``rollout.mode`` overlaps it (its memory adds to the update's)."""
    name, title, own_device = "rollout", "rollout worker (Ray actor)", True
    process_group = False  # a whole copy of the weights each: no torch.distributed world (the weight channel's aside)

    def states(self, run: Run) -> tuple[States, Any]:
        engine_copy = _engine_copy(run)  # (vLLM: its module is on meta; never offloaded, never sharded)
        if engine_copy is not None:
            return States(params=engine_copy), None
        return frozen_states(run.shape, 1, run.compute_dtype, pinned=False), None

    def params_label(self, run: Run) -> str:
        return "params" if _engine_copy(run) is None else f"{run.cfg.rollout.engine} engine (weights, kv cache)"

    def active_phases(self, run: Run) -> set[str]:
        return {"rollout"} if run.cfg.rollout.mode == "sync" else OVERLAPPED_PHASES

    def own_pass(self, run: Run, phase: str) -> dict[str, int]:
        u = Usage()
        dev = "gpu" if run.cuda else "host"
        if phase == "weight_sync" and run.cuda and run.weight_channel:  # (gloo on CPU: the buckets are the mailbox's)
            u.add("gpu", WEIGHT_CHANNEL, run.channel_bytes("worker"))
        if phase not in self.active_phases(run):
            return u.gpu
        engine_planner(run.cfg, "worker").in_worker(run, phase, u, dev)
        return u.gpu if run.cuda else u.host

    def own_host(self, run: Run, phase: str) -> dict[str, int]:
        held = dict(engine_planner(run.cfg, "worker").worker_host(run))
        # a version waits in the mailbox until the worker loads it (sync: between the push and the next rollout)
        waiting = phase == "weight_sync" or (run.cfg.rollout.mode != "sync" and phase in OVERLAPPED_PHASES)
        if waiting:
            held["weights in the mailbox"] = frozen_states(run.shape, 1, run.compute_dtype, pinned=False).params
        return held

    def per_node(self, run: Run) -> int | None:
        return run.cfg.rollout.workers

    def channel_communicators(self, run: Run) -> int:
        return int(run.weight_channel)


def _engine_copy(run: Run) -> int | None:
    """What a rollout worker's engine holds of its own (None: the worker's module is the copy)."""
    return engine_planner(run.cfg, "worker").worker_copy(run)


for _planner in (PolicyPlanner(), ReferencePlanner(), TeacherPlanner(), CriticPlanner(), RewardModelPlanner(),
                 JudgePlanner(), RolloutPlanner()):
    ROLE_PLANNERS.add(_planner.name, _planner)


def role_states(run: Run) -> dict[str, tuple[States, object]]:
    """Per-rank states of each role the run builds, with its config section (the roles' planners,
    in their registration order)."""
    return {p.name: p.states(run) for p in ROLE_PLANNERS.in_order() if p.built(run)}


def process_roles(run: Run) -> dict[str, tuple[str, ...]]:
    """The roles (keys of :func:`role_states`) each per-device process kind holds. In one process
    (``trainer.backend=inprocess``) the trainer holds every role. Under Ray each role is a
    ``RayWorkerGroup`` of its own (fitrl/trainer/run.py, ``make_group``): a role with a process of
    its own (the reference's and the critic's ranks) is a Ray actor colocated rank by rank on the
    policy's bundles (same node, same device), a process with its own runtime (and CUDA context);
    with LoRA the reference is the policy with its adapters off, no process of its own
    (:func:`role_states` has no "ref")."""
    roles = tuple(role_states(run))
    if not run.distributed:
        return {"trainer": roles}
    own = [r for r in roles if ROLE_PLANNERS.get(r).own_process]
    return {"trainer": tuple(r for r in roles if r not in own), **{r: (r,) for r in own}}


def resident(role: str, section, phase: str, run: Run) -> tuple[bool, bool]:
    """(weights and gradients on the device, optimizer states on the device) in ``phase``;
    ``section``: the role's config section (:func:`role_states`)."""
    sh = sharding_plan(section)
    if not run.cuda or sh.host_only(run, section):
        return False, False
    on = phase in ROLE_PLANNERS.get(role).active_phases(run) or not sh.offloads(section, "params")
    return on, phase == "update" or not sh.offloads(section, "optimizer")
