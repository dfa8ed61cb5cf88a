"""The project files one put and one cached prefill cross in the calling process
(docs/architecture.md, "The walk of a put" and "The walk of a cached prefill").

    PYTHONPATH=. python -m bench.walk_files [--json PATH]

Starts a local 12-node cluster, sets a profiler on every thread before anything else runs,
and records the project files whose functions are called between the start and the end of
``KVClient.put`` (1 MB) and of a cached ``Engine.prefill`` (203 tokens, 12 blocks of 16 cached,
seeded ``random:small`` on CPU). Background work of the process in that window counts too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = str(Path(__file__).resolve().parent.parent) + "/"
SELF = str(Path(__file__).resolve())  # the recorder's own calls are no part of a walk
PROMPT = [(i * 37 + 11) % 1000 for i in range(203)]  # 12 full blocks of 16 and a tail


class FileRecorder:
    """Project files whose functions are called while :attr:`active`, on every thread."""

    def __init__(self) -> None:
        self.active = False
        self.files: set[str] = set()
        threading.setprofile(self._profile)  # threads started from now on
        sys.setprofile(self._profile)

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if self.active and event == "call" and name.startswith(ROOT) and name != SELF:
            self.files.add(name[len(ROOT) :])

    def start(self) -> None:
        self.files, self.active = set(), True

    def stop(self) -> list[str]:
        self.active = False
        return sorted(self.files)


async def walks(root: Path, recorder: FileRecorder) -> dict[str, Any]:
    """The files of one put and of one cached prefill, on a fresh local cluster in ``root``."""
    from client import KVClient
    from deploy.local_cluster import LocalCluster
    from engine_adapter.config import EngineConfig
    from engine_adapter.engine import Engine
    from engine_adapter.loader import load_model

    with LocalCluster.start(root, fsync=False) as cluster:
        async with KVClient.connect(cluster.cluster_toml, "walk") as kv:
            await kv.put("warm-up", b"x" * 100_000)  # connections up before the walk
            recorder.start()
            await kv.put("walk", b"y" * 1_000_000)
            put = recorder.stop()
        # "always" and a long deadline: the walk is the fetch's, whatever the load.
        config = EngineConfig(block_tokens=16, prefill_chunk_tokens=16, max_model_len=1024)
        config = replace(config, fetch_policy="always", fetch_min_deadline_s=2, fetch_deadline_s=5)
        engine = Engine(load_model("random:small", "cpu", "float32", seed=0), config)
        engine.open_store(cluster.cluster_toml)
        for _ in range(2):  # the first stores the blocks, the second warms every path
            result = await engine.prefill(PROMPT, tenant="walk")
            engine.release(result.sequence)
            await engine.flush()
        recorder.start()
        result = await engine.prefill(PROMPT, tenant="walk")
        prefill = recorder.stop()
        engine.release(result.sequence)
        await engine.close()
    return {
        "put": {"num_files": len(put), "files": put},
        "cached_prefill": {
            "num_files": len(prefill),
            "files": prefill,
            "num_cached_tokens": result.num_cached_tokens,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the lists here")
    args = parser.parse_args()
    recorder = FileRecorder()
    with tempfile.TemporaryDirectory() as directory:
        report = asyncio.run(walks(Path(directory), recorder))
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
