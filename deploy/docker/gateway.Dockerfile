# syntax=docker/dockerfile:1
# kvroute gateway: the OpenAI-compatible, cache-aware router. CPU only: the base install of
# kvroute has no torch, and this image never installs the [worker] extra.
#
# Build from the repository root (the build context):
#   docker build -f deploy/docker/gateway.Dockerfile -t kvroute/gateway:0.1.0 .
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Only what the gateway runs: the contract it shares with workers and its own package.
COPY pyproject.toml README.md kvroute_cli.py ./
COPY contract/ contract/
COPY openai_api/ openai_api/
COPY gateway/ gateway/
RUN python -m venv /opt/kvroute \
 && /opt/kvroute/bin/pip install .

FROM python:${PYTHON_VERSION}-slim
RUN groupadd --system --gid 10001 kvroute \
 && useradd --system --uid 10001 --gid kvroute --home-dir /tmp --shell /usr/sbin/nologin kvroute
COPY --from=build /opt/kvroute /opt/kvroute
ENV PATH=/opt/kvroute/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    KVROUTE_PORT=8000
# Numeric, so Kubernetes can verify runAsNonRoot.
USER 10001:10001
EXPOSE 8000
# No curl in the slim image: Python itself probes /health.
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVROUTE_PORT', '8000'), timeout=2)"]
ENTRYPOINT ["kvroute"]
CMD ["gateway"]
