#!/bin/bash
# Stop 52's GPU run, call 1: this stop's checkout (the tally in numpy per node answer, payload
# views made only when asked, up to 256 keys per node request) against the code that landed
# before it (fd7f5f0, `git archive` into .whl/landed), on one machine: the CUDA tests, the local
# swap-in of 256 blocks of random:1b (bf16 and e4m3x16) in land_batch chunks of 64 and of 256
# blocks in each tree, then the engine at 4k and 16k (0%, 10%, 90% cached) on the checkout
# with fetch chunks of 64 and of 256 blocks.
set -u
source docs/runs/wave6-gpu/run_setup.sh
build_tree .whl/landed || exit 1
echo "== CUDA tests, checkout"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/engine_adapter/test_engine_cuda.py tests/client/test_shard_table.py 2>&1 | tail -2
S="swapin --device cuda --transport local --model random:1b --num-blocks 256 --no-fsync --rounds 3 --kv-format dtype,e4m3x16"
for chunk in 64 256; do
    echo "== swap-in, chunks of $chunk, new (checkout)"
    timeout 70 python3 -m kvstore.cli bench $S --chunk-blocks $chunk --json $OUT/swapin_new_c$chunk.json | grep -E "^│ +local"
    echo "== swap-in, chunks of $chunk, landed"
    (cd .whl/landed && PYTHONPATH=$PWD:/tmp/site timeout 70 python3 -m kvstore.cli bench $S --chunk-blocks $chunk --json $OUT/swapin_landed_c$chunk.json | grep -E "^│ +local")
done
E="engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.9 --repeats 3"
for chunk in 64 256; do
    echo "== engine, fetch chunks of $chunk, new (checkout)"
    timeout 90 python3 -m kvstore.cli bench $E --fetch-chunk-blocks $chunk --json $OUT/engine_new_c$chunk.json | grep -E "^│"
done
uptime
