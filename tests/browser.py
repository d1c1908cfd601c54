"""A real headless browser for page tests: Debian's Chromium, driven from the command line.

``make test`` installs it where apt-get can be used (the Makefile's ``browser`` target); where it
is missing, :func:`chromium_or_skip` skips the test and says how to get it.

The page is read back with ``--dump-dom`` (the DOM after the page's scripts ran, within a virtual
time budget) and checked with :func:`figure_checks`: each report figure must hold plotly's
``svg.main-svg`` and at least one drawn mark (a line path, or a bar's or a marker's path).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Optional

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
TIMEOUT = 180.0  # seconds; a cold start on 2 busy cores takes a few, this is generous slack


def find_chromium() -> Optional[str]:
    return next((path for path in map(shutil.which, CANDIDATES) if path), None)


def chromium_or_skip() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip("no Chromium on this machine (looked for " + ", ".join(CANDIDATES) + "): `make test` installs "
                    "Debian's `chromium` when run as root with apt-get; or `apt-get install -y chromium`")
    return path


def _run(chromium: str, page: Path, profile: Path, *flags: str, window: str = "1400,2000") -> subprocess.CompletedProcess:
    # --no-sandbox: Chromium refuses to run as root with its sandbox; a private profile directory
    # keeps parallel runs (other test processes, a user's browser) from sharing a lock.
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--no-first-run", "--mute-audio", f"--user-data-dir={profile}", f"--window-size={window}",
           "--virtual-time-budget=20000", *flags, page.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)


def dump_dom(chromium: str, page: Path, profile: Path) -> str:
    result = _run(chromium, page, profile, "--dump-dom")
    assert result.returncode == 0 and result.stdout.strip(), f"chromium --dump-dom failed: {result.stderr[-2000:]}"
    return result.stdout


def screenshot(chromium: str, page: Path, profile: Path, png: Path, window: str = "1400,2000") -> Path:
    result = _run(chromium, page, profile, f"--screenshot={png}", window=window)
    assert result.returncode == 0 and png.is_file() and png.stat().st_size > 0, \
        f"chromium --screenshot failed: {result.stderr[-2000:]}"
    return png


@dataclass
class FigureCheck:
    title: str
    main_svgs: int = 0
    marks: int = 0  # drawn paths: line segments, bars, markers

    @property
    def rendered(self) -> bool:
        return self.main_svgs > 0 and self.marks > 0


@dataclass
class PageCheck:
    figures: list[FigureCheck] = field(default_factory=list)
    errors: Optional[str] = None        # the text of the page's #fitrl-errors box
    error_count: Optional[str] = None   # its data-count attribute
    texts: list[str] = field(default_factory=list)  # every text node (annotations, tables)


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _DomReader(HTMLParser):
    """Walks the dumped DOM keeping the open elements, attributing plotly's marks to the
    ``div.fitrl-figure`` they are drawn in."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = PageCheck()
        self.stack: list[tuple[str, set[str]]] = []
        self.figure_depth: Optional[int] = None
        self.in_errors = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        if tag == "div" and "fitrl-figure" in classes and self.figure_depth is None:
            self.page.figures.append(FigureCheck(a.get("data-title") or "?"))
            self.figure_depth = len(self.stack)
        if a.get("id") == "fitrl-errors":
            self.page.error_count, self.page.errors, self.in_errors = a.get("data-count"), "", True
        self._mark(tag, classes, a)
        if tag not in VOID:
            self.stack.append((tag, classes))

    def handle_startendtag(self, tag, attrs):
        a = dict(attrs)
        self._mark(tag, set((a.get("class") or "").split()), a)

    def _mark(self, tag, classes, a):
        if self.figure_depth is None:
            return
        figure = self.page.figures[-1]
        if tag == "svg" and "main-svg" in classes:
            figure.main_svgs += 1
        parent = self.stack[-1][1] if self.stack else set()
        drawn = (a.get("d") or "").startswith("M")
        if tag == "path" and drawn and ({"js-line", "point"} & classes or "point" in parent):
            figure.marks += 1

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        while self.stack:
            open_tag, _ = self.stack.pop()
            if open_tag == tag:
                break
        if tag == "pre":
            self.in_errors = False
        if self.figure_depth is not None and len(self.stack) <= self.figure_depth:
            self.figure_depth = None

    def handle_data(self, data):
        if self.in_errors:
            self.page.errors += data
        if data.strip():
            self.page.texts.append(data.strip())


def figure_checks(dom: str) -> PageCheck:
    reader = _DomReader()
    reader.feed(dom)
    reader.close()
    return reader.page


ARTIFACTS = Path(__file__).resolve().parent.parent / ".artifacts"


def check_page_in_browser(page: Path, tmp_path: Path, png_name: str, window: str) -> PageCheck:
    """Open a report page in headless Chromium: no script error, every chart drawn; its
    screenshot kept as ``.artifacts/<png_name>``."""
    chromium = chromium_or_skip()
    dom = dump_dom(chromium, page, tmp_path / "profile-dom")
    check = figure_checks(dom)
    png = screenshot(chromium, page, tmp_path / "profile-shot", tmp_path / png_name, window=window)
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(png, ARTIFACTS / png_name)
    assert check.error_count == "0" and not check.errors, f"script errors on the page: {check.errors}"
    expected = page.read_text().count('class="fitrl-figure')
    assert len(check.figures) == expected > 0
    empty = [f"{f.title} (svg {f.main_svgs}, marks {f.marks})" for f in check.figures if not f.rendered]
    assert not empty, f"charts not drawn: {empty}"
    return check
