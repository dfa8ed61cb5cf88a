#!/bin/bash
# Stop 52's GPU run, call 6: the final code's swap-in (ee2b4b4): local bf16 and e4m3x16, twice,
# then gRPC beside local.
set -u
source docs/runs/wave6-gpu/run_setup.sh
S="swapin --device cuda --model random:1b --num-blocks 256 --no-fsync --rounds 3"
for round in 1 2; do
    echo "== swap-in, round $round"
    timeout 60 python3 -m kvstore.cli bench $S --transport local --kv-format dtype,e4m3x16 --json $OUT/swapin_local_$round.json | grep -E "^│ +local"
done
echo "== swap-in over gRPC and local"
timeout 90 python3 -m kvstore.cli bench $S --transport grpc,local --json $OUT/swapin_grpc_local.json | grep -E "^│ +(grpc|local)"
uptime
