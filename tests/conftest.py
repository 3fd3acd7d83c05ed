"""Shared pytest settings: megatron-core's import notices about missing apex/TE are expected
on CPU machines and would bury real warnings."""


def pytest_configure(config):
    for pattern in (r"ignore:.*(Apex|Transformer Engine and Apex) (is|are) not installed",
                    r"ignore:full scope is deprecated",
                    r"ignore::DeprecationWarning"):  # megatron/torch deprecations, not ours
        config.addinivalue_line("filterwarnings", pattern)
