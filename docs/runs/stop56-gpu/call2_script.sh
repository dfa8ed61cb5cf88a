#!/bin/bash
# Stop 56's GPU run, call 2: the final code's engine table (issue 36/43), the same with the
# cost model's fetch plan (compute the front while the rest is fetched, or compute it all),
# and issue 36/37's swap-in command, gRPC, stream and local in one run.
set -u
source docs/runs/wave6-gpu/run_setup.sh
echo "== engine table"
timeout 240 python3 -m kvstore.cli bench engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.5,0.9 --repeats 3 --json $OUT/engine_table.json > $OUT/engine_table.log 2>&1
python3 docs/runs/stop55-gpu/summarize.py $OUT/engine_table.json
echo "== engine table, --fetch-policy cost"
timeout 240 python3 -m kvstore.cli bench engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.5,0.9 --repeats 3 --fetch-policy cost --json $OUT/engine_cost.json > $OUT/engine_cost.log 2>&1
python3 docs/runs/stop55-gpu/summarize.py $OUT/engine_cost.json
echo "== swap-in: gRPC, stream, local"
timeout 150 python3 -m kvstore.cli bench swapin --device cuda --model random:1b --num-blocks 256 --no-fsync --rounds 3 --transport grpc,stream,local --json $OUT/swapin.json 2>/dev/null | grep -E "^│ +(grpc|stream|local) |^limits"
nvidia-smi --query-gpu=name --format=csv,noheader; uptime
