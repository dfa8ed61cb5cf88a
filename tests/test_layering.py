"""The package layers stay as the design card draws them, with no import loops between packages.

::

    bench                           (top: may import everything below)
    engine_adapter                  the engine, its store connector, serving
    deploy                          local clusters and multi-host maps
    client                          the cluster client
    kvstore                         the node, on-disk format, config, placement, CLI
    erasure   ttl                   (bottom: import nothing of the project)

A package imports only packages of lower layers. Every ``import`` statement counts, also
those inside functions, and so does ``importlib.import_module("pkg...")``. ``kvstore/cli.py``
names the modules of every command as strings for ``importlib`` (it is the program's
composition root): those are not imports. A failure names the file and line of the offending import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYER_OF = {
    "erasure": 0,
    "ttl": 0,
    "kvstore": 1,
    "client": 2,
    "deploy": 3,
    "engine_adapter": 4,
    "bench": 5,
}


COMPOSITION_ROOT = Path("kvstore/cli.py")


def _imports(path: Path) -> list[tuple[str, int]]:
    """(top-level project package, line) of every import in ``path``, ``importlib`` calls with
    a literal module name included (only the command table may name any module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif _is_import_module_call(node) and path.relative_to(ROOT) != COMPOSITION_ROOT:
            names = [node.args[0].value]  # type: ignore[attr-defined]
        else:
            continue
        found += [(name.split(".")[0], node.lineno) for name in names]
    return [(package, line) for package, line in found if package in LAYER_OF]


def _is_import_module_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def _package_edges() -> dict[tuple[str, str], str]:
    """(importer, imported) package -> one place where it happens."""
    edges: dict[tuple[str, str], str] = {}
    for package in LAYER_OF:
        for path in sorted((ROOT / package).rglob("*.py")):
            for imported, line in _imports(path):
                if imported != package:
                    edges.setdefault((package, imported), f"{path.relative_to(ROOT)}:{line}")
    return edges


def test_lower_layers_never_import_higher_ones() -> None:
    wrong = [
        f"{importer} -> {imported} ({where})"
        for (importer, imported), where in _package_edges().items()
        if LAYER_OF[imported] >= LAYER_OF[importer]
    ]
    assert not wrong, "imports against the layering (see this module's docstring):\n" + "\n".join(
        wrong
    )


def test_no_import_loop_between_packages() -> None:
    edges = _package_edges()
    graph: dict[str, set[str]] = {p: set() for p in LAYER_OF}
    for importer, imported in edges:
        graph[importer].add(imported)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start]
        )

    loops = [p for p in graph if reaches(p, p, set())]
    assert not loops, f"packages in an import loop: {loops}; edges: {sorted(edges)}"


@pytest.mark.parametrize(
    ("modules", "forbidden"),
    [
        ("erasure.shard, erasure.codec, erasure.config, erasure.errors", "grpc"),
        ("ttl.policy, ttl.simulator, ttl.traces, ttl.sweep, ttl.units, ttl.errors", "grpc"),
        ("kvstore.node, kvstore.shard_store, client", "torch"),
    ],
)
def test_importing_a_layer_loads_nothing_heavier(modules: str, forbidden: str) -> None:
    """In a fresh interpreter: the bottom layers load no grpc, the store side no torch."""
    code = f"import sys, {modules}; print({forbidden!r} in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False", f"importing {modules} loads {forbidden}"
