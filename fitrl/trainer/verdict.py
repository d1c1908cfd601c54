"""The demo's verdicts on a finished run (``fitrl demo``, fitrl/trainer/demo.py): did the reward rise
beyond noise, did validation accuracy rise, did the policy collapse. Pure functions of the run's
metrics; standard library only (the CLI imports the demo before anything heavy)."""

from __future__ import annotations

from pathlib import Path


def accuracy_gain(metrics_file: Path, prompts: int = 0, by: str = "GRPO") -> dict | None:
    """Validation accuracy (the reward's ``exact`` component, else the mean reward) at the first
    and the last validation of a run: what GRPO did to the policy it started from. With the
    number of validation ``prompts``, an accuracy's rise is also judged against noise: it must
    exceed 2 standard errors of the difference of two proportions over that many prompts
    (binomial, the two validations treated as independent: conservative, since they score the
    same prompts). ``by``: what trained the policy, as the message names it."""
    import json

    vals = [r for r in map(json.loads, metrics_file.read_text().splitlines()) if "val/reward/mean" in r]
    if len(vals) < 2:
        return None
    key = "val/reward/exact" if "val/reward/exact" in vals[0] else "val/reward/mean"
    name = "exact-match accuracy" if key.endswith("exact") else "mean reward"
    before, after = vals[0][key], vals[-1][key]
    parts = [f"{after / before:.2f}x"] if before > 0 else []
    said = f"{by} raised it" if after > before else f"{by} did NOT raise it"
    beyond = None
    if prompts > 0 and key.endswith("exact"):  # a proportion of prompts answered exactly
        se = ((before * (1 - before) + after * (1 - after)) / prompts) ** 0.5
        beyond = after - before > 2 * se
        parts.append(f"{after - before:+.3f}, 2 std-errors over {prompts} prompts = {2 * se:.3f}")
        if after > before:
            said += " beyond noise" if beyond else ", but within noise"
    detail = f" ({'; '.join(parts)})" if parts else ""
    return {"before": before, "after": after, "beyond_noise": beyond, "message":
            f"validation {name}: {before:.3f} at step {vals[0]['step']}, {after:.3f} at step {vals[-1]['step']}"
            f"{detail}: {said}"}


def collapsed(history: list[dict], max_response_length: int, window: int = 10) -> str | None:
    """How the policy of the last ``window`` steps is degenerate, or None: (nearly) every response
    runs to the length limit without ending, or the step's responses are one or two answers."""
    import statistics

    last = history[-window:]
    if len(last) < window:
        return None
    clip = statistics.fmean(h.get("response/clip_ratio", 0.0) for h in last)
    if clip >= 0.9:
        return (f"{clip:.0%} of the last {window} steps' responses ran to the length limit "
                f"(rollout.max_response_length={max_response_length}) without ending")
    distinct = [h["response/distinct"] for h in last if "response/distinct" in h]
    if distinct and statistics.fmean(distinct) <= 2:
        return f"the last {window} steps' responses are {statistics.fmean(distinct):.1f} distinct answers on average"
    return None


def judge_rise(rewards: list[float], window: int = 10) -> dict:
    """Did the reward rise by more than noise? Compares the mean of the last ``window`` steps
    with the first ``window``: the difference must exceed 2 standard errors of the difference
    (per-step means treated as independent samples)."""
    import statistics

    if len(rewards) < 2 * window:
        return {"rose": False, "judged": False,
                "message": f"only {len(rewards)} steps: need {2 * window} to judge the reward curve"}
    first, last = rewards[:window], rewards[-window:]
    diff = statistics.fmean(last) - statistics.fmean(first)
    se = ((statistics.variance(first) + statistics.variance(last)) / window) ** 0.5
    rose = diff > 2 * se
    return {"rose": rose, "judged": True, "diff": diff, "se": se, "message":
            f"reward: first {window} steps {statistics.fmean(first):.3f}, last {window} steps "
            f"{statistics.fmean(last):.3f} (+{diff:.3f}, 2 std-errors = {2 * se:.3f}): "
            + ("rose beyond noise" if rose else "did NOT rise beyond noise")}
