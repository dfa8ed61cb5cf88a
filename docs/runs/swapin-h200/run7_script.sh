#!/bin/bash
# H200 run 7: main after every merge of the wave (the final code): the GPU tests, swap-in (grpc
# vs local, the 1B layout) and the engine at 4k/16k with the default policy (always).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
for lib in erasure/_fastsum.so kvstore/wire/_landing.so; do
    src=$(dirname $lib)/$(basename $lib .so | sed 's/^_//').c
    gcc -O3 -march=native -pthread -I.whl/include -shared -fPIC -Wall -Werror -o $lib $src || exit 1
done
nproc; uptime
timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine_adapter/test_engine_cuda.py 2>&1 | tail -3
B="python3 -m kvstore.cli bench"
timeout 110 $B swapin --device cuda --transport grpc,local --model random:1b --num-blocks 256 --no-fsync --rounds 5 --json $OUT/swapin_1b_grpc_local.json | grep -E "grpc|local|limits"
timeout 150 $B engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.9 --repeats 5 --json $OUT/engine_1b.json
uptime
