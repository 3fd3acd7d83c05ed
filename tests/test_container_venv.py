"""setup_env.sh on a GPU container whose python is itself a venv (the H200 image's python3
is /opt/torch/.venv/bin/python3): a venv made with --system-site-packages links the base
interpreter and would not see the container's torch; scripts/container_venv_pth.py puts the
container venv's packages on the new venv's path. This test's own python is such a venv."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = "import torch, sys; print(torch.__file__)"


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="the test's python is not a venv")
def test_a_venv_made_from_a_venv_python_sees_its_torch_only_with_the_pth(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(venv)], check=True)
    python = str(venv / "bin" / "python")
    before = subprocess.run([python, "-c", PROBE], capture_output=True, text=True)
    assert before.returncode != 0, "the base interpreter has torch: nothing left to test"
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "container_venv_pth.py"),
                          str(venv)], capture_output=True, text=True, check=True).stdout
    assert "is itself a venv" in out
    after = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=True)
    assert after.stdout.strip().startswith(sys.prefix)
    # the new venv's own packages still come first
    order = subprocess.run([python, "-c", "import sys; print('\\n'.join(sys.path))"],
                           capture_output=True, text=True, check=True).stdout.split()
    own = next(i for i, p in enumerate(order) if p.startswith(str(venv)))
    parent = next(i for i, p in enumerate(order) if p.startswith(sys.prefix))
    assert own < parent
