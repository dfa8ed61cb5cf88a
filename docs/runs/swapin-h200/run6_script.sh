#!/bin/bash
# H200 run 6: the cost policy after run 5 showed it feeding back into ever larger fronts
# (the model now learns fetch speed only from fetches that ran alone and compute speed only
# from the compute after the fetch): the engine at 4k/16k and the long-context model.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
for lib in erasure/_fastsum.so kvstore/wire/_landing.so; do
    src=$(dirname $lib)/$(basename $lib .so | sed 's/^_//').c
    gcc -O3 -march=native -pthread -I.whl/include -shared -fPIC -Wall -Werror -o $lib $src || exit 1
done
nproc; uptime
B="python3 -m kvstore.cli bench"
timeout 150 $B engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.9 --repeats 5 --json $OUT/engine_1b.json
timeout 120 $B engine --model random:1b-long --device cuda --prompt-lengths 32768,65536 --cached-fractions 0,0.9 --repeats 3 --json $OUT/engine_long.json
uptime
