#!/bin/bash
# Prefill run 1 (issue 43): the code before (HEAD of main when the branch started) and after,
# profiled side by side; then the CUDA tests and `kvstore bench engine` on the new code.
# Runs from a copy of the branch (the device call's own checkout is the lead's), with the
# old engine_adapter in before/.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site ../*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
for lib in erasure/_fastsum.so kvstore/wire/_landing.so; do
    src=$(dirname $lib)/$(basename $lib .so | sed 's/^_//').c
    gcc -O3 -march=native -pthread -I../include -shared -fPIC -Wall -Werror -o $lib $src || exit 1
done
nvidia-smi --query-gpu=name --format=csv,noheader; nproc; uptime
P=docs/runs/prefill-h200/profile_prefill.py
PYTHONPATH=$PWD/before:$PYTHONPATH timeout 120 python3 $P before 2>&1 | grep -v Warning
timeout 150 python3 $P after 2>&1 | grep -v Warning
timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine_adapter/test_engine_cuda.py 2>&1 | tail -3
timeout 200 python3 -m kvstore.cli bench engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.9 --repeats 5 --json $OUT/engine_1b.json
uptime
