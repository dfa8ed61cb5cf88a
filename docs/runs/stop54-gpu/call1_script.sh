#!/bin/bash
# Stop 54's GPU run, call 1: the stream channel with the padded last data shard copied to its
# block's tail as it lands (the checkout) against 227349f (.whl/base), alternating, beside the
# local channel, with the loopback TCP ceiling in the same run; then issue 36's command.
set -u
source docs/runs/wave6-gpu/run_setup.sh
build_tree .whl/base || exit 1
python3 -m pytest -q -p no:cacheprovider tests/kvstore/test_stream_reads.py tests/client/test_local_link.py tests/client/test_landing.py 2>&1 | tail -2
S="swapin --device cuda --model random:1b --num-blocks 256 --no-fsync --rounds 3"
ROWS="^│ +(grpc|stream|local) |^limits"
for round in 1 2; do
    echo "== swap-in, checkout: stream, local; round $round"
    timeout 150 python3 -m kvstore.cli bench $S --transport stream,local --json $OUT/swapin_$round.json | grep -E "$ROWS"
    echo "== swap-in, 227349f: stream, local; round $round"
    (cd .whl/base && PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m kvstore.cli bench $S --transport stream,local --json $OUT/swapin_base_$round.json | grep -E "$ROWS")
done
echo "== issue 36's command, checkout"
timeout 200 python3 -m kvstore.cli bench swapin --device cuda --transport grpc,local --model random:1b --num-blocks 256 --no-fsync --rounds 5 --json $OUT/swapin_issue36.json | grep -E "$ROWS"
for f in $OUT/swapin_*.json; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[1].split('/')[-1], r['transport'], round(r['gb_per_s'],2), {k: round(v,1) for k, v in r['stages_ms'].items()}) for r in d['results']]" $f
done
uptime
