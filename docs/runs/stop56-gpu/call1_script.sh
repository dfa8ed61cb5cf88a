#!/bin/bash
# Stop 56's GPU run: swap-in over the stream and the local channel with shard checks left to
# the block check (the checkout) against 0e01f90 (.whl/base: every landed payload's shard
# checksum checked by the client too), alternating; then the engine over the stream at 16k.
set -u
source docs/runs/wave6-gpu/run_setup.sh
build_tree .whl/base || exit 1
S="swapin --device cuda --model random:1b --num-blocks 256 --no-fsync --rounds 3 --transport stream,local"
for round in 1 2; do
    echo "== swap-in round $round: checkout"
    timeout 150 python3 -m kvstore.cli bench $S --json $OUT/swapin_new_$round.json 2>/dev/null | grep -E "^│ +(stream|local) "
    echo "== swap-in round $round: 0e01f90"
    (cd .whl/base && PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m kvstore.cli bench $S --json $OUT/swapin_base_$round.json 2>/dev/null | grep -E "^│ +(stream|local) ")
done
echo "== engine over the stream, 16k, checkout"
timeout 150 python3 -m kvstore.cli bench engine --model random:1b --device cuda --prompt-lengths 16384 --cached-fractions 0,0.1,0.5,0.9 --repeats 3 --store-transport stream --json $OUT/engine_stream.json > /dev/null 2>&1
python3 docs/runs/stop55-gpu/summarize.py $OUT/engine_stream.json
nvidia-smi --query-gpu=name --format=csv,noheader; uptime
