#!/bin/bash
# Sourced by this folder's scripts: the native helpers of the code before this stop (.whl/old,
# `git archive 02d9013 | tar -x -C .whl/old --exclude=docs --exclude=tests`), built for this host.
(cd .whl/old && for lib in erasure/_fastsum.so kvstore/wire/_landing.so; do
    src=$(dirname $lib)/$(basename $lib .so | sed 's/^_//').c
    gcc -O3 -march=native -pthread -I../include -shared -fPIC -Wall -Werror -o $lib $src || exit 1
done
for lib in ttl/_simloop.so engine_adapter/_e4m3x16.so; do
    src=$(dirname $lib)/$(basename $lib .so | sed 's/^_//').c
    gcc -O3 -march=native -shared -fPIC -Wall -Werror -o $lib $src -lm || exit 1
done)
