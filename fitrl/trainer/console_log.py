"""``<run_dir>/console.log``: what the run's console printed, kept with the run.

From the moment the run directory is held (fitrl/trainer/run.py) to the end of the run, every
``console.print`` of the run's console (the memory plan, the notices, the step and validation
lines, the progress lines, warnings, the checkpoints) is copied as plain text at the console's
width: no colours, no live progress bar (a terminal's bar is redrawn in place; the file gets the
lines a console that is not a terminal gets, fitrl/trainer/logging.py). A run that stops on an
error ends its file with the error's first line.

The file is written once the run has passed its checks and writes its own files
(:meth:`ConsoleLog.keep`, where config.yaml is saved); until then the lines wait in memory, so a
run refused by its checks leaves the directory as it found it (an existing run's files
untouched, a new directory removed: fitrl/trainer/rundir.py). A later start in the same directory
(a resume, a restart) writes a file of its own, ``console-2.log``, ``console-3.log``, ... and
leaves the earlier ones as they are.
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console

CONSOLE_LOG = "console.log"


def next_log_path(run_dir: Path) -> Path:
    """``console.log``, or the first ``console-<n>.log`` (n = 2, 3, ...) not in ``run_dir`` yet."""
    path, n = Path(run_dir) / CONSOLE_LOG, 2
    while path.exists():
        path, n = Path(run_dir) / f"console-{n}.log", n + 1
    return path


class ConsoleLog:
    """``with ConsoleLog(console, run_dir) as log: ...; log.keep(); ...``: ``console``'s prints in
    the block are copied, to memory until :meth:`keep`, then to the run's console log."""

    def __init__(self, console: Console, run_dir: Path):
        self.console, self.run_dir = console, Path(run_dir)
        self.path: Optional[Path] = None  # set by keep()
        self.file: Optional[Any] = None
        self.log: Optional[Console] = None
        self._own: Optional[Any] = None

    def __enter__(self) -> "ConsoleLog":
        # the console's width, so tables wrap as on the screen; never a terminal: plain text
        self.log = Console(file=io.StringIO(), width=self.console.width, soft_wrap=self.console.soft_wrap,
                           force_terminal=False, no_color=True, highlight=False, emoji=False)
        self.log.file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv) or 'fitrl'}\n")
        self._own = self.console.__dict__.get("print")  # an outer ConsoleLog's, else None: the class's
        shown = self.console.print

        def print_both(*objects: Any, **kw: Any) -> None:
            shown(*objects, **kw)
            if self.log is not None:
                try:
                    self.log.print(*objects, **kw)
                    self.log.file.flush()
                except (OSError, ValueError):  # a full disk, a closed file: the screen still has it
                    pass

        self.console.print = print_both  # (an instance attribute: this console only, undone on exit)
        return self

    def keep(self) -> Path:
        """The run goes on: what it printed so far, and from now on, goes to its console log."""
        if self.path is None and self.log is not None:
            self.path = next_log_path(self.run_dir)
            self.file = open(self.path, "w", encoding="utf-8")
            self.file.write(self.log.file.getvalue())
            self.file.flush()
            self.log.file = self.file
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._own is None:
            self.console.__dict__.pop("print", None)  # the class's method again
        else:
            self.console.print = self._own
        self.log = None
        if self.file is None:  # never kept: the run stopped at its checks, nothing is written
            return
        if exc is not None:
            first = str(exc).splitlines()[0] if str(exc) else ""
            self.file.write(f"stopped: {type(exc).__name__}{': ' + first if first else ''}\n")
        self.file.close()
