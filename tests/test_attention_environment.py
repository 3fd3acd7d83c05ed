"""megatron-core's record of the attention backend in NVTE_*_ATTN: the values it writes (read
from megatron-core's own method), a launch that finds a disagreeing value refused in one line
naming it, and tests that start without a record an earlier model in this process left."""

import os
from types import SimpleNamespace

import pytest
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.enums import AttnBackend

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.errors import UserError
from megatron_gnmr.platform import attention_environment
from megatron_gnmr.validation import validate
from tests.helpers import TINY


@pytest.mark.parametrize("backend", sorted(attention_environment.WRITTEN))
def test_written_values_are_megatrons(backend):
    """The table against megatron-core's `_set_attention_backend` on a bare config (the
    installed release: 0.16.1 here, 0.19.2 in the newest stage)."""
    module = SimpleNamespace(config=SimpleNamespace(attention_backend=AttnBackend[backend],
                                                    flash_attention_version=None))
    LanguageModule._set_attention_backend(module)
    written = tuple(int(os.environ[name]) for name in attention_environment.VARIABLES)
    assert written == attention_environment.WRITTEN[backend]
    assert attention_environment.disagreements(backend) == {}
    attention_environment.forget()
    assert not set(attention_environment.VARIABLES) & set(os.environ)


def _validate(backend, tmp_path):
    validate(parse_config([*TINY, "--attention-backend", backend, "--train-iters", "4",
                           "--save", str(tmp_path / "save")]), world_size=1)


def test_a_disagreeing_variable_is_refused_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("NVTE_FLASH_ATTN", "1")  # auto's value, or a shell's
    with pytest.raises(UserError) as caught:
        _validate("local", tmp_path)
    message = str(caught.value)
    assert "NVTE_FLASH_ATTN=1" in message and "--attention-backend local" in message
    assert "\n" not in message and "NVTE_FUSED_ATTN=" not in message.split(":")[0]
    assert not (tmp_path / "save").exists()


def test_agreeing_variables_are_accepted(monkeypatch, tmp_path):
    for name, value in zip(attention_environment.VARIABLES, attention_environment.WRITTEN["auto"]):
        monkeypatch.setenv(name, str(value))
    _validate("auto", tmp_path)
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    with pytest.raises(UserError, match="NVTE_UNFUSED_ATTN=0"):
        _validate("auto", tmp_path)


@pytest.fixture(scope="module")
def model_built_earlier():
    """What a module-scoped fixture that builds a model leaves behind."""
    os.environ["NVTE_FLASH_ATTN"] = "1"
    yield
    os.environ.pop("NVTE_FLASH_ATTN", None)


def test_a_test_starts_without_an_earlier_models_record(model_built_earlier):
    """conftest's `_environment_as_found`: the training processes a test launches inherit its
    environment, and megatron-core refuses a record that disagrees with their backend."""
    assert not set(attention_environment.VARIABLES) & set(os.environ)


def test_runs_in_one_process_each_decide_their_attention(tmp_path):
    """experiments/in_sequence.py forgets the record between runs: a local-attention run after
    an auto one (whose model wrote 1s) trains instead of being refused."""
    from megatron_gnmr.experiments.in_sequence import run_in_sequence

    run_in_sequence([[*TINY, "--train-iters", "2", "--lr-warmup-iters", "1",
                      "--attention-backend", backend, "--save", str(tmp_path / backend)]
                     for backend in ("auto", "local")])
    for backend in ("auto", "local"):
        assert (tmp_path / backend / "latest_checkpointed_iteration.txt").read_text() == "2"
