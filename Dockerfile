# kv-offload-exporter image: python:3.12-slim, pinned dependencies (requirements.lock),
# non-root by default, healthcheck on /healthz.
#
#   docker build -t kv-offload-exporter:0.1.0 .
#
# For a reproducible build pin the base by digest:
#   docker build --build-arg PYTHON_IMAGE=python:3.12-slim@sha256:<digest> ...
#
# NVML works as this non-root user: the NVIDIA container runtime injects the driver library
# and the GPU device nodes (world read/write) into the container. Reading vLLM's pinned
# memory (/proc/PID/smaps) needs ptrace-read access to vLLM's processes: run as vLLM's uid,
# or as root with CAP_SYS_PTRACE (what docker-compose.yml and deploy/ do, since vLLM's
# image runs as root). docs/deploy.md has the details.
ARG PYTHON_IMAGE=python:3.12-slim
FROM ${PYTHON_IMAGE}

# MALLOC_ARENA_MAX: glibc gives each thread that allocates its own malloc arena, and the
# exporter's threads (KV-event receiver, /metrics parsing, /proc reads) left their freed
# memory in them: resident memory rose ~2 MiB a minute with KV events on while Python's own
# heap stayed flat, and was flat with two arenas (docs/reliability.md, "Resident memory").
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MALLOC_ARENA_MAX=2 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY requirements.lock ./
RUN pip install --no-compile --no-deps -r requirements.lock \
    && useradd --system --uid 10001 --gid 0 --no-create-home --shell /usr/sbin/nologin kvoe

# The exporter runs from its source tree (pure Python, no build step).
COPY exporter ./exporter
ENV PYTHONPATH=/app

USER 10001
EXPOSE 9747 5557
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('KVOE_LISTEN', ':9747').rpartition(':')[2]; urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=3)"]
ENTRYPOINT ["python", "-m", "exporter"]
