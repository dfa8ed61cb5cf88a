#!/bin/bash
# H200 run 1 of the landing work: swap-in (default auto, then grpc vs local, then the 1B
# layout), the engine at 4k/16k over five cached fractions, and the long-context model.
# Runs from the repository root on the device machine; wheels come from .whl (see
# docs/runs/batch-plane-h200/README.md), xxhash.h from .whl/include.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
for lib in erasure/_fastsum.so kvstore/wire/_landing.so; do
    src=$(dirname $lib)/$(basename $lib .so | sed 's/^_//').c
    gcc -O3 -march=native -I.whl/include -shared -fPIC -Wall -Werror -o $lib $src || exit 1
done
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
python3 -c "from erasure import fastsum; from kvstore.wire import landing; print('native', fastsum.NATIVE, landing.NATIVE)"
git log -1 --format='code at %h %s' 2>/dev/null; nproc; uptime
python3 - <<'PY'
# H2D from a registered memfd (what the landing pool is) vs torch's own pinned memory.
import time, torch
from client.landing_pool import LandingPool
n = 512 << 20
pool = LandingPool(n, 1)
assert int(torch.cuda.cudart().cudaHostRegister(pool.address, pool.num_bytes, 0)) == 0
host = torch.frombuffer(pool.memory, dtype=torch.uint8)[:n]
pinned = torch.empty(n, dtype=torch.uint8).pin_memory()
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
for name, src in (("registered memfd", host), ("torch pinned", pinned)):
    print(name, "is_pinned", src.is_pinned())
    best = 1e9
    for _ in range(5):
        t = time.perf_counter(); dev.copy_(src, non_blocking=True); torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    print(f"H2D from {name}: {n / best / 1e9:.1f} GB/s")
PY
B="python3 -m kvstore.cli bench"
timeout 150 $B swapin --device cuda --no-fsync --rounds 5 --json $OUT/swapin_default.json; uptime
timeout 200 $B swapin --device cuda --transport grpc,local --no-fsync --rounds 5 --json $OUT/swapin_grpc_local.json; uptime
timeout 150 $B swapin --device cuda --model random:1b --num-blocks 256 --no-fsync --rounds 5 --json $OUT/swapin_1b.json; uptime
timeout 300 $B engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.5,0.9,1.0 --repeats 5 --json $OUT/engine_1b.json; uptime
timeout 240 $B engine --model random:1b-long --device cuda --prompt-lengths 32768,65536 --cached-fractions 0,0.9 --repeats 3 --json $OUT/engine_long.json; uptime
