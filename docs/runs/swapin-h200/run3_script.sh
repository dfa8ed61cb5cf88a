#!/bin/bash
# H200 run 3 of the landing work: where the client's GIL goes (py-spy --gil over a 1B-layout
# swap-in), and the swap-in's chunking: 16/32/64-block chunks for the default 64-block fetch,
# 64-block chunks with everything in flight for 256 blocks of the 1B layout.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
for lib in erasure/_fastsum.so kvstore/wire/_landing.so; do
    src=$(dirname $lib)/$(basename $lib .so | sed 's/^_//').c
    gcc -O3 -march=native -pthread -I.whl/include -shared -fPIC -Wall -Werror -o $lib $src || exit 1
done
nproc; uptime
B="python3 -m kvstore.cli bench"
S="swapin --device cuda --no-fsync --rounds 5"
for c in 16 32 64; do
    timeout 100 $B $S --chunk-blocks $c --concurrency 128 --json $OUT/swapin_c$c.json | grep -E "auto|limits"
done
timeout 150 $B $S --model random:1b --num-blocks 256 --chunk-blocks 64 --concurrency 256 --json $OUT/swapin_1b_c64.json | grep -E "auto|limits"
timeout 150 py-spy record --gil --threads -r 250 -f raw -o $OUT/gil_1b.txt -- \
    python3 -m kvstore.cli bench $S --model random:1b --num-blocks 256 --chunk-blocks 64 --concurrency 256 --rounds 20 | grep -E "auto|limits"
uptime
