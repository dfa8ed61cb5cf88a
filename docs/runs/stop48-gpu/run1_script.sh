#!/bin/bash
# Stop 48's GPU run 1: the CUDA tests of the engine (place_s on CUDA events, the first-miss
# cut), the suffix profile (issue 43, item 3), and the engine bench in both block formats.
set -u
source docs/runs/wave6-gpu/run_setup.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine_adapter/test_engine_cuda.py tests/engine_adapter/test_engine_bench.py tests/engine_adapter/test_kv_format.py > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt
timeout 120 python3 docs/runs/stop48-gpu/profile_prefill.py random:1b 4096,16384 > $OUT/profile.txt 2>&1
grep "^{" $OUT/profile.txt
B="python3 -m kvstore.cli bench engine --model random:1b --device cuda"
timeout 150 $B --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.9 --repeats 5 --json $OUT/engine_1b_dtype.json | grep -E "^│|limits|transport"
timeout 100 $B --kv-format e4m3x16 --prompt-lengths 4096,16384 --cached-fractions 0,0.9 --repeats 3 --json $OUT/engine_1b_e4m3x16.json | grep -E "^│|limits"
uptime
