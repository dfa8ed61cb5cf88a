#!/bin/bash
# Stop 51's GPU run, call 2 (the machine of call 1, warm): this stop's change (.whl/new) in
# the engine at 4k and 16k with bf16 and e4m3x16 blocks, against transformers' cold prefill
# in the same run; then swap-in over gRPC beside local (issue 37: the remote path against
# local on one machine).
set -u
source docs/runs/wave6-gpu/run_setup.sh
build_tree .whl/new || exit 1
cd .whl/new && export PYTHONPATH=$PWD:/tmp/site
E="engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.9 --repeats 3"
echo "== engine, bf16"
timeout 170 python3 -m kvstore.cli bench $E --json $OUT/engine_dtype.json | grep -E "^│"
echo "== engine, e4m3x16"
timeout 150 python3 -m kvstore.cli bench $E --kv-format e4m3x16 --json $OUT/engine_e4m3x16.json | grep -E "^│"
echo "== swap-in, grpc and local"
timeout 150 python3 -m kvstore.cli bench swapin --device cuda --transport grpc,local --model random:1b --num-blocks 256 --no-fsync --rounds 3 --json $OUT/swapin_grpc_local.json | grep -E "^│ +(grpc|local)"
uptime
