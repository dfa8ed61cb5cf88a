#!/usr/bin/env python3
# A run's scratch script, kept as it ran (a record, not part of the package; run it from a
# checkout of the commit its run notes name). Lint and formatting are off on purpose.
# ruff: noqa
# fmt: off
"""Swap-in over the local channel with the nodes' local_read_threads at 1 and 4, alternated,
a fresh 12-node cluster (fsync and scrub off) for each: python3 ab_threads.py [swapin args]."""
import json
import os
import subprocess
import sys
import tempfile

from deploy.local_cluster import LocalCluster

for threads in [1, 4, 1, 4]:
    with tempfile.TemporaryDirectory() as d:
        with LocalCluster.start(
            d, num_nodes=12, fsync=False, scrub_bytes_per_s=0, local_read_threads=threads
        ) as c:
            out = os.path.join(d, "swapin.json")
            cmd = [sys.executable, "-m", "kvstore.cli", "bench", "swapin", "--cluster",
                   str(c.cluster_toml), "--transport", "local", "--json", out, *sys.argv[1:]]
            subprocess.run(cmd, capture_output=True, check=True)
            r = json.load(open(out))["results"][0]
            print("AB", json.dumps({"local_read_threads": threads, "gb_per_s": round(r["gb_per_s"], 3),
                  "cache_gb_per_s": round(r["cache_gb_per_s"], 3), "p50_ms": round(r["p50_ms"], 1),
                  "client_cpu_s_per_gb": round(r["client_cpu_s_per_gb"], 3),
                  "load": os.getloadavg()[0], "args": sys.argv[1:]}), flush=True)
