#!/bin/bash
# H200 run 4 of the landing work: the GPU tests, then swap-in (default; grpc vs local; the 1B
# layout), the engine at 4k/16k over five cached fractions, and the long-context model.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
for lib in erasure/_fastsum.so kvstore/wire/_landing.so; do
    src=$(dirname $lib)/$(basename $lib .so | sed 's/^_//').c
    gcc -O3 -march=native -pthread -I.whl/include -shared -fPIC -Wall -Werror -o $lib $src || exit 1
done
nproc; uptime
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine_adapter/test_engine_cuda.py 2>&1 | tail -3
B="python3 -m kvstore.cli bench"
timeout 100 $B swapin --device cuda --no-fsync --rounds 5 --json $OUT/swapin_default.json | grep -E "auto|limits"
timeout 150 $B swapin --device cuda --transport grpc,local --model random:1b --num-blocks 256 --no-fsync --rounds 5 --json $OUT/swapin_1b_grpc_local.json | grep -E "grpc|local|limits"
timeout 300 $B engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.5,0.9,1.0 --repeats 5 --json $OUT/engine_1b.json
timeout 240 $B engine --model random:1b-long --device cuda --prompt-lengths 32768,65536 --cached-fractions 0,0.9 --repeats 3 --json $OUT/engine_long.json
uptime
