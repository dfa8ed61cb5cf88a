#!/bin/bash
# Sourced: build_tree DIR builds the four native helpers of the source tree in DIR for this
# host, against the carried xxhash.h (as run_setup.sh does for the checkout itself).
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
