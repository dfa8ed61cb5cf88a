#!/bin/bash
# Stop 55's GPU run, call 2 (a fresh H100: call 1's was taken back): call 1's engine-table
# command on the checkout and on ffd61af (.whl/base), one after the other on one host, to
# tell the host's figures from the code's.
set -u
source docs/runs/wave6-gpu/run_setup.sh
build_tree .whl/base || exit 1
T="engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.5,0.9 --repeats 3"
echo "== engine table, checkout"
timeout 200 python3 -m kvstore.cli bench $T --json $OUT/engine_table.json > /dev/null 2>&1
echo "== engine table, ffd61af"
(cd .whl/base && PYTHONPATH=$PWD:/tmp/site timeout 200 python3 -m kvstore.cli bench $T --json $OUT/engine_table_base.json > /dev/null 2>&1)
python3 docs/runs/stop55-gpu/summarize.py $OUT/engine_table.json $OUT/engine_table_base.json
uptime
