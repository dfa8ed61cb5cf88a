#!/bin/bash
# Wave-6 GPU run 3: run 2 cut to fit the device time left (about 400 s with the start): the
# failing tests' output, swap-in of both formats over local after the scale-check fix, the
# e4m3x16 engine at 16k, and one A/B round of the bf16 local swap-in against wave 4's code.
set -u
source docs/runs/wave6-gpu/run_setup.sh
timeout 60 python3 -m pytest -q -x -p no:cacheprovider -o addopts="" tests/engine_adapter/test_kv_format.py > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt
B="python3 -m kvstore.cli bench"
S="swapin --device cuda --transport local --model random:1b --num-blocks 256 --no-fsync --rounds 3"
timeout 60 $B $S --kv-format dtype,e4m3x16 --json $OUT/swapin_1b.json | grep -E "^│|^e4m3"
timeout 60 $B engine --model random:1b --device cuda --prompt-lengths 16384 --cached-fractions 0,0.9 --repeats 3 --kv-format e4m3x16 --json $OUT/engine_1b_e4m3x16.json | grep -E "^│"
(cd .whl/w4 && for lib in erasure/_fastsum.so kvstore/wire/_landing.so; do
    src=$(dirname $lib)/$(basename $lib .so | sed 's/^_//').c
    gcc -O3 -march=native -pthread -I../include -shared -fPIC -Wall -Werror -o $lib $src || exit 1
done
PYTHONPATH=$PWD:/tmp/site timeout 50 python3 -m kvstore.cli bench $S --json /tmp/ab_w4.json | grep -E "^│ +local")
uptime
