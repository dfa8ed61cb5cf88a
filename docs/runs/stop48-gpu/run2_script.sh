#!/bin/bash
# Stop 48's GPU run 2 (main at 83583e3): the engine bench with the fetch's contains probe,
# A/B in the same run against the connector just before it (514d745; the file is carried
# untracked for this run only), e4m3x16 at 16k, and the swap-in bench of both formats.
set -u
source docs/runs/wave6-gpu/run_setup.sh
B="python3 -m kvstore.cli bench engine --model random:1b --device cuda"
E="--prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.9 --repeats 5"
timeout 120 $B $E --json $OUT/engine_1b_dtype.json | grep -E "^│|limits"
cp engine_adapter/connector.py /tmp/connector_probe.py
cp docs/runs/stop48-gpu/connector_before_probe.py engine_adapter/connector.py
echo "--- the same, without the probe (514d745)"
timeout 120 $B $E --json $OUT/engine_1b_dtype_noprobe.json | grep -E "^│"
cp /tmp/connector_probe.py engine_adapter/connector.py
timeout 100 $B --kv-format e4m3x16 --prompt-lengths 16384 --cached-fractions 0,0.1,0.9 --repeats 3 --json $OUT/engine_1b_e4m3x16.json | grep -E "^│"
timeout 90 python3 -m kvstore.cli bench swapin --device cuda --transport local --model random:1b --num-blocks 256 --no-fsync --rounds 3 --kv-format dtype,e4m3x16 --json $OUT/swapin_1b.json | grep -E "^│|^e4m3|limits"
uptime
