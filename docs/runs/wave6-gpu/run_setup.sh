#!/bin/bash
# Shared set-up of the wave-6 and later GPU runs (sourced): the carried wheels into /tmp/site
# (once per machine), and `build_tree DIR`, which builds a source tree's native helpers for
# this host against the carried xxhash.h (the same four libraries `make native` builds:
# checksums, the read loop, the simulator, the e4m3x16 codec); the checkout's are built here.
if [ ! -f /tmp/site/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    touch /tmp/site/.done
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
build_tree() {
    (cd "$1" && for lib in erasure/_fastsum.so kvstore/wire/_landing.so; do
        src=$(dirname $lib)/$(basename $lib .so | sed 's/^_//').c
        gcc -O3 -march=native -pthread -I"$OLDPWD"/.whl/include -shared -fPIC -Wall -Werror -o $lib $src || exit 1
    done
    for lib in ttl/_simloop.so engine_adapter/_e4m3x16.so; do
        src=$(dirname $lib)/$(basename $lib .so | sed 's/^_//').c
        gcc -O3 -march=native -shared -fPIC -Wall -Werror -o $lib $src -lm || exit 1
    done)
}
build_tree . || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader; nproc; uptime
