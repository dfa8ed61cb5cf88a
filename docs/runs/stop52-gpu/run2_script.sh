#!/bin/bash
# Stop 52's GPU run, call 2: the checkout (fe9e1a3: call 1's tree plus less work before a
# fetch's first request) against the landed code (fd7f5f0, .whl/landed) again, alternating
# twice; gRPC beside local on the checkout (issue 37's ratio); the engine at 4k and 16k in bf16
# and with e4m3x16 blocks (issue 35's GPU row).
set -u
source docs/runs/wave6-gpu/run_setup.sh
build_tree .whl/landed || exit 1
S="swapin --device cuda --transport local --model random:1b --num-blocks 256 --no-fsync --rounds 3 --kv-format dtype,e4m3x16"
for round in 1 2; do
    echo "== swap-in, round $round, new (checkout)"
    timeout 60 python3 -m kvstore.cli bench $S --json $OUT/swapin_new_r$round.json | grep -E "^│ +local"
    echo "== swap-in, round $round, landed"
    (cd .whl/landed && PYTHONPATH=$PWD:/tmp/site timeout 60 python3 -m kvstore.cli bench $S --json $OUT/swapin_landed_r$round.json | grep -E "^│ +local")
done
echo "== swap-in over gRPC and local, new"
timeout 90 python3 -m kvstore.cli bench swapin --device cuda --transport grpc,local --model random:1b --num-blocks 256 --no-fsync --rounds 3 --json $OUT/swapin_grpc_local.json | grep -E "^│ +(grpc|local)"
E="engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.9 --repeats 3"
echo "== engine, bf16, new"
timeout 80 python3 -m kvstore.cli bench $E --json $OUT/engine_dtype.json | grep -E "^│"
echo "== engine, e4m3x16, new"
timeout 80 python3 -m kvstore.cli bench $E --kv-format e4m3x16 --json $OUT/engine_e4m3x16.json | grep -E "^│"
uptime
