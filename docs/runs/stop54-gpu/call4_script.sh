#!/bin/bash
# Stop 54's GPU run, call 4: the final code (36ca8e6), the issue's swap-in command twice.
set -u
source docs/runs/wave6-gpu/run_setup.sh
python3 -m pytest -q -p no:cacheprovider tests/kvstore/test_stream_reads.py tests/client/test_local_link.py tests/client/test_landing.py tests/erasure/test_fastsum.py 2>&1 | tail -1
S="swapin --device cuda --model random:1b --num-blocks 256 --no-fsync --rounds 3"
for round in 1 2; do
    echo "== swap-in: gRPC, stream, local; round $round"
    timeout 150 python3 -m kvstore.cli bench $S --transport grpc,stream,local --json $OUT/swapin_final_$round.json | grep -E "^│ +(grpc|stream|local) |^limits"
done
uptime
