#!/bin/bash
# H200 run 2 of the landing work: after the batch block verification and the leaner node loop.
# Swap-in (default auto; the 1B layout with the default chunking and with 64-block chunks,
# 256 in flight), the engine at 4k/16k over five cached fractions, the long-context model.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
for lib in erasure/_fastsum.so kvstore/wire/_landing.so; do
    src=$(dirname $lib)/$(basename $lib .so | sed 's/^_//').c
    gcc -O3 -march=native -pthread -I.whl/include -shared -fPIC -Wall -Werror -o $lib $src || exit 1
done
python3 -c "from erasure import fastsum; from kvstore.wire import landing; print('native', fastsum.NATIVE, landing.NATIVE)"
nproc; uptime
B="python3 -m kvstore.cli bench"
timeout 120 $B swapin --device cuda --no-fsync --rounds 5 --json $OUT/swapin_default.json; uptime
timeout 150 $B swapin --device cuda --model random:1b --num-blocks 256 --no-fsync --rounds 5 --json $OUT/swapin_1b.json; uptime
timeout 150 $B swapin --device cuda --model random:1b --num-blocks 256 --chunk-blocks 64 --concurrency 256 --no-fsync --rounds 5 --json $OUT/swapin_1b_c64.json; uptime
timeout 300 $B engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.5,0.9,1.0 --repeats 5 --json $OUT/engine_1b.json; uptime
timeout 240 $B engine --model random:1b-long --device cuda --prompt-lengths 32768,65536 --cached-fractions 0,0.9 --repeats 3 --json $OUT/engine_long.json; uptime
