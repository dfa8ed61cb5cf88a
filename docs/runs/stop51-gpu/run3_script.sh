#!/bin/bash
# Stop 51's GPU run, call 3: where a fetch of misses goes (a 0%-cached prompt pays one), on
# this stop's code (.whl/new): misses and hits of 64 and 256 blocks of random:1b through the
# engine's connector (miss_probe.py: each case's median fetch's read stages; a cProfile of the
# 256-block misses), then the local swap-in (bf16) with the GIL's switch interval at its
# default (5 ms) and at 0.5 ms (every process: .whl/sw/sitecustomize.py), alternating.
set -u
source docs/runs/wave6-gpu/run_setup.sh
build_tree .whl/new || exit 1
PROBE=$PWD/docs/runs/stop51-gpu/miss_probe.py
SW=$PWD/.whl/sw
cd .whl/new && export PYTHONPATH=$PWD:/tmp/site
P="--device cuda --model random:1b --dtype bfloat16 --fetches 10"
echo "== misses and hits, 64 blocks"
timeout 90 python3 $PROBE $P --num-blocks 64 2>&1 | grep -E "^(miss|hit)|stages"
echo "== misses and hits, 256 blocks, profiled"
timeout 120 python3 $PROBE $P --num-blocks 256 --profile > $OUT/miss_probe_256.txt 2>&1
grep -E "^(miss|hit)|stages" $OUT/miss_probe_256.txt
echo "== misses and hits, 256 blocks, switch interval 0.5 ms"
AB_SWITCH_INTERVAL_S=0.0005 PYTHONPATH=$PWD:$SW:/tmp/site timeout 90 python3 $PROBE $P --num-blocks 256 2>&1 | grep -E "^(miss|hit)|stages"
S="swapin --device cuda --transport local --model random:1b --num-blocks 256 --no-fsync --rounds 3"
for round in 1 2; do
    echo "== swap-in, round $round, default switch interval"
    timeout 60 python3 -m kvstore.cli bench $S --json $OUT/swapin_sw_default_$round.json | grep -E "^│ +local"
    echo "== swap-in, round $round, switch interval 0.5 ms"
    AB_SWITCH_INTERVAL_S=0.0005 PYTHONPATH=$PWD:$SW:/tmp/site timeout 60 python3 -m kvstore.cli bench $S --json $OUT/swapin_sw_05ms_$round.json | grep -E "^│ +local"
done
uptime
