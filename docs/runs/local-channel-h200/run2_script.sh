#!/bin/bash
# H200 run 2 of the local-channel work: swap-in per transport, native vs fallback,
# the engine over local and ucx, raw batch-read throughput, and profiles.
cd "$(dirname "$0")/../code"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 ../whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/../../site:/tmp/site2 PYTHONUNBUFFERED=1
S=../scripts
gcc -O3 -march=native -I../include -shared -fPIC -Wall -Werror -o erasure/_fastsum.so erasure/fastsum.c && echo "built erasure/_fastsum.so"
python3 -c "from erasure import fastsum; print('native', fastsum.NATIVE)"
echo "code at $(cat ../HEAD)"; nproc; uptime
B="python3 -m kvstore.cli bench"
timeout 90 $B swapin --device cuda --transport grpc,ucx,local --no-fsync --rounds 5 --json $OUT/swapin.json; uptime
KVSTORE_NATIVE=0 timeout 60 $B swapin --device cuda --transport ucx,local --no-fsync --rounds 5 --json $OUT/swapin_no_native.json; uptime
timeout 40 $B swapin --device cuda --transport local --no-fsync --rounds 5 --chunk-blocks 64 --json $OUT/swapin_variants.json | grep -E "local"; uptime
timeout 40 $B swapin --device cuda --transport local --no-fsync --rounds 5 --dtype float32 | grep -E "local"; uptime
E="--model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.9 --repeats 3"
timeout 100 $B engine $E --store-transport local --json $OUT/engine_local.json; uptime
timeout 100 $B engine $E --store-transport ucx --json $OUT/engine_ucx.json; uptime
SECS=3 timeout 90 python3 $S/prof_cl.py local:16:8 ucx:16:8 grpc:16:8 local:32:4 > $OUT/prof.txt 2>&1; uptime
SECS=3 PROF=1 timeout 40 python3 $S/prof_cl.py local:16:8 >> $OUT/prof.txt 2>&1
timeout 60 python3 -m cProfile -s tottime -m kvstore.cli bench swapin --device cuda --transport local --no-fsync --rounds 10 2>&1 | head -70 > $OUT/swapin_profile.txt
uptime; grep RESULT $OUT/prof.txt | cut -c1-330
