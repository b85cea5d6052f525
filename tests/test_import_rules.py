"""The import rules of docs/architecture.md ("Imports flow one way"), checked on the source and on
what importing each process's entry module loads, so that they stay true.

    zllm/launch                       assembles and supervises: may import anything
    zllm/frontend  zllm/enginecore  zllm/workers     one package per process; none imports another
    shared: zllm/ipc, zllm/procs, config, model_spec, sampling_params, outputs, ...   import no process

Inside the frontend, the OpenAI HTTP API (zllm/frontend/openai) is a client of the server: only
the launcher (and the subpackage itself) imports it.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent.parent / "zllm"
PROCESSES = ("zllm.frontend", "zllm.enginecore", "zllm.workers")
LAUNCH = "zllm.launch"
OPENAI_API = "zllm.frontend.openai"  # a client of the frontend server: only the launcher builds it
CLIENT_MAY_IMPORT = ("zllm.ipc", "zllm.outputs", "zllm.sampling_params")  # pyzmq + msgspec only


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_name(path: Path) -> str:
    """The package a file's relative imports start from: its own for an __init__.py."""
    name = module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def absolute_name(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` names, with a relative one (`from .x import y`, `from ..
    import z`) resolved against `package` as Python resolves it."""
    if node.level == 0:
        return node.module
    return importlib.util.resolve_name("." * node.level + (node.module or ""), package)


def imported_modules(path: Path) -> set[str]:
    """Every module the file imports, at the top or inside a function (a lazy import is still a
    dependency), relative imports by their absolute names; `if TYPE_CHECKING:` blocks are left
    out: they never run."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = absolute_name(node, package_name(path))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def package_of(module: str) -> str:
    """The process package (or zllm.launch) a module belongs to; "shared" for everything else."""
    for package in (*PROCESSES, LAUNCH):
        if within(module, package):
            return package
    return "shared"


def zllm_edges() -> list[tuple[str, str]]:
    """(importer, imported) for every import of a zllm module by a zllm module."""
    paths = sorted(SOURCE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return [(module_name(path), imported) for path in paths for imported in imported_modules(path) & modules]


@pytest.mark.parametrize(
    ("file", "statement", "expected"),
    [
        ("enginecore/scheduler.py", "from .request import Request", "zllm.enginecore.request"),
        ("enginecore/scheduler.py", "from . import request", "zllm.enginecore"),
        ("enginecore/scheduler.py", "from ..workers.runner import run", "zllm.workers.runner"),
        ("enginecore/__init__.py", "from .core import EngineCore", "zllm.enginecore.core"),
        ("enginecore/__init__.py", "from ..ipc import codec", "zllm.ipc"),
        ("config.py", "from .ipc.codec import Codec", "zllm.ipc.codec"),
        ("config.py", "from zllm.ipc import codec", "zllm.ipc"),
    ],
)
def test_relative_imports_resolve_to_absolute_names(file, statement, expected, tmp_path, monkeypatch):
    (node,) = ast.parse(statement).body
    assert absolute_name(node, package_name(SOURCE / file)) == expected
    # The rules see them too: the same statement in a file of a zllm tree elsewhere.
    monkeypatch.setitem(globals(), "SOURCE", tmp_path / "zllm")
    path = tmp_path / "zllm" / file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(statement + "\n")
    assert expected in imported_modules(path)


def test_processes_import_neither_each_other_nor_the_launcher():
    wrong = [
        (importer, imported)
        for importer, imported in zllm_edges()
        if package_of(importer) in PROCESSES and package_of(imported) not in ("shared", package_of(importer))
    ]
    assert not wrong, f"a process package imports another process or zllm/launch: {wrong}"


def test_only_the_launcher_imports_the_openai_api():
    wrong = [
        (importer, imported)
        for importer, imported in zllm_edges()
        if within(imported, OPENAI_API) and not (within(importer, LAUNCH) or within(importer, OPENAI_API))
    ]
    assert not wrong, f"only zllm/launch imports zllm/frontend/openai: {wrong}"


def test_shared_modules_import_no_process_and_not_the_launcher():
    wrong = [
        (importer, imported)
        for importer, imported in zllm_edges()
        if package_of(importer) == "shared"
        and importer != "zllm"  # the package root names LLM lazily
        and package_of(imported) != "shared"
    ]
    assert not wrong, f"a shared module imports a process package or zllm/launch: {wrong}"


def test_the_client_needs_only_ipc_outputs_and_sampling_params():
    wrong = [
        imported
        for importer, imported in zllm_edges()
        if importer == "zllm.client" and not imported.startswith(CLIENT_MAY_IMPORT)
    ]
    assert not wrong, wrong


def test_only_ipc_knows_the_wire_format():
    wrong = [
        module_name(path)
        for path in SOURCE.rglob("*.py")
        if not module_name(path).startswith("zllm.ipc") and {"msgspec.msgpack", "pickle"} & imported_modules(path)
    ]
    assert not wrong, f"msgpack or pickle outside zllm/ipc: {wrong}"


@pytest.mark.parametrize(
    ("entry_modules", "must_not_load"),
    [
        # The engine core starts without torch (xgrammar, which needs it, comes with the first
        # structured-output request) and without any worker code.
        (
            ["zllm.enginecore.core", "zllm.enginecore.process"],
            ["torch", "zllm.workers", "zllm.frontend", "zllm.launch"],
        ),
        (
            ["zllm.frontend.server", "zllm.frontend.openai.api_server", "zllm.frontend.llm_engine"],
            ["zllm.workers", "zllm.enginecore", "zllm.launch"],
        ),
        # The offline LLM assembles its engine core and workers when it is built, not when named.
        (["zllm.launch.llm"], ["zllm.workers", "zllm.enginecore"]),
        (["zllm.workers.process"], ["zllm.frontend", "zllm.enginecore", "zllm.launch"]),
        (
            ["zllm.config", "zllm.procs.children", "zllm.model_spec"],
            ["torch", "transformers", "zllm.workers", "zllm.enginecore", "zllm.frontend", "zllm.launch"],
        ),
    ],
)
def test_importing_a_process_loads_only_its_own_layer(entry_modules, must_not_load):
    code = textwrap.dedent(f"""
        import importlib, sys
        for name in {entry_modules!r}:
            importlib.import_module(name)
        loaded = [m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in {must_not_load!r})]
        print(sorted(loaded))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing {entry_modules} loaded {done.stdout.strip()}"
