#!/bin/bash
# Stop 52's GPU run, call 4: a suffix's attention as plain causal attention of padded queries
# where that is cheaper (the checkout) against the same code without it (fca7af8, .whl/base),
# on one machine: the CUDA tests, then the engine at 4k and 16k, 0-90% cached, alternating.
set -u
source docs/runs/wave6-gpu/run_setup.sh
build_tree .whl/base || exit 1
echo "== CUDA tests, checkout"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine_adapter/test_engine_cuda.py tests/engine_adapter/test_engine_model.py 2>&1 | tail -2
E="engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.5,0.9 --repeats 3"
for round in 1 2; do
    echo "== engine, round $round, padded (checkout)"
    timeout 80 python3 -m kvstore.cli bench $E --json $OUT/engine_padded_$round.json | grep -E "^│"
    echo "== engine, round $round, base"
    (cd .whl/base && PYTHONPATH=$PWD:/tmp/site timeout 80 python3 -m kvstore.cli bench $E --json $OUT/engine_base_$round.json | grep -E "^│")
done
uptime
