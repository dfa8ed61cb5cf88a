#!/bin/bash
# Stop 52's GPU run, call 5: the final code (d0375bc), the engine's two fetch policies at 4k
# and 16k, 0-90% cached, alternating twice: "always" (the default: fetch whatever is cached)
# and "cost" (the cost model may compute the prompt's front meanwhile, or all of it).
set -u
source docs/runs/wave6-gpu/run_setup.sh
E="engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.5,0.9 --repeats 3"
for round in 1 2; do
    for policy in always cost; do
        echo "== engine, round $round, fetch policy $policy"
        timeout 80 python3 -m kvstore.cli bench $E --fetch-policy $policy --json $OUT/engine_${policy}_$round.json | grep -E "^│"
    done
done
uptime
