"""The engines' pins, for `make test-integrations` (run.sh): kvstore installs *with* its
dependencies beside an engine only if its ranges meet the engine's pins.

    python engine_pins.py constraints vllm lmcache > pins.txt   # the engines' pins as a pip
                                                                  # constraints file
    python engine_pins.py check                                  # pip check, for kvstore's own
                                                                  # requirements

``constraints`` turns each installed engine's requirements (its ``Requires-Dist`` without
extras, markers evaluated here) into constraint lines: pip then installs kvstore's
dependencies only at versions the engine accepts, or fails to resolve (a range of ours that
misses an engine's pin). The CUDA stack, which the engines come without on a CPU machine
(``--no-deps``), and torch (pinned by run.sh) are left out. ``check`` runs ``pip check`` and
fails on any line about kvstore or a package kvstore requires; lines about the engines'
own requirements that are not installed (their CUDA stack) are printed, not failed.
Run with the venv's python; standard library and pip's vendored ``packaging`` only.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import distribution, requires

from pip._vendor.packaging.requirements import Requirement

PROJECT = "kvstore"
# Not constrained: installed by run.sh itself (torch) or never on a CPU machine (CUDA).
SKIPPED = re.compile(
    r"^(torch|torchvision|torchaudio|torchcodec|triton|xformers|flashinfer.*|cupy.*|cuda-.*|"
    r"nvidia-.*|pynvvideocodec|nvtx|cufile-python|tilelang|quack-kernels|tokenspeed-mla|"
    r"humming-kernels|fastsafetensors|instanttensor|sgl-kernel|flash-attn.*|deep-gemm|"
    r"sglang-router|mooncake.*|ray)$"
)


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def constraints(dists: list[str]) -> list[str]:
    """Constraint lines (``name<spec>``) from the installed ``dists``' requirements."""
    lines = []
    for dist in dists:
        for text in requires(dist) or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if SKIPPED.match(_normal(req.name)) or not str(req.specifier):
                continue
            lines.append(f"{_normal(req.name)}{req.specifier}  # {dist}")
    return lines


def project_requirements() -> set[str]:
    """kvstore and every package its metadata requires (any extra): a pip-check line that
    names one of these is a conflict of ours."""
    names = {PROJECT}
    for text in distribution(PROJECT).requires or []:
        names.add(_normal(Requirement(text).name))
    return names


def check() -> int:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False
    )
    ours = project_requirements()
    failed = False
    for line in result.stdout.splitlines():
        words = {_normal(w.strip(",.")) for w in re.split(r"[\s,]+", line) if w}
        missing = line.endswith("which is not installed.")
        if words & ours and not (missing and _normal(line.split()[0]) != PROJECT):
            print(f"pip check: CONFLICT: {line}")
            failed = True
        else:
            print(f"pip check: (engine, not ours) {line}")
    print(f"pip check: {'FAILED' if failed else 'clean'} for kvstore's own requirements")
    return 1 if failed else 0


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "constraints":
        print("\n".join(constraints(args)))
    elif command == "check":
        sys.exit(check())
    else:
        sys.exit(f"unknown command {command!r}: constraints DIST... | check")
