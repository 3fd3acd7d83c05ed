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
# - WHEELHOUSE=DIR (an air-gapped machine): everything comes from DIR, the output of
#   scripts/wheelhouse.py, checked against its manifest; no index is asked (the project is
#   installed from its wheel there, not in editable mode).
# Every pip failure stops the script with pip's message, and the install is marked done only
# after `python -m megatron_gnmr.platform.install_check` passed from outside the repository
# (the installed package, its console script, every runtime dependency at a version in range).
# A container's pip constraint file (PIP_CONSTRAINT, NGC since 25.03) is honoured by pip; when
# it refuses our requirements, the conflict is named.
# Knobs: PYTHON (interpreter), VENV (directory), EXTRAS (default dev; none with a wheelhouse),
# and for a second environment on another megatron-core release
# (scripts/test_newest_megatron.sh): PRE_INSTALL (pip arguments installed before the
# project) and MEGATRON_GNMR_MEGATRON_CORE (the project's megatron-core requirement, read by
# setup.py).
set -euo pipefail
WHEELHOUSE=${WHEELHOUSE:-}
if [ -n "$WHEELHOUSE" ]; then  # relative to where the script was called from
  WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd) || { echo "setup: WHEELHOUSE: no such directory" >&2; exit 1; }
fi
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS-$([ -n "$WHEELHOUSE" ] && echo "" || echo dev)}
PRE_INSTALL=${PRE_INSTALL:-}

stamp="$VENV/.megatron-gnmr-installed"
want="$(cat setup.py | sha1sum | cut -c1-12)-$EXTRAS-${MEGATRON_GNMR_MEGATRON_CORE:-}-$PRE_INSTALL-$WHEELHOUSE"
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
  $PYTHON scripts/container_venv_pth.py "$VENV"  # a container python that is itself a venv
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
rm -f "$stamp"  # whatever happens below, nothing says "installed" until the check passed

# pip, its noise about the package mirror filtered; a failure stops setup with pip's message.
pip_install() {
  local log status=0
  log=$(mktemp)
  $PIP install --quiet "$@" >"$log" 2>&1 || status=$?
  grep -v "^WARNING: Location" "$log" >&2 || true
  if [ "$status" -ne 0 ]; then
    if [ -n "${PIP_CONSTRAINT:-}" ] && grep -qiE "conflict|ResolutionImpossible|Cannot install" "$log"; then
      echo "setup: this environment's pip constraint file PIP_CONSTRAINT=$PIP_CONSTRAINT" \
           "(an NGC container's pins) refuses a requirement above; align that pin or run" \
           "with PIP_CONSTRAINT= to bypass it" >&2
    fi
    rm -f "$log"
    echo "setup: pip install $* failed (pip's message above); nothing is marked installed" >&2
    exit 1
  fi
  rm -f "$log"
}

project=".${EXTRAS:+[$EXTRAS]}"
if [ -n "$WHEELHOUSE" ]; then
  echo "setup: installing from the wheelhouse $WHEELHOUSE (no index)"
  "$VENV/bin/python" scripts/wheelhouse_check.py "$WHEELHOUSE"
  export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE/wheels"
  wheel=$(ls "$WHEELHOUSE"/wheels/megatron_gnmr-*.whl)
  project="$wheel${EXTRAS:+[$EXTRAS]}"
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1 && \
      ! ls "$WHEELHOUSE"/wheels/torch-*.whl >/dev/null 2>&1; then
    echo "setup: this python has no torch and the wheelhouse carries none: build it with" \
         "scripts/wheelhouse.py --with-torch, or use the cluster's PyTorch container" >&2
    exit 1
  fi
else
  pip_install --upgrade pip
  project="-e $project"
  if [ -z "$constraints" ] && ! gpu_machine; then
    echo "setup: no CUDA device, installing the CPU torch wheel (torch==2.13.0)"
    pip_install "torch==2.13.0"
  fi
fi
if [ -n "$PRE_INSTALL" ]; then
  echo "setup: first: pip install $PRE_INSTALL"
  # shellcheck disable=SC2086  # a list of pip arguments
  pip_install $PRE_INSTALL
fi
echo "setup: installing megatron-gnmr${EXTRAS:+[$EXTRAS]} (megatron-core, sentencepiece, ...)"
# shellcheck disable=SC2086  # "-e .[dev]" is two arguments
pip_install ${constraints:+-c "$constraints"} $project
# The check runs outside the repository, so that it imports what was installed.
venv_bin="$(cd "$VENV" && pwd)/bin"
(cd / && "$venv_bin/python" -W ignore -m megatron_gnmr.platform.install_check --bin "$venv_bin") \
  || { echo "setup: the install is broken (above); nothing is marked installed" >&2; exit 1; }
echo "$want" > "$stamp"
