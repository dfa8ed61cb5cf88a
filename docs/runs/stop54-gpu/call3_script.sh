#!/bin/bash
# Stop 54's GPU run, call 3: the stream link landing each answer on a thread of its own while
# the receiver takes the next one off the socket (the checkout) against 759c24e (.whl/a:
# landing on the receiver, the padded tails copied in one native call), alternating.
set -u
source docs/runs/wave6-gpu/run_setup.sh
build_tree .whl/a || exit 1
python3 -m pytest -q -p no:cacheprovider tests/kvstore/test_stream_reads.py tests/client/test_local_link.py tests/client/test_landing.py tests/erasure/test_fastsum.py 2>&1 | tail -2
S="swapin --device cuda --model random:1b --num-blocks 256 --no-fsync --rounds 3"
ROWS="^│ +(grpc|stream|local) |^limits"
for round in 1 2; do
    echo "== swap-in, checkout (lander): stream, local; round $round"
    timeout 150 python3 -m kvstore.cli bench $S --transport stream,local --json $OUT/swapin_lander_$round.json | grep -E "$ROWS"
    echo "== swap-in, 759c24e: stream, local; round $round"
    (cd .whl/a && PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m kvstore.cli bench $S --transport stream,local --json $OUT/swapin_a_$round.json | grep -E "$ROWS")
done
for f in $OUT/swapin_*.json; do
    python3 -c "import json,sys,statistics as st; d=json.load(open(sys.argv[1])); [print(sys.argv[1].split('/')[-1], r['transport'], round(r['gb_per_s'],2), 'land median', round(st.median([e['end_ms']-e['start_ms'] for e in r['timeline'] if e['what']=='land']),2), {k: round(v,1) for k, v in r['stages_ms'].items() if k in ('first_send_to_last_answer','node_reads_first_to_last','node_land_sum','check_sum','decode')}) for r in d['results']]" $f
done
uptime
