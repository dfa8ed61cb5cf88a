#!/bin/bash
# H200 run 3 of the local-channel work: the node's local_read_threads 1 vs 4 (alternated, fresh clusters),
# the connector's chunk size and blocks in flight, the engine over local with 4 threads.
cd "$(dirname "$0")/../code"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 ../whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/../../site:/tmp/site2 PYTHONUNBUFFERED=1
gcc -O3 -march=native -I../include -shared -fPIC -Wall -Werror -o erasure/_fastsum.so erasure/fastsum.c && echo "built erasure/_fastsum.so"
echo "code at $(cat ../HEAD)"; uptime
B="python3 -m kvstore.cli bench"
timeout 100 python3 ../scripts/ab_threads.py --device cuda --no-fsync --rounds 5; uptime
for cc in "16 64" "32 128" "64 128" "16 128" "32 256"; do set -- $cc
  timeout 30 $B swapin --device cuda --transport local --no-fsync --rounds 5 --chunk-blocks $1 --concurrency $2 --json $OUT/swapin_c$1_f$2.json | grep "│     local" | sed "s/^/chunk $1 concurrency $2 /"
done; uptime
E="--model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.9 --repeats 3"
timeout 100 $B engine $E --store-transport local --json $OUT/engine_local.json; uptime
