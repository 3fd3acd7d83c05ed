"""The install check tells a broken install from one without an optional extra: a module
built on an extra's library (lm-eval for `evaluate --lm-eval`) is named with its extra when
that library is missing, and any other import failure is still a problem."""

import importlib
import sys

from megatron_gnmr.platform.install_check import _unimportable_modules, extras_distributions

REQUIRES = [
    "megatron-core>=0.16",
    "numpy",
    'lm-eval<0.5,>=0.4.9; extra == "dev"',
    'pytest; extra == "dev"',
    'lm-eval<0.5,>=0.4.9; extra == "eval"',
    'numpy>=2; extra == "dev"',  # also required outright: never optional
    'tomli; python_version < "3.0"',  # another Python's, not an extra's
]


def test_a_library_is_named_with_the_smallest_extra_that_brings_it():
    assert extras_distributions(REQUIRES) == {"lm-eval": "eval", "pytest": "dev"}


def _package(tmp_path, modules: dict[str, str]):
    root = tmp_path / "fake_install_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    for name, body in modules.items():
        (root / f"{name}.py").write_text(body)
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    return importlib.import_module("fake_install_pkg")


def test_a_missing_extra_is_reported_and_a_missing_requirement_is_a_problem(tmp_path):
    package = _package(tmp_path, {
        "uses_extra": "import lm_eval_not_installed_here.api\n",
        "broken": "import megatron_gnmr_required_but_missing\n",
        "fine": "import json\n",
        "raises": "raise RuntimeError('bad data file')\n",
    })
    reported = []
    try:
        found = _unimportable_modules(package, {"lm-eval-not-installed-here": "eval"},
                                      reported.append)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("fake_install_pkg")]:
            del sys.modules[name]
    assert sorted(line.split(" does not import")[0] for line in found) == [
        "fake_install_pkg.broken", "fake_install_pkg.raises"]
    assert len(reported) == 1 and "fake_install_pkg.uses_extra needs the extra [eval]" in reported[0]
