#!/bin/bash
# Stop 50's GPU run: this stop's client changes (one shared read plan for healthy groups, the
# start-up heap frozen) against the code that landed before them (02d9013, in .whl/old:
# `git archive 02d9013 | tar -x -C .whl/old --exclude=docs --exclude=tests`), alternating on
# one machine: swap-in of bf16 and e4m3x16 blocks over local, then the engine at 16k.
set -u
source docs/runs/wave6-gpu/run_setup.sh
source docs/runs/stop50-gpu/build_old.sh
S="swapin --device cuda --transport local --model random:1b --num-blocks 256 --no-fsync --rounds 3 --kv-format dtype,e4m3x16"
for round in 1 2; do
    echo "== swap-in, new, round $round"
    timeout 80 python3 -m kvstore.cli bench $S --json $OUT/swapin_new_$round.json | grep -E "^│ +local"
    echo "== swap-in, old (02d9013), round $round"
    (cd .whl/old && PYTHONPATH=$PWD:/tmp/site timeout 80 python3 -m kvstore.cli bench $S --json $OUT/swapin_old_$round.json | grep -E "^│ +local")
done
E="engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.9 --repeats 3"
echo "== engine, new, bf16"
timeout 150 python3 -m kvstore.cli bench $E --json $OUT/engine_new_dtype.json | grep -E "^│"
echo "== engine, new, e4m3x16"
timeout 120 python3 -m kvstore.cli bench $E --kv-format e4m3x16 --json $OUT/engine_new_e4m3x16.json | grep -E "^│"
uptime
