#!/bin/bash
# Wave-6 GPU run 2: run 1's failing CPU-model tests with their output, the codec's kernels on
# this CPU, then `bench engine` (both formats) and swap-in again after the e4m3x16 scale
# check moved off torch's CPU threads.
set -u
source docs/runs/wave6-gpu/run_setup.sh
python3 -c "import torch; print('torch', torch.__version__, 'threads', torch.get_num_threads())"
grep -o 'avx512[a-z0-9_]*\|amx[a-z_]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
timeout 150 python3 -m pytest -q -x -p no:cacheprovider -o addopts="" tests/engine_adapter/test_kv_format.py tests/engine_adapter/test_e4m3x16_native.py > $OUT/tests.txt 2>&1
tail -5 $OUT/tests.txt
B="python3 -m kvstore.cli bench"
timeout 130 $B engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.9 --repeats 5 --json $OUT/engine_1b_dtype.json
timeout 110 $B engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.9 --repeats 5 --kv-format e4m3x16 --json $OUT/engine_1b_e4m3x16.json
timeout 100 $B swapin --device cuda --transport local,grpc --model random:1b --num-blocks 256 --no-fsync --rounds 5 --kv-format dtype,e4m3x16 --json $OUT/swapin_1b.json --timeline-png $OUT/swapin_timeline.png
uptime
# A/B of the bf16 local swap-in against the code of the wave-4 run (a5e8c17, in .whl/w4:
# `git archive a5e8c17 | tar -x -C .whl/w4 --exclude=docs --exclude=tests`), same machine,
# alternating: is the gap to wave 4's 9.21 GB/s this VM or the code?
(cd .whl/w4 && for lib in erasure/_fastsum.so kvstore/wire/_landing.so; do
    src=$(dirname $lib)/$(basename $lib .so | sed 's/^_//').c
    gcc -O3 -march=native -pthread -I../include -shared -fPIC -Wall -Werror -o $lib $src || exit 1
done)
S="swapin --device cuda --transport local --model random:1b --num-blocks 256 --no-fsync --rounds 5"
for round in 1 2; do
    (cd .whl/w4 && PYTHONPATH=$PWD:/tmp/site timeout 60 python3 -m kvstore.cli bench $S --json /tmp/ab_w4_$round.json | grep -E "^│ +local")
    timeout 60 $B $S --json /tmp/ab_now_$round.json | grep -E "^│ +local"
done
uptime
