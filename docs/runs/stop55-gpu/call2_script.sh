#!/bin/bash
# Stop 55's GPU run, call 2: issue 36/37's swap-in command over gRPC, the stream and local,
# the checkout against ffd61af (.whl/base: every index refresh written, as before the refresh
# granularity), then the engine over the stream at 16k.
set -u
source docs/runs/wave6-gpu/run_setup.sh
build_tree .whl/base || exit 1
S="swapin --device cuda --model random:1b --num-blocks 256 --no-fsync --rounds 3"
ROWS="^│ +(grpc|stream|local) |^limits"
for round in 1 2; do
    echo "== swap-in, checkout: gRPC, stream, local; round $round"
    timeout 150 python3 -m kvstore.cli bench $S --transport grpc,stream,local --json $OUT/swapin_$round.json | grep -E "$ROWS"
    echo "== swap-in, ffd61af: stream, local; round $round"
    (cd .whl/base && PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m kvstore.cli bench $S --transport stream,local --json $OUT/swapin_base_$round.json | grep -E "$ROWS")
done
echo "== engine over the stream, 16k, checkout"
timeout 200 python3 -m kvstore.cli bench engine --model random:1b --device cuda --prompt-lengths 16384 --cached-fractions 0,0.1,0.5,0.9 --repeats 3 --store-transport stream --json $OUT/engine_stream.json > /dev/null 2>&1
python3 docs/runs/stop55-gpu/summarize.py $OUT/engine_stream.json
uptime
