"""Every import circle between fitrl's modules, found with grimp (installed with import-linter).

A circle is a strongly connected group of modules: each reaches every other through imports.
Function-level (lazy) imports count, because they are still an arrow from one file to another;
``TYPE_CHECKING`` imports count unless ``--runtime`` is given (they are arrows a reader and a type
checker follow, even if Python never runs them).

    .venv/bin/python bench/import_cycles.py                  # all of fitrl, TYPE_CHECKING included
    .venv/bin/python bench/import_cycles.py --runtime        # only imports Python executes
    .venv/bin/python bench/import_cycles.py fitrl.memory     # circles inside one package

Exit 1 when any circle is found.
"""

from __future__ import annotations

import argparse
import sys

import grimp


def circles(package: str = "fitrl", *, runtime_only: bool = False, within: str = "") -> list[list[str]]:
    """The strongly connected groups (two modules or more) of the import graph of ``package``,
    restricted to modules under ``within`` (all of them when empty), each sorted, smallest first."""
    graph = grimp.build_graph(package, exclude_type_checking_imports=runtime_only, cache_dir=None)
    inside = lambda m: not within or m == within or m.startswith(within + ".")  # noqa: E731
    nodes = sorted(m for m in graph.modules if inside(m))
    edges = {m: sorted(n for n in graph.find_modules_directly_imported_by(m) if inside(n)) for m in nodes}
    # Tarjan's algorithm, iterative: the graph is ~300 modules, but recursion depth is not the point.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups, key=lambda g: (len(g), g))


def arrows(group: list[str], package: str = "fitrl", *, runtime_only: bool = False) -> list[str]:
    """The imports inside one circle, as ``a -> b (line n)``, so a reader sees which to cut."""
    graph = grimp.build_graph(package, exclude_type_checking_imports=runtime_only, cache_dir=None)
    members = set(group)
    out = []
    for a in group:
        for b in sorted(graph.find_modules_directly_imported_by(a) & members):
            lines = sorted({d["line_number"] for d in graph.get_import_details(importer=a, imported=b)})
            out.append(f"{a} -> {b} (line {', '.join(map(str, lines))})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("within", nargs="?", default="", help="a package inside fitrl, e.g. fitrl.memory")
    parser.add_argument("--runtime", action="store_true", help="leave out TYPE_CHECKING imports")
    args = parser.parse_args(argv)
    groups = circles(runtime_only=args.runtime, within=args.within)
    for group in groups:
        print(f"circle of {len(group)}:")
        for arrow in arrows(group, runtime_only=args.runtime):
            print("   ", arrow)
    print(f"{len(groups)} circle(s)")
    return 1 if groups else 0


if __name__ == "__main__":
    sys.exit(main())
