#!/bin/bash
# Wave-4 GPU run 1 (issue 43, 35, 36 on the merged code): the CUDA tests, the prefill profile
# of the old engine (.whl/before: engine_adapter of 259f669) and the new one side by side with
# transformers', then `bench engine` on random:1b with the compute dtype's blocks.
set -u
source docs/runs/wave4-gpu/run_setup.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine_adapter/test_engine_cuda.py tests/engine_adapter/test_kv_format.py 2>&1 | tail -4
P=docs/runs/prefill-h200/profile_prefill.py
PYTHONPATH=$PWD/.whl/before:$PYTHONPATH timeout 100 python3 $P before 2>&1 | grep -v Warning
timeout 100 python3 $P after 2>&1 | grep -v Warning
timeout 200 python3 -m kvstore.cli bench engine --model random:1b --device cuda --prompt-lengths 4096,16384 --cached-fractions 0,0.1,0.9 --repeats 3 --json $OUT/engine_1b_dtype.json
uptime
