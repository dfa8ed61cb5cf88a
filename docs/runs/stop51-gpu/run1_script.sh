#!/bin/bash
# Stop 51's GPU run, call 1. Swap-in of bf16 and e4m3x16 blocks over local, 256 blocks of
# random:1b, one machine, in turn: the landed code (b7822f4, the checkout), this stop's
# change (.whl/new: `git archive` of its commit: completed blocks copied to the GPU as runs),
# the same with the GIL's switch interval at 0.5 ms in every process (client and nodes,
# through .whl/sw/sitecustomize.py), and the code before stop 50 (02d9013, .whl/old).
# The CUDA tests of the new tree first.
set -u
source docs/runs/wave6-gpu/run_setup.sh
source docs/runs/stop50-gpu/build_old.sh
build_tree .whl/new || exit 1
echo "== CUDA tests, new"
(cd .whl/new && PYTHONPATH=$PWD:/tmp/site timeout 90 python3 -m pytest -q -p no:cacheprovider tests/engine_adapter/test_engine_cuda.py 2>&1 | tail -3)
S="swapin --device cuda --transport local --model random:1b --num-blocks 256 --no-fsync --rounds 3 --kv-format dtype,e4m3x16"
echo "== swap-in, landed (b7822f4)"
timeout 100 python3 -m kvstore.cli bench $S --json $OUT/swapin_landed.json | grep -E "^│ +local"
echo "== swap-in, new"
(cd .whl/new && PYTHONPATH=$PWD:/tmp/site timeout 100 python3 -m kvstore.cli bench $S --json $OUT/swapin_new.json | grep -E "^│ +local")
echo "== swap-in, new, switch interval 0.5 ms"
(cd .whl/new && AB_SWITCH_INTERVAL_S=0.0005 PYTHONPATH=$PWD:$OLDPWD/.whl/sw:/tmp/site timeout 100 python3 -m kvstore.cli bench $S --json $OUT/swapin_new_switch.json | grep -E "^│ +local")
echo "== swap-in, old (02d9013)"
(cd .whl/old && PYTHONPATH=$PWD:/tmp/site timeout 100 python3 -m kvstore.cli bench $S --json $OUT/swapin_old.json | grep -E "^│ +local")
uptime
