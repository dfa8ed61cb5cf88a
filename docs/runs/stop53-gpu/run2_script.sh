#!/bin/bash
# Stop 53's GPU run, call 2: the stream channel receiving straight into the blocks, the node
# sending from a thread of its own (1d6f1e0, the checkout) against the same without that
# sender (7a344fe, .whl/nosend), alternating, beside gRPC and local; then the storage GETs.
set -u
source docs/runs/wave6-gpu/run_setup.sh
build_tree .whl/nosend || exit 1
python3 -m pytest -q -p no:cacheprovider tests/kvstore/test_stream_reads.py tests/client/test_local_link.py 2>&1 | tail -2
S="swapin --device cuda --model random:1b --num-blocks 256 --no-fsync --rounds 3"
for round in 1 2; do
    echo "== swap-in, checkout: gRPC, stream, local; round $round"
    timeout 150 python3 -m kvstore.cli bench $S --transport grpc,stream,local --json $OUT/swapin_$round.json | grep -E "^│ +(grpc|stream|local)"
    echo "== swap-in, nosend: stream, local; round $round"
    (cd .whl/nosend && PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m kvstore.cli bench $S --transport stream,local --json $OUT/swapin_nosend_$round.json | grep -E "^│ +(grpc|stream|local)")
done
echo "== swap-in, e4m3x16 and bf16, stream and local"
timeout 150 python3 -m kvstore.cli bench $S --transport stream,local --kv-format dtype,e4m3x16 --json $OUT/swapin_e4m3.json | grep -E "^│ +(stream|local)"
echo "== storage GETs and PUTs, 4 MiB blocks"
timeout 200 python3 -m kvstore.cli bench storage --nodes 12 --block-sizes 4MiB --concurrency 8 --batch 1,8 --transport grpc,stream,local --no-fsync --seconds 3 --json $OUT/storage.json | grep -E "^│ +kvstore" | head -20
uptime
