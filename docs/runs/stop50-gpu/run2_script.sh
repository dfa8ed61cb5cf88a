#!/bin/bash
# Run 1 cut to the device time left (about 400 s with the start): one A/B round of the local
# swap-in (bf16 and e4m3x16, this stop's code against 02d9013), then the engine at 16k, bf16.
set -u
source docs/runs/wave6-gpu/run_setup.sh
source docs/runs/stop50-gpu/build_old.sh
S="swapin --device cuda --transport local --model random:1b --num-blocks 256 --no-fsync --rounds 3 --kv-format dtype,e4m3x16"
echo "== swap-in, new"
timeout 80 python3 -m kvstore.cli bench $S --json $OUT/swapin_new.json | grep -E "^│ +local"
echo "== swap-in, old (02d9013)"
(cd .whl/old && PYTHONPATH=$PWD:/tmp/site timeout 80 python3 -m kvstore.cli bench $S --json $OUT/swapin_old.json | grep -E "^│ +local")
echo "== engine, new, bf16, 16k"
timeout 100 python3 -m kvstore.cli bench engine --model random:1b --device cuda --prompt-lengths 16384 --cached-fractions 0,0.1,0.9 --repeats 3 --json $OUT/engine_new_16k.json | grep -E "^│"
uptime
