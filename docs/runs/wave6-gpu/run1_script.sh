#!/bin/bash
# Wave-6 GPU run 1, one call: the CUDA tests, `bench engine` on random:1b with the compute
# dtype's blocks (cached 0, 0.1, 0.9) and with e4m3x16 blocks (0, 0.9), each beside
# transformers' cold prefill in the same run, then swap-in of both formats over local and gRPC
# with the per-stage timeline.
set -u
source docs/runs/wave6-gpu/run_setup.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine_adapter/test_engine_cuda.py tests/engine_adapter/test_kv_format.py 2>&1 | tail -4
B="python3 -m kvstore.cli bench"
timeout 130 $B engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.9 --repeats 5 --json $OUT/engine_1b_dtype.json
timeout 110 $B engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.9 --repeats 5 --kv-format e4m3x16 --json $OUT/engine_1b_e4m3x16.json
timeout 100 $B swapin --device cuda --transport local,grpc --model random:1b --num-blocks 256 --no-fsync --rounds 3 --kv-format dtype,e4m3x16 --json $OUT/swapin_1b.json --timeline-png $OUT/swapin_timeline.png
uptime
