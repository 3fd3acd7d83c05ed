"""Transformer Engine and the install paths (issue 57 item 6): a wheelhouse cannot carry it
(no binary transformer-engine-torch exists; it compiles against the target's torch), so
`scripts/wheelhouse.py --with-te` is refused in one line before anything is built or resolved,
naming the routes that work; and setup.py's `te` extra agrees with megatron-core's own bound
and admits the TE releases the TE path was read in."""

import ast
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def _wheelhouse():
    spec = importlib.util.spec_from_file_location("wheelhouse", REPO / "scripts" / "wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags", [["--with-te"], ["--extras", "dev,te"]])
def test_carrying_te_is_refused_in_one_line_before_anything_runs(tmp_path, monkeypatch, flags):
    """Before: the project's wheel was built, then pip's resolution failed (`--only-binary`
    finds no transformer-engine-torch) with pip's many-line error."""
    wheelhouse = _wheelhouse()

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"ran {args[0][:4]} before refusing")

    monkeypatch.setattr(wheelhouse.subprocess, "run", no_subprocess)
    target = tmp_path / "wheelhouse"
    monkeypatch.setattr(sys, "argv", ["wheelhouse.py", str(target), "--python-version", "3.12",
                                      *flags])
    with pytest.raises(SystemExit) as refused:
        wheelhouse.main()
    message = str(refused.value.code)
    assert "\n" not in message and message.startswith(f"wheelhouse: {flags[0]} ")
    for words in ("transformer-engine-torch has no binary wheel", "target's own torch",
                  "NGC PyTorch container", "pip install --no-build-isolation"):
        assert words in message
    assert not target.exists()


def _te_extra() -> dict[str, Requirement]:
    """setup.py's TRANSFORMER_ENGINE lines (read, not run), by their Python marker."""
    tree = ast.parse((REPO / "setup.py").read_text())
    lines = next(ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "")
                 == "TRANSFORMER_ENGINE")
    extra = {}
    for line in lines:
        requirement = Requirement(line)
        python = "3.11" if requirement.marker.evaluate({"python_version": "3.11"}) else "3.12"
        extra[python] = requirement
    return extra


CANDIDATES = ["2.8.0", "2.9.0", "2.10.0", "2.11.0", "2.11.9", "2.12.0", "2.18.0", "2.19.0",
              "2.20.2", "2.21.0"]


def test_on_python_3_11_the_te_extra_is_megatron_core_0_16_1s_own_bound():
    """megatron-core 0.16.1 (what Python 3.11 gets) declares transformer-engine >=2.9.0a0,
    <2.12.0 in its metadata: our extra must admit exactly the releases it admits."""
    assert importlib.metadata.version("megatron-core") == "0.16.1"
    theirs = next(Requirement(line) for line in importlib.metadata.requires("megatron-core")
                  if Requirement(line).name == "transformer-engine")
    ours = _te_extra()["3.11"]
    assert [v for v in CANDIDATES if v in ours.specifier] == \
        [v for v in CANDIDATES if theirs.specifier.contains(v, prereleases=False)]


def test_on_python_3_12_the_te_extra_admits_every_release_read_and_no_newer():
    """megatron-core 0.19.2 declares TE with no bound, so the bound is ours: the TE releases
    whose Python our TE path was read in (2.9, 2.11, 2.18 at their tags; 2.19.0 and 2.20.2
    from their release wheels), and nothing newer. Before: <2.19, so `[te]` refused the TE
    2.20 an NGC container ships (and no wheel of an older TE torch extension exists)."""
    ours = _te_extra()["3.12"]
    assert [v for v in CANDIDATES if v in ours.specifier] == \
        ["2.9.0", "2.10.0", "2.11.0", "2.11.9", "2.12.0", "2.18.0", "2.19.0", "2.20.2"]
