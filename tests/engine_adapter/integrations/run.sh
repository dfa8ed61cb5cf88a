#!/usr/bin/env bash
# `make test-integrations`: the vLLM, LMCache and SGLang adapters against each engine's real
# code, in venvs of their own (docs/engine.md, "Testing the integrations"). Plain `make test`
# needs none of this: there the engines are not installed and these tests skip.
#
#   .venv-vllm    torch 2.13.0 (the project's), vLLM and LMCache: test_vllm_connector.py,
#                 test_lmcache_backend.py
#   .venv-sglang  torch 2.14.1 + torchvision 0.29.1, which SGLang pins (its memory pools import
#                 torchvision; no CPU torchvision exists for torch 2.13.0): test_sglang_backend.py
#
# The engines go in with --no-deps (their full requirements pull CUDA stacks and other torch
# releases); kvstore then goes in *with* its dependencies, constrained by the venv's torch, by
# every pin the engines declare (engine_pins.py constraints: what a user's venv beside the
# engine holds) and by the oldest grpcio and protobuf the engines allow (the other end of the
# project's ranges: `make test` runs the newest), and `pip check` must stay clean for
# kvstore's own requirements (engine_pins.py check). A venv is rebuilt when pyproject.toml or
# this script changed. Where a venv cannot be
# built (no wheels for this platform, no package index), its engines' tests are skipped with
# the reason and the exit status stays 0; INTEGRATIONS_STRICT=1 makes that a failure. Each
# engine's tests run in a process of their own (the engines keep process-wide state).
set -uo pipefail
SCRIPT="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SCRIPT")/../../.."

PYTHON=${PYTHON:-python3}
STRICT=${INTEGRATIONS_STRICT:-0}
TESTS=tests/engine_adapter/integrations
VLLM_VERSION=0.32.0
LMCACHE_VERSION=0.5.6
SGLANG_VERSION=0.5.23
PYTEST_ARGS=${PYTEST_ARGS:-}
# The oldest grpcio and protobuf each venv's engines accept (LMCache 0.5.6: grpcio==1.78.0
# through grpcio-observability, protobuf>=6.31.1,<7; vLLM 0.32.0: protobuf>=6.33.5 in 6.x).
OLDEST_VLLM="grpcio==1.78.0 grpcio-health-checking==1.78.0 protobuf==6.33.5"
OLDEST_SGLANG="grpcio==1.78.0 grpcio-health-checking==1.78.0 protobuf==6.31.1"

fingerprint() { cat pyproject.toml "$SCRIPT" | sha256sum | cut -d' ' -f1; }

# step CMD...: run a pip step, logging how long it took (the logs show where build time goes).
step() {
    local started
    started=$(date +%s)
    "$@" || return 1
    echo "[$(($(date +%s) - started)) s] $*"
}

# install_vllm_venv VENV / install_sglang_venv VENV: the pip steps, on an existing venv.
# --no-compile: modules are byte-compiled when first imported, only those a test needs.
# constrain VENV TORCH OLDEST DIST...: the constraints file of VENV's kvstore install.
constrain() {
    local venv=$1 torch=$2 oldest=$3
    shift 3
    { echo "$torch" && tr ' ' '\n' <<<"$oldest" &&
        "$venv/bin/python" "$TESTS/engine_pins.py" constraints "$@"; } >"$venv/constraints.txt"
}

install_vllm_venv() {
    local pip="$1/bin/python -m pip install -q --no-compile"
    step $pip --upgrade pip &&
        step $pip torch==2.13.0 &&
        step $pip --no-deps "vllm==$VLLM_VERSION" "lmcache==$LMCACHE_VERSION" \
            xgrammar==0.2.8 apache-tvm-ffi==0.1.11 &&
        constrain "$1" torch==2.13.0 "$OLDEST_VLLM" vllm lmcache &&
        step $pip -c "$1/constraints.txt" -e '.[engine,dev,integrations]' &&
        step "$1/bin/python" "$TESTS/engine_pins.py" check
}

install_sglang_venv() {
    local pip="$1/bin/python -m pip install -q --no-compile"
    step $pip --upgrade pip &&
        step $pip torch==2.14.1 torchvision==0.29.1 &&
        step $pip --no-deps "sglang==$SGLANG_VERSION" apache-tvm-ffi==0.1.11 \
            compressed-tensors==0.18.0 &&
        constrain "$1" torch==2.14.1 "$OLDEST_SGLANG" sglang &&
        step $pip -c "$1/constraints.txt" -e '.[engine,dev,integrations-sglang]' &&
        step "$1/bin/python" "$TESTS/engine_pins.py" check
}

# ensure_venv NAME VENV: build VENV unless its stamp matches; 0 when it is usable.
ensure_venv() {
    local name=$1 venv=$2 stamp="$2/.integrations-installed" log="$2/install.log"
    local want started
    want=$(fingerprint)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    started=$(date +%s)
    echo "== $name: building $venv (log: $log)"
    mkdir -p "$venv" && rm -f "$stamp"
    if { [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"; } >"$log" 2>&1 &&
        "install_${name}_venv" "$venv" >>"$log" 2>&1; then
        echo "$want" >"$stamp"
        echo "== $name: $venv ready after $(($(date +%s) - started)) s"
        return 0
    fi
    echo "== $name: SKIPPED: could not build $venv; the last lines of $log:" >&2
    tail -n 15 "$log" >&2
    return 1
}

failed=0
skipped=""
run_tests() { # VENV FILE [ENV=VALUE...]
    local venv=$1 file=$2 started
    shift 2
    started=$(date +%s)
    echo "== $file ($venv)"
    # Under the leftover-process sweep of `make test` (tests/leftover_processes.py): a node
    # a timed-out test left running is killed and fails the run.
    if ! env "$@" "$venv/bin/python" tests/leftover_processes.py run -- \
        "$venv/bin/python" -m pytest -q $PYTEST_ARGS "$TESTS/$file"; then
        failed=1
    fi
    echo "== $file: $(($(date +%s) - started)) s"
}

if ensure_venv vllm .venv-vllm; then
    run_tests .venv-vllm test_vllm_connector.py VLLM_TARGET_DEVICE=cpu
    run_tests .venv-vllm test_lmcache_backend.py
else
    skipped="$skipped vLLM LMCache"
fi
if ensure_venv sglang .venv-sglang; then
    run_tests .venv-sglang test_sglang_backend.py
else
    skipped="$skipped SGLang"
fi

if [ -n "$skipped" ]; then
    echo "== engine integrations SKIPPED for:$skipped (see above)" >&2
    if [ "$STRICT" = 1 ]; then
        failed=1
    fi
fi
exit "$failed"
