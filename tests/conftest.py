"""Shared pytest settings: megatron-core's import notices about missing apex/TE are expected
on CPU machines and would bury real warnings. The report header says whether the GPU tests
can run here, and why not."""


def pytest_configure(config):
    for pattern in (r"ignore:.*(Apex|Transformer Engine and Apex) (is|are) not installed",
                    r"ignore:full scope is deprecated",
                    r"ignore::DeprecationWarning"):  # megatron/torch deprecations, not ours
        config.addinivalue_line("filterwarnings", pattern)


def pytest_terminal_summary(terminalreporter):
    """Whether tests/gpu could run on this machine (printed in -q mode too)."""
    from megatron_gnmr.platform import capabilities

    terminalreporter.section("GPU tests")
    for name, capability in capabilities.report():
        state = "available" if capability else "not available, its tests skip"
        terminalreporter.write_line(f"{name}: {state} ({capability.reason})")
