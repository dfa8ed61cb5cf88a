#!/bin/bash
# Stop 54's GPU run, call 2 (the warm machine of call 1, cdd57e7): the three remote-capable
# transports side by side, e4m3x16 over the stream, and the engine over the stream.
set -u
source docs/runs/wave6-gpu/run_setup.sh
S="swapin --device cuda --model random:1b --num-blocks 256 --no-fsync --rounds 3"
ROWS="^│ +(grpc|stream|local) |^limits"
echo "== swap-in: gRPC, stream, local"
timeout 150 python3 -m kvstore.cli bench $S --transport grpc,stream,local --json $OUT/swapin_3.json | grep -E "$ROWS"
echo "== swap-in, e4m3x16 and bf16: stream, local"
timeout 150 python3 -m kvstore.cli bench $S --transport stream,local --kv-format dtype,e4m3x16 --json $OUT/swapin_e4m3.json | grep -E "$ROWS"
echo "== engine over the stream, 16k"
timeout 240 python3 -m kvstore.cli bench engine --model random:1b --device cuda --prompt-lengths 16384 --cached-fractions 0,0.1,0.5,0.9 --repeats 3 --store-transport stream --json $OUT/engine_stream.json 2>&1 | tail -12
uptime
