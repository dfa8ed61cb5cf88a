#!/bin/bash
# H200 run 1 of the local-channel work: throughput per transport, swap-in and engine over "local".
cd "$(dirname "$0")/../code"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 ../whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/../../site:/tmp/site2 PYTHONUNBUFFERED=1
S=../scripts
log=$OUT/run1.log
python3 -c "import client, bench.swapin_bench, bench.engine_bench, deploy.local_cluster" || exit 1
{
  echo "code at $(cat ../HEAD)"; uptime
  SECS=3 timeout 100 python3 $S/prof_cl.py local:8:8 ucx:8:8 local:16:8 local:32:4
  SWITCH=0.0005 SECS=3 timeout 40 python3 $S/prof_cl.py local:16:8
  SECS=3 PROF=1 timeout 40 python3 $S/prof_cl.py local:16:8
  uptime
} > $OUT/prof.txt 2>&1
{
  uptime
  timeout 100 python3 -m kvstore.cli bench swapin --device cuda --transport ucx,local --no-fsync --rounds 5 --json $OUT/swapin.json
  uptime
  timeout 180 python3 -m kvstore.cli bench engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.9 --repeats 3 --store-transport local --json $OUT/engine_local.json
  uptime
} > $log 2>&1
grep RESULT $OUT/prof.txt | cut -c1-400; grep -E "│" $log | tail -12
