"""Shared pytest settings.

- megatron-core's import notices about missing apex/TE are expected on CPU machines and would
  bury real warnings;
- the `slow` tier: tests that launch training processes (torchrun, the entry point,
  `reproduce`). `bash scripts/run_tests.sh --fast` leaves them out; the fast tier still
  trains in-process (`tests/test_training_in_process.py`), so it touches every module;
- each test leaves os.environ as it found it;
- the summary says whether the GPU tests could run here, and why not.
"""

from pathlib import Path

import pytest

SLOW_MODULES = {"test_alarm_detectors_live", "test_dashboard", "test_data_safety",
                "test_gpu_check", "test_observability", "test_replay", "test_signals_live",
                "test_scenarios"}
SLOW_TESTS = {"test_bad_input_exits_2_with_one_line",
              "test_the_harness_runs_through_the_extension_points"}


def pytest_configure(config):
    import os
    import uuid

    from tests.float8_budget import RUN_ID

    os.environ.setdefault(RUN_ID, uuid.uuid4().hex)  # one float8 measurement per test run
    for pattern in (r"ignore:.*(Apex|Transformer Engine and Apex) (is|are) not installed",
                    r"ignore:full scope is deprecated",
                    r"ignore::DeprecationWarning"):  # megatron/torch deprecations, not ours
        config.addinivalue_line("filterwarnings", pattern)
    config.addinivalue_line("markers", "slow: launches training processes (full suite only)")


@pytest.fixture(autouse=True)
def _environment_as_found():
    """Each test leaves the environment as it found it, as a process of its own would, and
    starts without megatron-core's record of an attention backend: a model that a
    module-scoped fixture built in this process leaves NVTE_*_ATTN behind, which would decide
    the backend of the test's own models and of every training process it launches (megatron
    refuses a value that disagrees; the launches' validation names it)."""
    import os

    from megatron_gnmr.platform import attention_environment

    before = dict(os.environ)
    attention_environment.forget()
    yield
    os.environ.clear()
    os.environ.update(before)


def pytest_collection_modifyitems(items):
    for item in items:
        path = Path(str(item.fspath))
        if path.parent.name == "distributed" or path.stem in SLOW_MODULES or \
                item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter):
    """Whether tests/gpu could run on this machine (printed in -q mode too)."""
    from megatron_gnmr.platform import capabilities

    from tests.float8_budget import float8_speed

    terminalreporter.section("float8 GEMMs")
    terminalreporter.write_line(f"{float8_speed().describe()} on this machine; the fp8-torchao "
                                "tests size their training steps by it")
    terminalreporter.section("GPU tests")
    for name, capability in capabilities.report():
        state = "available" if capability else "not available, its tests skip"
        terminalreporter.write_line(f"{name}: {state} ({capability.reason})")
