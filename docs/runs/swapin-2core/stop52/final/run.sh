#!/bin/bash
# Stop 52's final code on the 2-core machine, nothing else running: issue 36's swap-in command
# five times, then the engine per cached fraction, then e4m3x16 against bf16 (issue 35).
set -u
D=docs/runs/swapin-2core/stop52/final
for run in 1 2 3 4 5; do
    .venv/bin/kvstore bench swapin --transport local --no-fsync --rounds 5 --json $D/swapin_local_$run.json | grep -E "^│ +local"
done
.venv/bin/kvstore bench swapin --kv-format e4m3x16 --dtype bfloat16 --num-blocks 64 --rounds 5 --json $D/swapin_e4m3x16_vs_bf16.json | grep -E "^│ +local"
.venv/bin/kvstore bench engine --prompt-lengths 1024 --cached-fractions 0,0.1,0.5,0.9 --repeats 5 --json $D/engine_fractions.json | grep -E "^│"
uptime
