"""The package layers stay as the design card draws them, with no import loops between packages.

::

    bench                           (top: may import everything below)
    engine_adapter                  the engine, its store connector, serving
    deploy                          local clusters and multi-host maps
    client                          the cluster client
    kvstore                         the node, on-disk format, config, placement, CLI
    erasure   ttl                   (bottom: import nothing of the project)

Inside ``kvstore`` the rooms stack the same way::

    kvstore/cli/                    the command table (the composition root) and its shells
    kvstore/node/                   the node process: its faces, repair, map following, metrics
    kvstore/store/                  one node's synchronous shard store (no asyncio, no grpc)
    kvstore/wire/                   what crosses between client and node on the data plane
    kvstore/                        the floor: config, errors, placement, auth, TLS, membership

Modules that grew several concepts were split into parts that their old module composes
(``PARTS_OF``: ``client.kv_client`` is a façade over its reads, writes and key commands; the
vLLM connector over its scheduler and worker sides; ...). A part never imports its whole at
run time (an import under ``TYPE_CHECKING``, for annotations, is no dependency).

A package imports only packages of lower layers, and a room of ``kvstore`` only lower rooms. Every
``import`` statement counts, also those inside functions, and so does
``importlib.import_module("pkg...")``. ``kvstore/cli/commands.py`` names the modules of every
command as strings for ``importlib`` (it is the program's composition root): those are not imports.
A failure names the file and line of the offending import.
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


COMPOSITION_ROOT = Path("kvstore/cli/commands.py")
# A module split into parts (issue 40) -> the parts it composes (this module's docstring).
PARTS_OF = {
    "client.kv_client": ("client.block_reads", "client.block_writes", "client.key_ops"),
    "engine_adapter.integrations.vllm.connector": tuple(
        f"engine_adapter.integrations.vllm.{part}"
        for part in ("scheduler_side", "worker_side", "metadata", "slices", "stats", "events")
    ),
    "engine_adapter.serving.router": (
        "engine_adapter.serving.request_api",
        "engine_adapter.serving.router_workers",
    ),
    "engine_adapter.serving.serve": (
        "engine_adapter.serving.worker_pool",
        "engine_adapter.serving.front_config",
    ),
    "deploy.local_cluster": ("deploy.local_nodes", "deploy.local_secrets", "deploy.local_pids"),
    "kvstore.node.repair_service": ("kvstore.node.repair_listing", "kvstore.node.repair_rebuild"),
    "kvstore.config": ("kvstore.node_config",),
    "bench.swapin_bench": ("bench.swapin_report",),
}
ROOM_OF_KVSTORE = {"floor": 0, "wire": 1, "store": 2, "node": 3, "cli": 4}


def _imports(path: Path) -> list[tuple[str, int]]:
    """(top-level project package, line) of every import in ``path``, ``importlib`` calls with
    a literal module name included (only the command table may name any module)."""
    return [
        (name.split(".")[0], line)
        for name, line in _imported_modules(path)
        if name.split(".")[0] in LAYER_OF
    ]


def _imported_modules(path: Path) -> list[tuple[str, int]]:
    """(dotted module name, line) of every import in ``path``, as :func:`_imports` counts them."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif _is_import_module_call(node) and path.relative_to(ROOT) != COMPOSITION_ROOT:
            names = [node.args[0].value]  # type: ignore[attr-defined]
        else:
            continue
        found += [(name, node.lineno) for name in names]
    return found


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


def _room(module: str) -> str:
    """The room of a ``kvstore`` module (``kvstore.store.index`` -> ``store``; else the floor)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in ROOM_OF_KVSTORE else "floor"


def test_rooms_of_kvstore_import_only_lower_rooms() -> None:
    wrong = []
    for path in sorted((ROOT / "kvstore").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        importer = _room(module if path.name != "__init__.py" else module + ".x")
        for imported, line in _imported_modules(path):
            if imported.split(".")[0] != "kvstore" or imported in ("kvstore", "kvstore.proto"):
                continue
            room = _room(imported)
            if room != importer and ROOM_OF_KVSTORE[room] > ROOM_OF_KVSTORE[importer]:
                wrong.append(f"{importer} -> {room} ({path.relative_to(ROOT)}:{line})")
    assert not wrong, "imports against the rooms of kvstore (this module's docstring):\n" + (
        "\n".join(wrong)
    )


def test_the_store_runs_without_asyncio_or_grpc() -> None:
    """kvstore/store/ is synchronous: the node wraps it (StoreHolder, its executor)."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / "kvstore" / "store").rglob("*.py"))
        for name, line in _imported_modules(path)
        if name.split(".")[0] in ("asyncio", "grpc")
    ]
    assert not wrong, "the store room imports asyncio or grpc:\n" + "\n".join(wrong)


def test_importing_the_client_loads_no_store_or_node_module() -> None:
    """In a fresh interpreter: ``import client`` needs the floor and the wire, nothing more."""
    code = (
        "import sys, client; print(sorted(m for m in sys.modules"
        " if m.split('.')[:2] in (['kvstore', 'store'], ['kvstore', 'node'], ['kvstore', 'cli'])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", f"import client loads node-side modules: {out.strip()}"


def _path_of(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def _runtime_imports(path: Path) -> set[str]:
    """Modules ``path`` imports at run time: every import but those under ``if TYPE_CHECKING``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


@pytest.mark.parametrize("whole", sorted(PARTS_OF))
def test_a_split_module_composes_its_parts_and_no_part_imports_it_back(whole: str) -> None:
    imported = _runtime_imports(_path_of(whole))
    missing = [part for part in PARTS_OF[whole] if part not in imported]
    assert not missing, f"{whole} no longer imports its parts {missing}: update PARTS_OF"
    back = [part for part in PARTS_OF[whole] if whole in _runtime_imports(_path_of(part))]
    assert not back, f"parts {back} import {whole} at run time: a part sits below its whole"


@pytest.mark.parametrize(
    ("modules", "forbidden"),
    [
        ("erasure.shard, erasure.codec, erasure.config, erasure.errors", "grpc"),
        ("ttl.policy, ttl.simulator, ttl.traces, ttl.sweep, ttl.units, ttl.errors", "grpc"),
        ("ttl.partition, ttl.simloop", "grpc"),
        ("kvstore.node.main, kvstore.store.shard_store, client", "torch"),
        ("engine_adapter.integrations, engine_adapter.integrations.vllm", "vllm"),
    ],
)
def test_importing_a_layer_loads_nothing_heavier(modules: str, forbidden: str) -> None:
    """In a fresh interpreter: the bottom layers load no grpc, the store side no torch."""
    code = f"import sys, {modules}; print({forbidden!r} in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False", f"importing {modules} loads {forbidden}"
