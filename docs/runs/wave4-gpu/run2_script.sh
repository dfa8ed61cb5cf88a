#!/bin/bash
# Wave-4 GPU run 2: `bench engine` with e4m3x16 blocks, and swap-in of both formats over the
# local channel and gRPC (the same warm machine as run 1).
set -u
source docs/runs/wave4-gpu/run_setup.sh
timeout 200 python3 -m kvstore.cli bench engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.9 --repeats 3 --kv-format e4m3x16 --json $OUT/engine_1b_e4m3x16.json
timeout 200 python3 -m kvstore.cli bench swapin --device cuda --transport local,grpc --model random:1b --num-blocks 256 --no-fsync --rounds 3 --kv-format dtype,e4m3x16 --json $OUT/swapin_1b.json --timeline-png $OUT/swapin_timeline.png
uptime
