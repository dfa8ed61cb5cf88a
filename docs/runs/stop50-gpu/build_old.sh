#!/bin/bash
# Sourced by this folder's scripts, after docs/runs/wave6-gpu/run_setup.sh: the native helpers
# of the code before this stop (.whl/old, `git archive 02d9013 | tar -x -C .whl/old
# --exclude=docs --exclude=tests`), built for this host.
build_tree .whl/old || exit 1
