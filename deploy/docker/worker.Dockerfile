# syntax=docker/dockerfile:1
# kvroute worker: the paged-KV prefix-caching engine on one GPU. CUDA runtime base, torch
# from the PyTorch CUDA wheel index, then kvroute with its [worker] extra.
#
# Build from the repository root (the build context):
#   docker build -f deploy/docker/worker.Dockerfile -t kvroute/worker:0.1.0 .
# pyproject pins torch==2.13.0; a CUDA build (2.13.0+cu128) satisfies that pin.
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_BASE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md kvroute_cli.py ./
COPY contract/ contract/
COPY openai_api/ openai_api/
COPY worker/ worker/
# torch first, from the CUDA index, so the [worker] extra finds it already satisfied.
RUN python3 -m venv /opt/kvroute \
 && /opt/kvroute/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && /opt/kvroute/bin/pip install ".[worker]"

FROM ${CUDA_BASE}
ENV DEBIAN_FRONTEND=noninteractive
# The venv links to this interpreter: same base image, same python3 as the build stage.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 kvroute \
 && useradd --system --uid 10001 --gid kvroute --home-dir /tmp --shell /usr/sbin/nologin kvroute
COPY --from=build /opt/kvroute /opt/kvroute
ENV PATH=/opt/kvroute/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    KVROUTE_HTTP_PORT=8001
USER 10001:10001
EXPOSE 50051 8001
# Loading weights and sizing the KV cache takes a while: a long start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVROUTE_HTTP_PORT', '8001'), timeout=3)"]
ENTRYPOINT ["kvroute"]
CMD ["worker"]
