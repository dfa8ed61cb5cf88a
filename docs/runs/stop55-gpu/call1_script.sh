#!/bin/bash
# Stop 55's GPU run, call 1: the engine table of the checkout (issue 43's final figures);
# Rotary's cast-once tables (the checkout) against ffd61af (.whl/base), alternating, on the
# 4k prompt whose 512-token suffix is launch-bound; issue 36/37's swap-in command; the engine
# over the stream. In that order of need: each step writes its JSON before the next starts.
set -u
source docs/runs/wave6-gpu/run_setup.sh
build_tree .whl/base || exit 1
python3 -m pytest -q -p no:cacheprovider tests/engine_adapter/test_engine_model.py tests/engine_adapter/test_engine_cuda.py 2>&1 | tail -1
echo "== engine table, checkout"
timeout 240 python3 -m kvstore.cli bench engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.5,0.9 --repeats 3 --json $OUT/engine_table.json > $OUT/engine_table.log 2>&1
python3 docs/runs/stop55-gpu/summarize.py $OUT/engine_table.json
E="engine --model random:1b --device cuda --prompt-lengths 4096 --cached-fractions 0,0.9 --repeats 5"
for round in 1 2; do
    timeout 90 python3 -m kvstore.cli bench $E --json $OUT/engine4k_new_$round.json > /dev/null 2>&1
    (cd .whl/base && PYTHONPATH=$PWD:/tmp/site timeout 90 python3 -m kvstore.cli bench $E --json $OUT/engine4k_base_$round.json > /dev/null 2>&1)
done
python3 docs/runs/stop55-gpu/summarize.py $OUT/engine4k_*.json
echo "== swap-in, checkout: gRPC, stream, local"
timeout 120 python3 -m kvstore.cli bench swapin --device cuda --model random:1b --num-blocks 256 --no-fsync --rounds 3 --transport grpc,stream,local --json $OUT/swapin.json | grep -E "^│ +(grpc|stream|local) |^limits"
echo "== engine over the stream, 16k, checkout"
timeout 150 python3 -m kvstore.cli bench engine --model random:1b --device cuda --prompt-lengths 16384 --cached-fractions 0,0.1,0.5,0.9 --repeats 3 --store-transport stream --json $OUT/engine_stream.json > /dev/null 2>&1
python3 docs/runs/stop55-gpu/summarize.py $OUT/engine_stream.json
nvidia-smi --query-gpu=name --format=csv,noheader; uptime
