"""docs/architecture.md's "Map of the tree" names every module of zllm/, and nothing that is gone.

In a row, the first path is whole (`zllm/workers/worker.py`); later names in the same cell without
a folder are its neighbours (`sampler.py`); a folder (`zllm/workers/kernels/`) covers every module
in it. Packages' `__init__.py` files need no row (the package's docstring says what it is).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAP_HEADING = "### Map of the tree"


def map_rows() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split(MAP_HEADING, 1)[1].split("\n#", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `")]


def named_paths(row: str) -> set[str]:
    """The paths the row's first cell names, with bare neighbours resolved against the first."""
    cell = row.split("|")[1]
    names = re.findall(r"`([^`]+)`", cell)
    folder = names[0].rsplit("/", 1)[0] if names else ""
    return {name if name.startswith("zllm/") else f"{folder}/{name}" for name in names}


def mapped_modules() -> tuple[set[str], set[str]]:
    """(modules named, folders named) by the map."""
    named = set().union(*(named_paths(row) for row in map_rows()))
    return {n for n in named if n.endswith(".py")}, {n.rstrip("/") for n in named if n.endswith("/")}


def tree_modules() -> set[str]:
    paths = (p.relative_to(ROOT).as_posix() for p in (ROOT / "zllm").rglob("*.py"))
    return {p for p in paths if not p.endswith("/__init__.py") or p == "zllm/__init__.py"}


def test_named_paths_resolve_neighbours():
    row = "| `zllm/enginecore/request.py`, `request_queue.py` | states |"
    assert named_paths(row) == {"zllm/enginecore/request.py", "zllm/enginecore/request_queue.py"}


def test_every_module_is_on_the_map():
    modules, folders = mapped_modules()
    missing = sorted(m for m in tree_modules() if m not in modules and not any(m.startswith(f + "/") for f in folders))
    assert not missing, f"add these to docs/architecture.md's {MAP_HEADING!r}: {missing}"


def test_the_map_names_nothing_that_is_gone():
    modules, folders = mapped_modules()
    gone = sorted(p for p in modules | folders if not (ROOT / p).exists())
    assert not gone, f"docs/architecture.md's {MAP_HEADING!r} names paths that do not exist: {gone}"
