#!/bin/bash
# Stop 56's A/B on the 2-core machine: GETs over the local channel and the stream, batch 8,
# the checkout against a base tree, alternating, two rounds. Run from the repository root:
#   rm -rf /tmp/base && mkdir /tmp/base && git archive 0e01f90 | tar -x -C /tmp/base
#   make -C /tmp/base native    # the base's own native helpers (its fastsum.c has copy_verify)
#   bash docs/runs/stream-2core/stop56_ab/ab.sh /tmp/base
set -u
base=$1 out=docs/runs/stream-2core/stop56_ab here=$PWD
B="bench storage --nodes 12 --block-sizes 4MiB --concurrency 8 --batch 8 --transport local,stream"
B="$B --no-fsync --seconds 6 --rounds 1 --straggler-ms 0 --idle-seconds 0"
for round in 1 2; do
    for tree in base new; do
        dir=$here; [ $tree = base ] && dir=$base
        (cd $dir && PYTHONPATH=$dir timeout 600 $here/.venv/bin/python -m kvstore.cli $B \
            --json $here/$out/ab_${tree}_${round}.json > /dev/null 2>&1)
    done
done
python3 - "$out" <<'PY'
import json, sys
for name in ("base_1", "new_1", "base_2", "new_2"):
    for r in json.load(open(f"{sys.argv[1]}/ab_{name}.json"))["results"]:
        if r["op"] == "get":
            print(name, r["system"], round(r["mb_per_s"]), r["client_cpu_s_per_gb"],
                  r["server_cpu_s_per_gb"], round(r["load_avg_1m"], 1))
PY
