#!/usr/bin/env bash
# Create (or reuse) .venv with everything megatron-gnmr needs. Idempotent: a second run
# with an unchanged setup.py does nothing.
#
# - CPU machine: installs the CPU torch wheel (torch==2.13.0) BEFORE the project, so nothing
#   can pull a multi-GB CUDA torch.
# - GPU machine whose python already has a CUDA torch (an NGC PyTorch container): the venv
#   sees the system packages (--system-site-packages), and the container's torch,
#   Transformer Engine and apex are pinned in a constraints file so no requirement can
#   replace them; the project and megatron-core are installed on top.
# Knobs: PYTHON (interpreter), VENV (directory), EXTRAS (default dev), and for a second
# environment on another megatron-core release (scripts/test_newest_megatron.sh):
# PRE_INSTALL (pip arguments installed before the project) and MEGATRON_GNMR_MEGATRON_CORE
# (the project's megatron-core requirement, read by setup.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-dev}
PRE_INSTALL=${PRE_INSTALL:-}

stamp="$VENV/.megatron-gnmr-installed"
want="$(cat setup.py | sha1sum | cut -c1-12)-$EXTRAS-${MEGATRON_GNMR_MEGATRON_CORE:-}-$PRE_INSTALL"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: $VENV is up to date"
  exit 0
fi

gpu_machine() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
system_cuda_torch() {
  $PYTHON -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" >/dev/null 2>&1
}

constraints=""
if gpu_machine && system_cuda_torch; then
  echo "setup: GPU machine with a CUDA torch in $($PYTHON -c 'import sys; print(sys.prefix)'):" \
       "reusing it (venv with --system-site-packages)"
  $PYTHON -m venv --system-site-packages "$VENV"
  constraints="$VENV/container-constraints.txt"
  # Pin what the container brings, at the exact installed versions.
  "$VENV/bin/python" - "$constraints" <<'PY'
import importlib.metadata as metadata, sys
pins = []
for name in ("torch", "transformer-engine", "transformer_engine", "transformer-engine-torch",
             "transformer_engine_torch", "apex", "flash-attn", "triton"):
    try:
        pins.append(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        continue
open(sys.argv[1], "w").write("\n".join(pins) + "\n")
print("setup: kept from the container: " + (", ".join(pins) or "nothing"))
PY
else
  echo "setup: creating $VENV with $($PYTHON --version)"
  $PYTHON -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
if [ -z "$constraints" ] && ! gpu_machine; then
  echo "setup: no CUDA device, installing the CPU torch wheel (torch==2.13.0)"
  $PIP install --quiet "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
if [ -n "$PRE_INSTALL" ]; then
  echo "setup: first: pip install $PRE_INSTALL"
  # shellcheck disable=SC2086  # a list of pip arguments
  $PIP install --quiet $PRE_INSTALL 2>&1 | grep -v "^WARNING: Location" || true
fi
echo "setup: installing megatron-gnmr[$EXTRAS] (megatron-core, sentencepiece, ...)"
$PIP install --quiet ${constraints:+-c "$constraints"} -e ".[$EXTRAS]" 2>&1 \
  | grep -v "^WARNING: Location" || true
$VENV/bin/python -c "import torch, megatron.core, megatron_gnmr" \
  || { echo "setup: the install is broken (see the messages above)" >&2; exit 1; }
echo "$want" > "$stamp"
$VENV/bin/python -W ignore - <<'PY'
import torch, megatron.core as m
from megatron_gnmr.platform import capabilities
print(f"setup: done (torch {torch.__version__}, megatron-core {m.__version__})")
for name, capability in capabilities.report():
    print(f"setup:   {name}: {'yes' if capability else 'no'} ({capability.reason})")
PY
