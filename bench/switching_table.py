"""docs/switching.md's tables of each source's defaults layer and of what the import approximates,
written from the code that does the importing, between ``<!-- defaults:begin -->`` and
``<!-- defaults:end -->``.

For each layer of fitrl/config/import_defaults.py (veRL, EasyR1, EasyR1 0.2): every default it
holds (``key = value``) and what ``fitrl import-config`` makes of it (the fitrl keys, and why where
it is approximated or left), as the importer translates it for a source that sets nothing; the
published file's keys the layer leaves to fitrl, and why; then, per source framework, the keys
whose translation is approximated whatever their value, and those whose status depends on it.

    .venv/bin/python bench/switching_table.py            # rewrite the section
    .venv/bin/python bench/switching_table.py --check    # exit 1 when the section is stale
    .venv/bin/python bench/switching_table.py --print    # print the section, write nothing

Instant (no plan). ``tests/test_import_corpus.py`` runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "bench"):  # run as a script from anywhere, or loaded by path (tests)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from fitrl.config.import_defaults import DEFAULTS, LAYOUTS, LEFT_TO_FITRL, SOURCE_NAMES, with_defaults  # noqa: E402
from fitrl.config.import_maps import APPROXIMATED, EASYR1, EASYR1_PREFIXES, VERL, VERL_PREFIXES  # noqa: E402
from fitrl.config.importer import translate  # noqa: E402
import doc_section  # noqa: E402

DOC = ROOT / "docs" / "switching.md"
BEGIN, END = "<!-- defaults:begin -->", "<!-- defaults:end -->"
PUBLISHED = {"verl": "tests/data/foreign/defaults/verl/_generated_ppo_trainer.yaml",
             "easyr1": "tests/data/foreign/defaults/easyr1/config_defaults.yaml",
             "easyr1-0.2": "tests/data/foreign/defaults/easyr1-0.2/config_defaults.yaml"}
"""The published defaults each layer mirrors (tests/test_import_defaults.py checks every value)."""
ENTRY = {"verl": "`verl.trainer.main_ppo`", "easyr1": "`verl.trainer.main`"}
MAPS = {"verl": {**VERL, **VERL_PREFIXES}, "easyr1": {**EASYR1, **EASYR1_PREFIXES}}


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def framework(name: str) -> str:
    return LAYOUTS[name][0] if name in LAYOUTS else name


def layer_rows(name: str) -> list[str]:
    """Each default of the layer and its translation, as an import of a source that sets nothing has it."""
    fmt = framework(name)
    imported = translate(fmt, with_defaults(name, {}))
    rows = []
    for status, shown, text in imported.lines:
        key = shown.partition("=")[0]
        if key not in DEFAULTS[name] and not key.startswith("("):
            continue
        source = f"`{key} = {value_text(DEFAULTS[name][key])}`" if key in DEFAULTS[name] else key
        fitrl, _, why = text.partition(": ")
        if key.startswith("("):  # (a line of the importer's own, not a key: veRL's dataset layout)
            fitrl, why = text, ""
        elif fitrl == "(nothing to set)":
            fitrl = "(nothing)"
        else:
            fitrl = ", ".join(f"`{pair}`" for pair in fitrl.split(", "))
        rows.append(f"| {cell(source)} | {cell(fitrl)} | {status}{': ' + cell(why) if why else ''} |")
    return rows


def value_text(value) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def approximated(fmt: str) -> tuple[list[str], list[str]]:
    """The keys approximated whatever their value (with why), and those whose status depends on it."""
    fixed, depends = [], []
    for key, rule in MAPS[fmt].items():
        shown = f"`{key}*`" if key.endswith(".") else f"`{key}`"
        if rule.choose is not None:
            depends.append(shown)
        elif rule.status == APPROXIMATED:
            fixed.append(f"| {shown} | {cell(rule.why)} |")
    return fixed, depends


def render() -> str:
    out = ["Written by `bench/switching_table.py` from `fitrl/config/import_defaults.py` and the maps it reads "
           "(`tests/test_import_corpus.py` checks it is current). Each default is shown as `fitrl import-config` "
           "translates it for a source that sets nothing; a key the source sets is translated the same way."]
    for name in DEFAULTS:
        fmt = framework(name)
        chosen = ""
        if name in LAYOUTS:
            chosen = ", chosen when a source sets " + " or ".join(f"`{k}`" for k in LAYOUTS[name][1])
        out += ["", f"**{SOURCE_NAMES[name]}'s defaults layer** ({ENTRY[fmt]}{chosen}; mirrors `{PUBLISHED[name]}`)",
                "", f"| {SOURCE_NAMES[name]}'s default | fitrl | status |",
                "|---|---|---|", *layer_rows(name)]
        left = LEFT_TO_FITRL.get(name, {})
        if left:
            out += ["", "Left to fitrl's defaults: " + "; ".join(f"`{k}` ({cell(why)})" for k, why in left.items())
                    + "."]
    for fmt in MAPS:
        fixed, depends = approximated(fmt)
        out += ["", f"**Approximated in any {SOURCE_NAMES[fmt]} source**", "", "| key | how |", "|---|---|", *fixed,
                "", f"Whether these are translated, approximated or left depends on the value (each import says, key "
                    f"by key): {', '.join(depends)}."]
    return "\n".join(out)


def splice(doc: str, body: str) -> str:
    return doc_section.splice(doc, body, BEGIN, END, "docs/switching.md")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/switching.md's defaults section is stale")
    mode.add_argument("--print", action="store_true", help="print the section; write nothing")
    args = ap.parse_args(argv)
    return doc_section.write_section(DOC, render(), BEGIN, END, what="defaults", script="bench/switching_table.py",
                                     check=args.check, show=args.print)


if __name__ == "__main__":
    sys.exit(main())
