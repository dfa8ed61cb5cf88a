#!/usr/bin/env python3
# A run's scratch script, kept as it ran (a record, not part of the package; run it from a
# checkout of the commit its run notes name). Lint and formatting are off on purpose.
# ruff: noqa
# fmt: off
"""Batch-read throughput of one client over a local 12-node cluster, per transport.

SECS=4 python3 prof_cl.py TRANSPORT:BATCH:CONCURRENCY ...   (PROF=1: cProfile of the loop thread;
SWITCH=S: sys.setswitchinterval(S) first). Prints one RESULT json line per spec, with the
client's CPU split by thread kind (from /proc/self/task) and the nodes' CPU per GB.
"""
import asyncio, random, tempfile, time, sys, os, json, threading, collections
import numpy as np
from client import KVClient, block_keys
from deploy.local_cluster import LocalCluster
from bench.common import process_cpu_s
from erasure.allocator import tune_glibc_malloc
tune_glibc_malloc()
if os.environ.get("SWITCH"):
    sys.setswitchinterval(float(os.environ["SWITCH"]))
import logging; logging.basicConfig(level=logging.WARNING)
BLOCK = 4 << 20
TICK = os.sysconf("SC_CLK_TCK")

def thread_cpu() -> dict[str, float]:
    by_kind = collections.Counter()
    names = {t.native_id: t.name for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "native")
        kind = name.split("-")[0] if "-" in name else name
        kind = "loop" if name == "MainThread" else kind
        by_kind[kind] += (int(fields[11]) + int(fields[12])) / TICK
    return by_kind

async def run(c, transport, batch, conc, seconds):
    async with KVClient.connect(c.cluster_toml, tenant="b", transport=transport) as kv:
        keys = block_keys(list(range(64 * 4)), 4, "cl", "s")
        data = np.random.default_rng(0).bytes(BLOCK)
        await kv.put_batch(keys[:32], [data]*32, traffic_class="chat")
        await kv.put_batch(keys[32:], [data]*32, traffic_class="chat")
        bufs = [[bytearray(BLOCK) for _ in range(batch)] for _ in range(conc)]
        rng = random.Random(0)
        async def worker(i, stop):
            n = 0
            while time.perf_counter() < stop:
                ks = [rng.choice(keys) for _ in range(batch)]
                ok = await kv.get_batch_into(ks, bufs[i])
                if not all(ok):
                    print('MISS', ok, kv.counters(), flush=True); raise SystemExit(1)
                n += batch
            return n
        await asyncio.gather(*(worker(i, time.perf_counter() + 1) for i in range(conc)))
        pids = [p.pid for p in c.procs.values()]
        c0 = time.process_time(); s0 = sum(process_cpu_s(p) for p in pids); t0 = time.perf_counter()
        th0 = thread_cpu()
        import cProfile, pstats
        pr = cProfile.Profile() if os.environ.get("PROF") else None
        if pr: pr.enable()
        ns = await asyncio.gather(*(worker(i, time.perf_counter() + seconds) for i in range(conc)))
        if pr:
            pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        el = time.perf_counter() - t0
        th1 = thread_cpu()
        gb = sum(ns) * BLOCK / 1e9
        split = {k: round((th1[k] - th0.get(k, 0)) / gb, 3) for k in th1 if th1[k] - th0.get(k, 0) > 0}
        local = kv.local.counters.__dict__ if kv.local else None
        print("RESULT", json.dumps(dict(transport=transport, batch=batch, conc=conc, gbps=round(gb/el, 3), client_s_per_gb=round((time.process_time()-c0)/gb, 3), client_threads_s_per_gb=split, nodes_s_per_gb=round((sum(process_cpu_s(p) for p in pids)-s0)/gb, 3), switch_s=sys.getswitchinterval(), load=os.getloadavg()[0], local=local)), flush=True)

with tempfile.TemporaryDirectory() as d:
    with LocalCluster.start(d, num_nodes=12, fsync=False, scrub_bytes_per_s=0) as c:
        for spec in sys.argv[1:]:
            t, b, n = spec.split(":")
            asyncio.run(run(c, t, int(b), int(n), float(os.environ.get("SECS", 4))))
