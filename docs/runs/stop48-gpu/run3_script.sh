#!/bin/bash
# Stop 48's GPU run 3 (main at the final code): the CUDA tests again (the engine's Linear and
# the chunk changes since run 1), and the engine bench at 4k and 16k.
set -u
source docs/runs/wave6-gpu/run_setup.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine_adapter/test_engine_cuda.py tests/engine_adapter/test_engine_bench.py tests/engine_adapter/test_kv_format.py tests/engine_adapter/test_engine_model.py > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt
B="python3 -m kvstore.cli bench engine --model random:1b --device cuda"
timeout 150 $B --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.9 --repeats 5 --json $OUT/engine_1b_dtype.json | grep -E "^│|limits"
timeout 60 python3 docs/runs/stop48-gpu/attention_variants.py 2>&1 | tee $OUT/attention_variants.txt
uptime
