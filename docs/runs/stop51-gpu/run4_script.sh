#!/bin/bash
# Stop 51's GPU run, call 4: the fetch's first chunk alone until its last block lands (.whl/new2)
# against the same code without that change (.whl/new), on one machine: the engine at 4k and
# 16k (bf16 blocks; 0%, 10% and 90% cached), then misses and hits of 256 blocks through the
# connector (miss_probe.py) on new2.
set -u
source docs/runs/wave6-gpu/run_setup.sh
build_tree .whl/new || exit 1
build_tree .whl/new2 || exit 1
PROBE=$PWD/docs/runs/stop51-gpu/miss_probe.py
E="engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.9 --repeats 3"
for tree in new2 new; do
    echo "== engine, $tree"
    (cd .whl/$tree && PYTHONPATH=$PWD:/tmp/site timeout 70 python3 -m kvstore.cli bench $E --json $OUT/engine_$tree.json | grep -E "^│")
done
echo "== misses and hits, 256 blocks, new2"
(cd .whl/new2 && PYTHONPATH=$PWD:/tmp/site timeout 50 python3 $PROBE --device cuda --model random:1b --dtype bfloat16 --fetches 10 --num-blocks 256 2>&1 | grep -E "^(miss|hit)|stages")
uptime
