"""Shared pytest settings.

- megatron-core's import notices about missing apex/TE are expected on CPU machines and would
  bury real warnings;
- the `slow` tier: tests that launch training processes (torchrun, the entry point,
  `reproduce`). `bash scripts/run_tests.sh --fast` leaves them out; the fast tier still
  trains in-process (`tests/test_training_in_process.py`), so it touches every module;
- the `heavy` tier (`bash scripts/run_tests.sh --heavy`; CI runs it after the test command):
  the studies' smoke runs, the outside judges (lm-eval, transformers across processes) and
  the slowest launches, each of whose properties the test command also checks in a smaller
  form (HEAVY says which). It keeps the test command under 40 minutes on a busy 2-core
  machine without dropping a check from CI;
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
# module: its heavy tests (None: all of them), and what the test command keeps of the same
# property. Minutes are a busy machine's junit times (docs/guide/testing.md).
HEAVY = {
    "test_scenarios": None,  # 6.2: every scenario's smoke; test_closed_loop keeps the loop
    "test_lm_eval": None,  # 3.4: lm-eval itself; test_lora scores a cloze by hand
    "test_detection": {  # 2.5: twin runs; the traces' arithmetic stays
        "test_the_first_alarm_from_a_twin_trace_is_the_live_run_first_recovery",
        "test_the_kernel_probes_first_alarm_from_a_twin_trace_is_the_live_first_recovery"},
    "test_gpu_check": {  # 2.2: the GPU check end to end on a CPU; its parts' own tests stay
        "test_gpu_check_smoke_runs_every_part_and_fails_loudly_on_what_cannot_run"},
    "test_bench_checkpoint": None,  # 2.2: a benchmark's six runs
    "test_e4m3_question": {  # 1.0: a study's harness; its quantizers against ml_dtypes stay
        "test_the_harness_runs_through_the_extension_points"},
    "test_hf_families_parallel": None,  # 2.3: test_hf_interop_tp keeps TP 2 against transformers
    "test_dist_checkpoint": {  # 3.4: the reshards; the bit-for-bit same-layout resume stays
        "test_a_resume_on_another_layout_continues_the_run",
        "test_a_wrong_reshard_breaks_the_bound", "test_a_misplaced_optimizer_shard_breaks_the_bound"},
    "test_precision_tp": {  # 2.2: torch's float8 GEMM, a reference kernel on Xeons; the
        "test_real_float8_recipe_tp2_matches_tp1"},  # emulated recipes at TP 2 stay
    "test_device_rule": {  # 1.9: the audit of one run stays
        "test_every_collective_and_optimizer_tensor_is_on_the_run_device"},
    "test_live_job": {  # 1.5: the lock's takeover stays
        "test_a_killed_agent_takes_its_workers_and_a_second_launch_is_refused"},
    "test_resume": {  # 1.5: the torch_dist resume with the distributed optimizer stays
        "test_distributed_optimizer_shards_resume_exactly"},
    "test_torchao_compile": {  # 0.9: the compiled float8 linear against eager stays
        "test_fp8_torchao_with_compiled_layers_trains_to_the_eager_losses"},
}


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
    config.addinivalue_line("markers", "heavy: the slowest checks (bash scripts/run_tests.sh "
                            "--heavy)")


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


@pytest.fixture
def megatron_world():
    """One process as a world of one (TINY's layout: gloo, megatron's parallel state), torn
    down after the test, for tests that build megatron objects in this process."""
    import torch
    from megatron.core import parallel_state

    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.training import distributed
    from tests.helpers import TINY

    distributed.initialize(parse_config(TINY))
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def pytest_collection_modifyitems(items):
    for item in items:
        path = Path(str(item.fspath))
        if path.parent.name == "distributed" or path.stem in SLOW_MODULES or \
                item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        named = HEAVY.get(path.stem, ())
        missing = [name for name in named or () if not hasattr(item.module, name)]
        if missing:  # a renamed test must not leave the tier quietly
            raise pytest.UsageError(f"tests/conftest.py HEAVY names {missing}, which "
                                    f"{path.name} does not define")
        if path.stem in HEAVY and (named is None or item.originalname in named):
            item.add_marker(pytest.mark.heavy)


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
