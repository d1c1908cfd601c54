"""``fitrl report RUN_DIR [-o OUT.html] [--samples N]``, wired into the main parser by ``fitrl.cli``.

Exit status: 0 with the page written; 2 (one line, a :class:`~fitrl.report.load.ReportError`)
when the directory is not a run directory, holds no record yet, or plotly is not installed.
"""

from __future__ import annotations

import argparse


def add_report_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report", help="one self-contained HTML page of a run: every curve, each phase's memory against the plan",
        description="Write an HTML page of a run directory (works while the run is going and after it died): "
                    "reward, length, entropy, KL, clipping, gradients, learning rate, time per phase, throughput, "
                    "host and GPU memory per process and phase with the plan's predicted peak, leak warnings, "
                    "guard stops, the last samples and the resolved config. Opens without a network.")
    p.add_argument("run_dir", help="a run directory (holds metrics.jsonl), e.g. runs/arith-grpo-20261121-002202")
    p.add_argument("-o", "--output", help="where to write the page (default RUN_DIR/report.html)")
    p.add_argument("--samples", type=int, default=20, help="how many of the last samples of generations.jsonl to show")
    p.set_defaults(fn=cmd_report)
    return p


def cmd_report(args: argparse.Namespace) -> int:
    from fitrl.report.page import write_report

    out = write_report(args.run_dir, args.output, samples=args.samples)
    print(f"report: {out} (open it in a browser; it needs no network)")
    return 0
