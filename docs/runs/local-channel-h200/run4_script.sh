#!/bin/bash
# H200 run 4 of the local-channel work: final code (connector 32-block chunks, 128 in flight): swap-in per
# transport, the engine over local and ucx.
cd "$(dirname "$0")/../code"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 ../whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/../../site:/tmp/site2 PYTHONUNBUFFERED=1
gcc -O3 -march=native -I../include -shared -fPIC -Wall -Werror -o erasure/_fastsum.so erasure/fastsum.c && echo "built erasure/_fastsum.so"
echo "code at $(cat ../HEAD)"; uptime
B="python3 -m kvstore.cli bench"
timeout 60 $B swapin --device cuda --transport grpc,ucx,local --no-fsync --rounds 5 --json $OUT/swapin.json; uptime
E="--model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.9 --repeats 3"
timeout 70 $B engine $E --store-transport local --json $OUT/engine_local.json; uptime
timeout 70 $B engine $E --store-transport ucx --json $OUT/engine_ucx.json; uptime
