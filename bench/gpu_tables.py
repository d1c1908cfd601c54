"""What ``make gpu-check`` (bench/gpu_check.py) makes of its measurements beyond the per-case
table: the allocator's reserve factors per phase, bf16 against fp32 and expandable segments on
against off, and the markdown of the doctor's and the probes' figures."""

from __future__ import annotations

def reserve_factors(measured: dict) -> dict:
    """Per phase: peak reserved over peak allocated (the caching allocator's reserve)."""
    return {ph: m["gpu_peak_reserved"] / m["gpu_peak"] for ph, m in (measured.get("phases") or {}).items()
            if m.get("gpu_peak") and m.get("gpu_peak_reserved") is not None}


def comparisons(cases: list[dict]) -> dict:
    """q05 against its variants: reserve factors with expandable segments off and on; bf16
    against fp32 step and update time."""
    got = {r["case"]: r.get("measured") or {} for r in cases}
    out = {}
    if "phases" in got.get("q05", {}) and "phases" in got.get("q05-expandable", {}):
        out["reserve_factor"] = {"expandable_off": reserve_factors(got["q05"]),
                                 "expandable_on": reserve_factors(got["q05-expandable"])}
    if "perf" in got.get("q05", {}) and "perf" in got.get("q05-fp32", {}):
        bf16, fp32 = got["q05"]["perf"], got["q05-fp32"]["perf"]
        out["precision"] = {k: {"bf16": bf16.get(k), "fp32": fp32.get(k),
                                "fp32_over_bf16": fp32[k] / bf16[k] if bf16.get(k) and fp32.get(k) else None}
                            for k in ("time/step", "time/update", "time/rollout", "perf/update_tokens_per_s")}
    return out


def extra_tables(report: dict) -> str:
    rows = []
    doctor = report.get("doctor")
    if doctor:
        rows += ["", f"fitrl doctor (exit {doctor['rc']}, {doctor['seconds']:.0f} s):", "",
                 *[f"    {x}" for x in doctor["lines"]]]
    probes = report.get("probes") or {}
    c = probes.get("context") or {}
    if c.get("context_gib") is not None:
        rows += ["", f"CUDA context: {c['context_gib']:.3f} GiB bare, +{c['first_matmul_gib']:.3f} GiB at the first "
                     f"matmul ({c.get('device', '')})"]
    pin = probes.get("pinned") or {}
    if "rss_factor" in pin:
        rows += ["", f"{'pinned' if pin['pinned'] else 'unpinned (no CUDA)'} host tensors: {pin['tensors']} of "
                     f"{pin['bytes_gib']:.3f} GiB in all: RSS x{pin['rss_factor']:.2f} "
                     f"(+{pin['rounding_per_tensor_mib']:.2f} MiB per tensor), allocator reserve "
                     + (f"x{pin['reserved_factor']:.2f}" if pin["reserved_factor"] else "not reported") + ", "
                     f"{pin['kept_after_free_gib']:.3f} GiB kept after free"]
    comp = report.get("comparisons") or {}
    if "reserve_factor" in comp:
        rf = comp["reserve_factor"]
        rows += ["", "| phase | reserve factor, expandable segments off | on |", "|---|---|---|",
                 *[f"| {ph} | {v:.3f} | {rf['expandable_on'].get(ph, float('nan')):.3f} |"
                   for ph, v in rf["expandable_off"].items()]]
    if "precision" in comp:
        rows += ["", "| q05 | bf16 | fp32 | fp32 / bf16 |", "|---|---|---|---|",
                 *[f"| {k} | {v['bf16'] or 0:.3g} | {v['fp32'] or 0:.3g} | {v['fp32_over_bf16'] or 0:.2f} |"
                   for k, v in comp["precision"].items()]]
    return "\n" + "\n".join(rows) if rows else ""
