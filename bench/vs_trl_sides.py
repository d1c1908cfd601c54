"""One run of bench/vs_trl.py, in its own process: fitrl, TRL's GRPOTrainer, or the matmul peak.

    python bench/vs_trl_sides.py SPEC.json      # SPEC: {"side": "fitrl"|"trl"|"matmul", ...}

Writes ``spec["result"]`` (JSON): wall-clock (``time.time()``) stamps of every step's begin and
end, per-step metrics (reward, tokens, phase seconds), or ``{"error": ...}`` when the run failed.
The driver (bench/vs_trl.py) measures the process wall and samples the RSS of the process tree.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EVENTS: dict[str, list[float]] = {"step_begin": [], "step_end": []}


def fitrl_overrides(spec: dict) -> list[str]:
    """The dotted overrides over examples/arith.yaml that make fitrl do the same work as TRL (the
    choices are listed in bench/vs_trl.py's docstring)."""
    o = [
        f"actor.model.path={spec['model']}", f"trainer.run_dir={spec['run_dir']}", "checkpoint.resume=never",
        f"data.train_files=[{spec['data']}]", "data.val_files=[]", "trainer.val_before_train=false",
        "trainer.val_freq=0", "data.rollout_batch_size=8", "rollout.n=8",
        f"rollout.max_response_length={spec.get('max_new', 32)}", "rollout.temperature=1.0",
        f"rollout.top_k={spec.get('top_k', 0)}", "rollout.top_p=1.0",
        "actor.mini_batch_size=8", f"actor.micro_batch_size={spec['micro_batch']}", "actor.ppo_epochs=1",
        f"actor.optim.lr={spec.get('lr', 1e-3)}", "actor.optim.warmup_steps=0", "actor.optim.lr_schedule=constant",
        "actor.optim.weight_decay=0.0", "actor.optim.grad_clip=1.0",
        "algorithm.adv_estimator=grpo", "algorithm.loss_agg_mode=token-mean", "algorithm.use_kl_loss=false",
        "reward.function=arith", "reward.num_workers=0",
        "checkpoint.save_freq=0", "checkpoint.save_final=false", "trainer.log_samples=0",
        "trainer.progress_bar=false", "trainer.loggers=[console]", "trainer.log_freq=1",
        f"trainer.max_steps={spec['steps']}", f"trainer.seed={spec['seed']}", f"trainer.num_threads={spec['threads']}",
        "trainer.device=cpu",
    ]
    if spec["precision"] == "bf16":
        o.append("actor.fsdp.mixed_precision=true")  # single-process autocast (being added to fitrl)
    return o + list(spec.get("fitrl_set", []))


def run_fitrl(spec: dict) -> dict:
    from rich.console import Console

    from fitrl.config import load_config
    from fitrl.trainer import loop
    from fitrl.trainer.run import train

    cfg = load_config(str(ROOT / "examples/arith.yaml"), fitrl_overrides(spec))
    run_step = loop.RLTrainer.run_step

    def timed_run_step(self, step):  # the whole step as the loop runs it (phases, memory telemetry)
        EVENTS["step_begin"].append(time.time())
        try:
            return run_step(self, step)
        finally:
            EVENTS["step_end"].append(time.time())

    loop.RLTrainer.run_step = timed_run_step
    with open(spec["log"], "w") as log:
        train(cfg, Console(file=log, soft_wrap=True, width=200))
    keys = ("reward/mean", "response/length_mean", "time/step", "time/rollout", "time/update",
            "perf/rollout_tokens_per_s", "perf/update_tokens_per_s", "perf/tokens_per_s", "perf/update_mfu",
            "perf/peak_flops", "perf/mfu")
    steps = []
    for line in (Path(spec["run_dir"]) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step" in row and "reward/mean" in row:
            steps.append({k: row[k] for k in keys if k in row})
    for s in steps:  # prompt + response tokens of the step batch (perf/tokens_per_s is over time/step)
        if "perf/tokens_per_s" in s and "time/step" in s:
            s["tokens"] = s["perf/tokens_per_s"] * s["time/step"]
    return {"steps": steps}


def run_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fitrl.rewards.functions import read_result, resolve_reward_fn

    torch.set_num_threads(spec["threads"])
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line.strip()]
    # fitrl renders each row's prompt as one user message through the chat template: the same here
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                 for r in rows])
    fn = resolve_reward_fn("arith")  # fitrl's own reward, called on the same decoded text

    def arith(prompts, completions, answer, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [read_result(fn(t, a), "arith")[0] for t, a in zip(texts, answer)]

    seqs, micro = 64, spec["micro_batch"]
    accum = seqs // micro
    args = GRPOConfig(
        output_dir=spec["run_dir"], max_steps=spec["steps"], seed=spec["seed"], data_seed=spec["seed"],
        per_device_train_batch_size=micro, gradient_accumulation_steps=accum, steps_per_generation=accum,
        num_generations=8, num_iterations=1, max_completion_length=spec.get("max_new", 32), temperature=1.0,
        top_p=1.0, top_k=spec.get("top_k", 0), learning_rate=spec.get("lr", 1e-3), lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch", max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", mask_truncated_completions=False,
        bf16=spec["precision"] == "bf16", fp16=False, gradient_checkpointing=False, use_cpu=True,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
        logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no", log_completions=False,
        disable_tqdm=True, dataloader_num_workers=0, log_level="warning",
    )
    trl_logs: list[dict] = []  # TRL's per-step log records

    class Stamps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            EVENTS["step_begin"].append(time.time())

        def on_step_end(self, args, state, control, **kw):
            EVENTS["step_end"].append(time.time())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                trl_logs.append(dict(logs))
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=arith, args=args, train_dataset=dataset,
                          callbacks=[Stamps()])
    # Phase times and token counts, per generation (= per optimizer step here): TRL logs its
    # profiling timers only to W&B/MLflow/trackio, so the bound methods are wrapped instead.
    phases: list[dict] = []
    generate, gen_and_score, training_step = (trainer._generate_single_turn,
                                              trainer._generate_and_score_completions, trainer.training_step)

    def timed_generate(prompt_ids, *a, **kw):
        t = time.perf_counter()
        out = generate(prompt_ids, *a, **kw)
        phases[-1].update(generate_s=time.perf_counter() - t, prompt_tokens=sum(len(p) for p in prompt_ids),
                          response_tokens=sum(len(c) for c in out[0]), sequences=len(out[0]))
        return out

    def timed_gen_and_score(*a, **kw):
        t = time.perf_counter()
        out = gen_and_score(*a, **kw)
        phases[-1]["rollout_and_score_s"] = time.perf_counter() - t
        return out

    def timed_training_step(*a, **kw):
        if trainer._step % accum == 0:
            phases.append({"training_steps_s": 0.0})
        t = time.perf_counter()
        out = training_step(*a, **kw)
        phases[-1]["training_steps_s"] += time.perf_counter() - t
        return out

    trainer._generate_single_turn, trainer._generate_and_score_completions = timed_generate, timed_gen_and_score
    trainer.training_step = timed_training_step
    with open(spec["log"], "w") as log, _redirect(log):
        trainer.train()
    steps = []
    for lg, ph in zip(trl_logs, phases):
        update = ph["training_steps_s"] - ph.get("rollout_and_score_s", 0.0)  # forward/backward + optimizer
        tokens = ph.get("prompt_tokens", 0) + ph.get("response_tokens", 0)
        steps.append({"reward/mean": lg["reward"], "response/length_mean": lg.get("completions/mean_length"),
                      "time/rollout": ph.get("generate_s"), "time/update": update, "tokens": tokens,
                      "sequences": ph.get("sequences"),
                      "perf/rollout_tokens_per_s": ph.get("response_tokens", 0) / ph["generate_s"]
                      if ph.get("generate_s") else None,
                      "perf/update_tokens_per_s": tokens / update if update > 0 else None,
                      "trl/step_time": lg.get("step_time")})
    return {"steps": steps}


class _redirect:
    """stdout and stderr into ``f`` (TRL and transformers print their warnings and log lines there)."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        self.saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = self.f

    def __exit__(self, *exc):
        sys.stdout, sys.stderr = self.saved


def run_matmul(spec: dict) -> dict:
    """Best GFLOP/s of a square ``torch.mm`` at ``spec['threads']`` threads, per dtype: the size
    grows until one product takes >= 50 ms (at most 4096), then products repeat for >= 1 s.
    ``bf16_fitrl``: the bf16 product as fitrl runs it under autocast (fitrl/core/bf16_matmul.py:
    the fp32 kernel on a CPU without bf16 kernels, else the same as ``bf16``)."""
    import contextlib

    import torch

    from fitrl.core.bf16_matmul import bf16_matmuls

    torch.set_num_threads(spec["threads"])
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("bf16_fitrl", torch.bfloat16)):
        with (bf16_matmuls(torch.device("cpu"), dtype) if name == "bf16_fitrl" else contextlib.nullcontext()):
            out[name] = _mm_peak(dtype)
    return out


def _mm_peak(dtype) -> dict:
    import torch

    n = 512
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)
        t = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t
        if dt >= 0.05 or n >= 4096:
            break
        n *= 2
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < 1.0:
        t = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t))
    return {"gflops": best / 1e9, "n": n}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    run = {"fitrl": run_fitrl, "trl": run_trl, "matmul": run_matmul}[spec["side"]]
    try:
        result = run(spec)
    except BaseException as e:  # the driver reports it (and, for fitrl bf16, as unsupported)
        result = {"error": f"{type(e).__name__}: {e}".strip().splitlines()[0][:400], "traceback": traceback.format_exc()}
    result["events"] = EVENTS
    Path(spec["result"]).write_text(json.dumps(result))
    sys.exit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()
