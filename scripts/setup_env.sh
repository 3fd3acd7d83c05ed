#!/usr/bin/env bash
# Create (or reuse) .venv with everything megatron-gnmr needs. Idempotent: a second run
# with an unchanged setup.py does nothing. On a machine without CUDA it installs the CPU
# torch wheel (torch==2.13.0) BEFORE the project, so nothing can pull a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-dev}

stamp="$VENV/.megatron-gnmr-installed"
want="$(cat setup.py | sha1sum | cut -c1-12)-$EXTRAS"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: $VENV is up to date"
  exit 0
fi

echo "setup: creating $VENV with $($PYTHON --version)"
$PYTHON -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: no CUDA device, installing the CPU torch wheel (torch==2.13.0)"
  $PIP install --quiet "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
echo "setup: installing megatron-gnmr[$EXTRAS] (megatron-core, sentencepiece, ...)"
$PIP install --quiet -e ".[$EXTRAS]" 2>&1 | grep -v "^WARNING: Location" || true
$VENV/bin/python -c "import torch, megatron.core, megatron_gnmr" \
  || { echo "setup: the install is broken (see the messages above)" >&2; exit 1; }
echo "$want" > "$stamp"
echo "setup: done ($($VENV/bin/python -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)'))"
