"""scripts/wheelhouse.py --target-has: what the target's python holds is left out of the
wheelhouse (what travels to a GPU container is then the project, megatron-core and what the
container lacks), pinned versions constrain the resolution, and a malformed line names
itself."""

import importlib.util
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _wheelhouse():
    spec = importlib.util.spec_from_file_location("wheelhouse", REPO / "scripts" / "wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(name, requires=(), requested=False):
    return {"metadata": {"name": name, "requires_dist": list(requires)}, "requested": requested,
            "download_info": {"url": f"https://example/{name}.whl"}}


def test_a_freeze_file_reads_pins_bare_names_and_skips_editables(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("NumPy==2.5.2\nmatplotlib\n-e git+https://x/y#egg=z\n"
                      "torch @ file:///opt/torch.whl\n# comment\nhf_xet==1.8.0\n")
    assert _wheelhouse().target_packages(str(freeze)) == {
        "numpy": "2.5.2", "matplotlib": None, "hf-xet": "1.8.0"}


def test_a_malformed_line_names_the_file_and_line(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("numpy==2.5.2\nnot a package line\n")
    with pytest.raises(SystemExit, match=r"freeze.txt:2: 'not a package line'"):
        _wheelhouse().target_packages(str(freeze))


def test_what_the_target_has_is_left_out_and_the_rest_is_kept():
    wheelhouse = _wheelhouse()
    report = {"environment": {"python_version": "3.12"}, "install": [
        _package("megatron-gnmr", ["megatron-core", "numpy", "wandb"], requested=True),
        _package("megatron-core", ["numpy", "packaging"]),
        _package("numpy"), _package("packaging"), _package("wandb", ["protobuf"]),
        _package("protobuf"), _package("torch", ["sympy"]), _package("sympy")]}
    args = types.SimpleNamespace(with_torch=False, with_te=False, extras="",
                                 python_version="3.12", platform=None,
                                 target_has={"numpy": "2.5.2", "wandb": None})
    kept, excluded = wheelhouse.kept_packages(report, args)
    assert sorted(p["metadata"]["name"] for p in kept) == [
        "megatron-core", "megatron-gnmr", "packaging", "protobuf"]
    assert excluded == ["numpy", "sympy", "torch", "wandb"]
