"""Every hand-written module holds one concept at a readable size (issue 40): no module over
600 lines, no function over 60. Generated code (the protobuf and gRPC stubs) is not counted.
A failure names each file or function over its limit."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def _modules() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / name for name in listed if not name.endswith(GENERATED_SUFFIXES)]


def test_no_module_is_over_600_lines() -> None:
    over = {
        str(path.relative_to(ROOT)): lines
        for path in _modules()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not over, f"modules over {MAX_MODULE_LINES} lines: split them along their seams: {over}"


def test_no_function_is_over_60_lines() -> None:
    over = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    over[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"
