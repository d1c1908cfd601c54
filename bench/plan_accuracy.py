"""Planner accuracy on CPU: predicted vs measured peak host memory of the update and log-prob phases.

Each configuration runs the real code in fresh processes (1 rank: one process; 2 ranks: two
processes, gloo, FSDP2, as ``tests/fsdp_spawn.py``): a :class:`PolicyWorker` loads the model,
generates a real rollout batch with ``HFRollout`` (EOS ignored, so every response has exactly
``R`` tokens; prompts of random token ids, lengths between P/2 and P, so rows are left-padded),
runs one whole warm-up step (log-probs and the update, so AdamW states exist, the gradients
having been freed at its end, and the allocator holds what a previous step left, as from the
second RL step on), then measures the second step's ``compute_logprob`` and ``update``, each
after resetting the high-water mark (``/proc/self/clear_refs``), reading ``VmHWM`` from
``/proc/self/status`` afterwards. The figure is the whole process's peak RSS in the phase (rank
maximum for 2 ranks); the planner predicts the same quantity (``fitrl.memory`` for ``device=cpu``).
Configurations with KL in the loss also measure the reference log-probs (``ref``): full fine-tuning
builds a :class:`ReferenceWorker` (a second fp32 model in the process, as the in-process trainer
does); with LoRA (``actor.lora.rank``) the policy computes them with its adapters off, and only the
adapters have gradients and AdamW states.
On-policy distillation (``--teacher SIZE``: ``algorithm.distill.weight=0.5`` with a teacher of that
size, ``--top-k K``: ``topk_forward_kl`` over its K likeliest tokens, else ``reverse_kl``) measures
the teacher's pass (``teacher``) too: in one process a :class:`TeacherWorker` beside the policy, as
the in-process trainer builds it, against the plan's trainer process; with 2 ranks the plan puts the
teacher in a Ray process of its own, so a second world of gloo processes holds only the teacher's
FSDP2 ranks, each scoring its share of a batch of the same layout (left-padded random prompts,
``R`` random response tokens; its first pass the warm-up), against the plan's teacher process (the
policy's world gets random teacher columns of the same shapes for its update).

Two allocators: ``mmap`` starts the ranks with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc maps and
unmaps every tensor of 64 KiB or more, so RSS follows the live tensors the planner traces);
``glibc`` is the default, whose dynamic threshold keeps freed activation-sized blocks in the
heap: RSS runs 1.3-4x above the live tensors and stays up into the next phase, which the
planner models with measured factors (``fitrl/memory/calibration.py``).

    .venv/bin/python bench/plan_accuracy.py                  # every configuration, both allocators
    .venv/bin/python bench/plan_accuracy.py --only 0 3 --malloc mmap
    .venv/bin/python bench/plan_accuracy.py --only 11 12 13       # KL: full vs LoRA r=16 (medium), LoRA (small)
    .venv/bin/python bench/plan_accuracy.py --only 0 7 --arch qwen3_moe   # the tiny mixture of experts, 1 and 2 ranks
    .venv/bin/python bench/plan_accuracy.py --only 0 7 --teacher tiny --top-k 8     # a tiny teacher, top-8 forward KL
    .venv/bin/python bench/plan_accuracy.py --only 1 8 --teacher medium --top-k 8   # small student, medium teacher
    .venv/bin/python bench/plan_accuracy.py --malloc glibc --factors --json rows.json   # the trimmed factors
    .venv/bin/python bench/plan_accuracy.py --malloc glibc --factors --set memory.trim_heap=false  # untrimmed
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from queue import Empty

GIB = 1024**3
ROOT = Path(__file__).resolve().parent.parent
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
# measured -> planned (the planner's old_logprob and update phases hold the critic's values and update too)
PLAN_PHASES = {"rollout": "rollout", "logprob": "old_logprob", "ref": "ref_logprob", "values": "old_logprob",
               "critic_update": "update", "teacher": "teacher_logprob", "update": "update"}


@dataclass
class Case:
    size: str            # tiny / small / medium (fitrl.models.tiny.SIZES)
    ranks: int
    prompts: int         # data.rollout_batch_size (one mini-batch: one optimizer step)
    n: int               # rollout.n
    prompt_len: int      # data.max_prompt_length (longest prompt)
    response_len: int    # rollout.max_response_length (every response, EOS ignored)
    micro: int           # actor.micro_batch_size = actor.logprob_micro_batch_size
    ckpt: bool           # actor.model.gradient_checkpointing
    chunk: int           # actor.logprob_chunk_size (>= the response length: not chunked)
    kl: bool = False     # algorithm.use_kl_loss: reference log-probs measured too
    lora: int = 0        # actor.lora.rank (all-linear); 0: full fine-tuning
    arch: str = "qwen2"  # fitrl.models.tiny.ARCHS
    critic: bool = False  # algorithm.adv_estimator=gae (PPO): a value model, its values and update measured
    mixed: bool = False  # actor.fsdp.mixed_precision (bf16 compute: FSDP2 with 2 ranks, autocast with 1)
    budget: int = 0      # actor.micro_batch_token_budget (0: sequence counts)
    rollout: bool = False  # also measure the second step's rollout (HF generate after the update)
    extra: tuple[str, ...] = ()  # more overrides, for the run and its plan alike (e.g. memory.trim_heap=false)
    teacher: str = ""    # the distillation teacher's size (same arch; a size sharing the student's tokenizer); "": none
    top_k: int = 0       # algorithm.distill.top_k (topk_forward_kl); 0: reverse_kl, no top-k

    @property
    def label(self) -> str:
        # chunks run over the micro-batch's flattened response tokens
        chunk = "unchunked" if self.chunk >= self.micro * self.response_len else f"chunk {self.chunk}"
        extra = (" | KL" if self.kl else "") + (f" | LoRA r{self.lora}" if self.lora else "")
        extra += (" | critic" if self.critic else "") + (" | bf16" if self.mixed else "")
        extra += f" | budget {self.budget}" if self.budget else ""
        extra += (f" | teacher {self.teacher}" + (f" top-{self.top_k}" if self.top_k else "")) if self.teacher else ""
        arch = "" if self.arch == "qwen2" else f"{self.arch} "
        return (f"{arch}{self.size} x{self.ranks} | {self.prompts * self.n} seq P{self.prompt_len} R{self.response_len} "
                f"micro {self.micro} | ckpt {'on' if self.ckpt else 'off'} | {chunk}{extra}")

    @property
    def phases(self) -> tuple[str, ...]:
        return (("rollout",) * self.rollout + ("logprob",) + ("ref",) * self.kl + ("teacher",) * bool(self.teacher)
                + ("values", "critic_update") * self.critic + ("update",))

    def overrides(self, model_dir: str, teacher_dir: str = "") -> list[str]:
        o = [f"actor.model.path={model_dir}", f"data.max_prompt_length={self.prompt_len}",
             f"rollout.max_response_length={self.response_len}", f"data.rollout_batch_size={self.prompts}",
             f"rollout.n={self.n}", f"actor.mini_batch_size={self.prompts}", f"actor.micro_batch_size={self.micro}",
             f"actor.logprob_micro_batch_size={self.micro}", f"actor.model.gradient_checkpointing={self.ckpt}",
             f"actor.logprob_chunk_size={self.chunk}", "rollout.ignore_eos=true", f"rollout.micro_batch_size={64}",
             "trainer.device=cpu", f"trainer.num_threads={2 // self.ranks}", "reward.num_workers=0",
             "trainer.val_before_train=false",
             "algorithm.fold_old_logprob=false"]  # the old-log-prob pass is one of the measured phases
        if self.ranks > 1:
            o += ["trainer.backend=ray", f"trainer.devices_per_node={self.ranks}"]
        if self.kl:
            o += ["algorithm.use_kl_loss=true", f"ref.logprob_micro_batch_size={self.micro}"]
        if self.lora:
            o += [f"actor.lora.rank={self.lora}"]
        if self.critic:
            o += ["algorithm.adv_estimator=gae", f"critic.mini_batch_size={self.prompts}",
                  f"critic.micro_batch_size={self.micro}", f"critic.values_micro_batch_size={self.micro}"]
        if self.mixed:
            o += ["actor.fsdp.mixed_precision=true"]
        if self.budget:
            o += [f"actor.micro_batch_token_budget={self.budget}"]
        if self.teacher:
            o += [f"teacher.model.path={teacher_dir}", "algorithm.distill.weight=0.5",
                  f"teacher.logprob_micro_batch_size={self.micro}", f"algorithm.distill.top_k={self.top_k}",
                  f"algorithm.distill.loss={'topk_forward_kl' if self.top_k else 'reverse_kl'}"]
        return o + list(self.extra)


CASES = [
    Case("tiny", 1, 8, 8, 32, 64, 16, False, 1024),
    Case("small", 1, 4, 4, 64, 128, 8, False, 1024),
    Case("small", 1, 4, 4, 64, 128, 8, True, 1024),
    Case("small", 1, 4, 4, 128, 384, 8, False, 1024),
    Case("small", 1, 4, 4, 128, 384, 8, False, 4096),
    Case("small", 1, 2, 8, 128, 384, 4, True, 128),
    Case("small", 1, 8, 4, 64, 256, 16, False, 4096),
    Case("tiny", 2, 8, 8, 32, 64, 16, False, 1024),
    Case("small", 2, 4, 4, 64, 256, 8, False, 1024),
    Case("small", 2, 4, 4, 64, 256, 8, True, 4096),
    Case("medium", 1, 2, 4, 64, 128, 4, False, 1024),
    Case("medium", 1, 2, 4, 64, 128, 4, False, 1024, kl=True),           # + a reference model
    Case("medium", 1, 2, 4, 64, 128, 4, False, 1024, kl=True, lora=16),  # no reference model
    Case("small", 1, 4, 4, 128, 384, 8, False, 1024, kl=True, lora=16),
    # more shapes for the default allocator's factors (bench/cpu_corpus.py holds other runs out):
    # the deeper, narrower model with a 16k vocabulary, bf16 compute, a tiny model's longer batch
    Case("deep", 1, 2, 4, 32, 256, 4, False, 1024, rollout=True),
    Case("deep", 1, 4, 4, 32, 128, 8, True, 512, arch="llama"),
    Case("small", 1, 2, 4, 64, 128, 4, False, 1024, mixed=True, rollout=True),
    Case("deep", 2, 2, 4, 32, 96, 4, False, 1024, mixed=True),
    Case("tiny", 1, 2, 16, 32, 256, 16, False, 1024, arch="llama"),
]


# ------------------------------------------------------------------------------- measuring

def rank_setup(rank: int, world: int, port: int, case: dict, model_dir: str, teacher_dir: str = ""):
    """(the case, its config) in a rank's process: its gloo world when there are 2 ranks or more,
    its threads."""
    import torch

    if world > 1:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    from fitrl.config import load_config

    c = Case(**case)
    cfg = load_config(str(ROOT / "examples" / "arith.yaml"), c.overrides(model_dir, teacher_dir))
    torch.set_num_threads(cfg.trainer.num_threads)
    return c, cfg


def rank_main(rank: int, world: int, port: int, case: dict, model_dir: str, queue, teacher_dir: str = "") -> None:
    import torch

    preload = os.environ.get("LD_PRELOAD")  # bench/cpu_corpus.py --allocator: measured only if it took
    if preload and preload not in Path("/proc/self/maps").read_text():
        raise RuntimeError(f"LD_PRELOAD={preload} is not mapped in the rank's process")

    c, cfg = rank_setup(rank, world, port, case, model_dir, teacher_dir)
    from fitrl.data.batch import Batch
    from fitrl.roles.teacher import TeacherWorker
    from fitrl.roles.workers import CriticWorker, PolicyWorker, ReferenceWorker
    from fitrl.config.schema import SamplingConfig

    worker = PolicyWorker(cfg, rank=rank, world_size=world)
    ref = (worker if c.lora else ReferenceWorker(cfg, rank=rank, world_size=world)) if c.kl else None
    critic = CriticWorker(cfg, rank=rank, world_size=world) if c.critic else None
    # in one process beside the policy; with 2 ranks in a world of its own (teacher_rank_main)
    teacher = TeacherWorker(cfg, rank=rank, world_size=world) if c.teacher and world == 1 else None
    g = torch.Generator().manual_seed(rank)
    vocab = worker.tokenizer.vocab_size - 8  # below the special tokens
    lengths = torch.randint(c.prompt_len // 2, c.prompt_len + 1, (c.prompts // world,), generator=g).tolist()
    lengths[0] = c.prompt_len
    prompts = Batch(fields={"prompt_ids": [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]})
    sampling = SamplingConfig(n=c.n, max_tokens=c.response_len, ignore_eos=True)
    batch = worker.generate(prompts, sampling)
    batch.update(worker.compute_logprob(batch))
    if ref is not None:
        batch.update(ref.compute_ref_logprob(batch))
    if teacher is not None:
        batch.update(teacher.compute_teacher_logprob(batch))
    elif c.teacher:
        from plan_accuracy_teacher import teacher_columns

        batch.update(**teacher_columns(batch, c.top_k, vocab, g))
    if critic is not None:
        batch.update(critic.compute_values(batch))
        batch.update(returns=torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"])
    batch.update(advantages=torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"])
    # warm-up: one whole update, so AdamW states exist (the update frees its gradients) and the
    # allocator holds what a previous step left, as from the second RL step on
    if critic is not None:
        critic.update(batch)
    worker.update(batch)

    def run(phase: str) -> None:
        if phase == "rollout":  # the second step's, after the first step's update
            lp = worker.generate(prompts, sampling)
            del lp
        elif phase == "logprob":
            lp = worker.compute_logprob(batch)
            del lp
        elif phase == "values":
            lp = critic.compute_values(batch)
            del lp
        elif phase == "critic_update":
            critic.update(batch)
        elif phase == "ref":
            lp = ref.compute_ref_logprob(batch)
            del lp
        elif phase == "teacher":
            lp = teacher.compute_teacher_logprob(batch)
            del lp
        else:
            worker.update(batch)

    phases = [p for p in c.phases if p != "teacher" or teacher is not None]
    queue.put(json.dumps({"rank": rank, "seqs": len(batch), "width": batch["input_ids"].shape[1]}
                         | measured_phases(phases, run)))
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def measured_phases(phases, run) -> dict:
    """Each phase's start RSS, peak RSS (``VmHWM`` after a reset) and seconds, ``run(phase)`` running it."""
    from fitrl.telemetry.memory import peak_rss_bytes, reset_peak_rss, status_kib

    out = {}
    for phase in phases:
        start = status_kib("VmRSS") * 1024
        if not reset_peak_rss():
            raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): the peak would be the lifetime one")
        t0 = time.perf_counter()
        run(phase)
        out[phase] = {"start": start, "peak": peak_rss_bytes(), "seconds": time.perf_counter() - t0}
    return out


def measure(case: Case, model_dir: str, port: int, malloc: str, teacher_dir: str = "") -> dict:
    """Peak RSS per phase (rank maximum); ``malloc="mmap"`` starts the ranks with
    MALLOC_MMAP_THRESHOLD_=65536 (glibc then maps and unmaps every tensor of 64 KiB or more)."""
    import torch.multiprocessing as mp

    saved = os.environ.get(MMAP_ENV)
    if malloc == "mmap":
        os.environ[MMAP_ENV] = "65536"
    else:
        os.environ.pop(MMAP_ENV, None)
    try:
        return _measure(case, model_dir, port, mp.get_context("spawn"), teacher_dir)
    finally:
        if saved is None:
            os.environ.pop(MMAP_ENV, None)
        else:
            os.environ[MMAP_ENV] = saved


def _measure(case: Case, model_dir: str, port: int, ctx, teacher_dir: str = "") -> dict:
    results = _world(rank_main, case, model_dir, port, ctx, teacher_dir)
    if case.teacher and case.ranks > 1:  # the teacher's own ranks, as the plan's teacher process
        from plan_accuracy_teacher import teacher_rank_main

        teacher = _world(teacher_rank_main, case, model_dir, port + 100, ctx, teacher_dir)
        for r, t in zip(results, teacher):
            r["teacher"] = t["teacher"]
    phases = case.phases
    return {phase: max(r[phase]["peak"] for r in results) for phase in phases} | {
        "start": {phase: max(r[phase]["start"] for r in results) for phase in phases},
        "seconds": {phase: max(r[phase]["seconds"] for r in results) for phase in phases}}


def _world(target, case: Case, model_dir: str, port: int, ctx, teacher_dir: str) -> list[dict]:
    """``case.ranks`` processes running ``target``; each one's result."""
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, case.ranks, port, asdict(case), model_dir, queue, teacher_dir))
             for r in range(case.ranks)]
    for p in procs:
        p.start()
    results = []
    while len(results) < len(procs):  # (a rank that died puts nothing: say so, do not wait on it)
        try:
            results.append(json.loads(queue.get(timeout=10)))
        except Empty:
            if any(p.exitcode for p in procs):
                raise RuntimeError(f"a rank process failed for {case.label}") from None
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"rank process failed ({p.exitcode}) for {case.label}")
    return results


# ------------------------------------------------------------------------------ predicting

def predict(case: Case, model_dir: str, malloc: str, teacher_dir: str = "") -> dict:
    from fitrl.config import load_config
    from fitrl.memory import calibration
    from fitrl.planner import Hardware, plan_config

    cfg = load_config(str(ROOT / "examples" / "arith.yaml"),
                      [*case.overrides(model_dir, teacher_dir), f"plan.host_malloc={malloc}"])
    plan = plan_config(cfg, Hardware.cpu(ranks_per_node=case.ranks))
    # the bench's ranks are gloo processes of their own, not Ray actors: no Ray core worker in them
    ray_actor = calibration.CPU_RANK_EXTRA if case.ranks > 1 else 0
    return {phase: plan.process(planned_process(case, phase)).host_peak(PLAN_PHASES[phase]) - ray_actor
            for phase in case.phases} | {"plan": plan}


def planned_process(case: Case, phase: str) -> str:
    """The plan's process that runs ``phase``: the trainer rank, or with 2 ranks (Ray) the
    teacher's own rank for its pass."""
    return "teacher" if phase == "teacher" and case.ranks > 1 else "trainer"


def breakdown(case: Case, model_dir: str, teacher_dir: str = "") -> dict[str, tuple[int, int]]:
    """phase -> (held, transient) of the plan without glibc's factors (``plan.host_malloc=mmap``:
    what is held plus the traced transients): ``transient`` is what a glibc factor multiplies, the
    update's traced activations and logits (``_cpu_transient``), another phase's transients
    (``_cpu_retention``: activations, logits, gathered or autocast weights, KV cache), and
    ``held`` the rest. A measured factor is then (measured peak - held) / transient."""
    from fitrl.memory import calibration
    from fitrl.memory.trainer import TRANSIENT

    plan = predict(case, model_dir, "mmap", teacher_dir)["plan"]
    ray_actor = calibration.CPU_RANK_EXTRA if case.ranks > 1 else 0  # as predict()
    out = {}
    for phase in case.phases:
        host = plan.process(planned_process(case, phase)).phases[PLAN_PHASES[phase]].host
        keys = ("activations", "logits") if PLAN_PHASES[phase] == "update" else TRANSIENT
        transient = sum(host.get(k, 0) for k in keys)
        out[phase] = (sum(host.values()) - transient - ray_actor, transient)
    return out


def model_dirs(cases: list[Case], tmp: str) -> dict[tuple[str, str], str]:
    """The tiny models the cases use, built under ``tmp``: (arch, size) -> directory."""
    from fitrl.models.tiny import make_tiny_model

    return {(arch, size): str(make_tiny_model(Path(tmp) / f"{arch}-{size}", arch=arch, size=size, seed=0))
            for arch, size in sorted({(c.arch, s) for c in cases for s in (c.size, c.teacher) if s})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=int, nargs="*", help="indices of CASES to run")
    parser.add_argument("--malloc", nargs="+", default=["mmap", "glibc"], choices=["mmap", "glibc"])
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more config overrides for every run and its plan (e.g. memory.trim_heap=false)")
    parser.add_argument("--arch", help="run the chosen cases on this architecture instead of their own "
                                       "(e.g. qwen3_moe: the tiny mixture of experts)")
    parser.add_argument("--teacher", help="on-policy distillation with a teacher of this size (fitrl.models.tiny.SIZES "
                                          "sharing the student's tokenizer: tiny for tiny, the student's own model as "
                                          "the demo's teacher is; small or medium for small): its pass measured too")
    parser.add_argument("--top-k", type=int, default=0,
                        help="with --teacher: algorithm.distill.top_k (topk_forward_kl); 0: reverse_kl")
    parser.add_argument("--factors", action="store_true",
                        help="glibc rows: also print what the plan holds without glibc's factors, the transients a "
                             "factor multiplies, and the factor measured, (measured - held) / transients")
    args = parser.parse_args()
    from fitrl.memory.trainer import TRANSIENT

    chosen = args.only if args.only else range(len(CASES))
    cases = [(i, replace(CASES[i], extra=CASES[i].extra + tuple(args.set), arch=args.arch or CASES[i].arch,
                         teacher=args.teacher or CASES[i].teacher,
                         top_k=args.top_k if args.teacher else CASES[i].top_k))
             for i in chosen]
    rows = []
    print(f"{'#':>2} {'configuration':<80} {'phase':<7} {'malloc':<6} {'predicted':>9} {'measured':>9} {'error':>7} "
          f"{'phase s':>7}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = model_dirs([c for _, c in cases], tmp)
        for i, case in cases:
            for malloc in args.malloc:
                model, teacher = dirs[case.arch, case.size], dirs.get((case.arch, case.teacher), "")
                port = 29700 + 2 * i + (malloc == "glibc")
                meas = measure(case, model, port=port, malloc=malloc, teacher_dir=teacher)
                pred = predict(case, model, malloc, teacher)
                parts = breakdown(case, model, teacher)
                for phase in case.phases:
                    err = (pred[phase] - meas[phase]) / meas[phase]
                    held, transient = parts[phase]
                    factor = (meas[phase] - held) / transient if transient else float("nan")
                    rows.append({"case": i, "label": case.label, "phase": phase, "malloc": malloc,
                                 "predicted_gib": pred[phase] / GIB, "measured_gib": meas[phase] / GIB,
                                 "error": err, "seconds": meas["seconds"][phase], "held_gib": held / GIB,
                                 "transient_gib": transient / GIB, "factor": factor, "settings": list(args.set),
                                 # what CPU_RETAINED_AFTER_UPDATE takes a share of (the update's, factor applied)
                                 "update_transient_gib": sum(pred["plan"].process("trainer").phases["update"].host.get(k, 0)
                                                             for k in TRANSIENT) / GIB})
                    print(f"{i:>2} {case.label:<80} {phase:<7} {malloc:<6} {pred[phase] / GIB:9.3f} "
                          f"{meas[phase] / GIB:9.3f} {err:+7.1%} {meas['seconds'][phase]:7.1f}", flush=True)
                    if args.factors and malloc == "glibc":
                        print(f"{'':>2} {'held ' + format(held / GIB, '.3f') + ' GiB, transients ':>80} "
                              f"{transient / GIB:.3f} GiB: measured factor {factor:.2f}", flush=True)
    for malloc in args.malloc:
        errs = [abs(r["error"]) for r in rows if r["malloc"] == malloc]
        print(f"malloc={malloc}: {len(errs)} phase peaks, worst error {max(errs):.1%}, "
              f"mean |error| {sum(errs) / len(errs):.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    worst = max(abs(r["error"]) for r in rows if r["malloc"] == args.malloc[0])
    sys.exit(0 if worst <= 0.15 else 1)


if __name__ == "__main__":
    main()
