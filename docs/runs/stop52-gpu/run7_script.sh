#!/bin/bash
# Stop 52's GPU run, call 7: the landed code (fd7f5f0, .whl/landed) and the final code in turn,
# local swap-in, twice each, on the machine of calls 5 and 6 when it is still held.
set -u
source docs/runs/wave6-gpu/run_setup.sh
build_tree .whl/landed || exit 1
S="swapin --device cuda --transport local --model random:1b --num-blocks 256 --no-fsync --rounds 3 --kv-format dtype,e4m3x16"
for round in 1 2; do
    echo "== swap-in, round $round, landed"
    (cd .whl/landed && PYTHONPATH=$PWD:/tmp/site timeout 60 python3 -m kvstore.cli bench $S --json $OUT/swapin_landed_$round.json | grep -E "^│ +local")
    echo "== swap-in, round $round, final"
    timeout 60 python3 -m kvstore.cli bench $S --json $OUT/swapin_final_$round.json | grep -E "^│ +local"
done
uptime
