"""No checkpoint load unpickles Transformer Engine's `_extra_state` (issue 57 item 4), checked
without TE: megatron's row-parallel linears (each layer's linear_proj and linear_fc2, TE
linears in a TE model) are given TE 2.9-2.17's extra-state methods, whose payload is a pickle
that records every time it is unpickled. (Not the column-parallel class: the GPT output layer
is one, a local linear even in TE models, whose extra state GPTModel asserts is empty.)

What the fake copies of TE (`transformer_engine/pytorch/module/base.py`, v2.9 to v2.17):
`get_extra_state` returns `torch.frombuffer(bytearray(pickle.dumps(state)), dtype=uint8)`;
`set_extra_state` returns on None or an empty tensor and otherwise calls `pickle.loads` on the
tensor's bytes, with no check. A resume in either format must leave the tripwire untouched and
continue the run as if it had never stopped, also from a checkpoint that carries the pickle
(as one written by an earlier version, or crafted, would).
"""

import pickle

import pytest
import torch
from megatron.core.tensor_parallel.layers import RowParallelLinear

from tests.helpers import TINY, pretrain_in_process, train_losses

MARKER = b"megatron-gnmr-te-extra-state-tripwire"
UNPICKLED: list[bytes] = []
FLAGS = [*TINY, "--eval-interval", "100", "--lr-warmup-iters", "1", "--train-iters", "6"]


def _record_unpickling(marker: bytes) -> bytes:
    UNPICKLED.append(marker)
    return marker


class _Tripwire:
    """Unpickling it calls `_record_unpickling` (where a crafted payload would run code)."""

    def __reduce__(self):
        return _record_unpickling, (MARKER,)


def _get_extra_state(self) -> torch.Tensor:  # TE 2.9's, with a recipe-like payload
    state = {"recipe": _Tripwire(), "extra_fp8_variables": {"num_gemms": 1}}
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def _set_extra_state(self, state) -> None:  # TE 2.9's, up to the unpickling
    if state is None:
        return
    if isinstance(state, torch.Tensor):
        if state.numel() == 0:
            return
        state = pickle.loads(state.detach().cpu().numpy().tobytes())
        return
    raise RuntimeError("Unsupported checkpoint format.")


@pytest.fixture
def te_like_linears(monkeypatch):
    """megatron's row-parallel linears with TE's pickled extra state; the tripwire reset."""
    monkeypatch.setattr(RowParallelLinear, "get_extra_state", _get_extra_state)
    monkeypatch.setattr(RowParallelLinear, "set_extra_state", _set_extra_state)
    UNPICKLED.clear()
    yield
    UNPICKLED.clear()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run never stopped, in each format (its losses; extra state plays no part in them)."""
    losses = {}
    for ckpt_format in ("torch", "torch_dist"):
        whole = tmp_path_factory.mktemp(f"whole_{ckpt_format}")
        assert pretrain_in_process([*FLAGS, "--ckpt-format", ckpt_format,
                                    "--save", str(whole)]) == 0
        losses[ckpt_format] = train_losses(whole)
    return losses


def _stop_at_3(parts, ckpt_format: str) -> None:
    assert pretrain_in_process([*FLAGS, "--ckpt-format", ckpt_format, "--exit-interval", "3",
                                "--save-interval", "3", "--save", str(parts)]) == 0


def _resume(parts, ckpt_format: str) -> None:
    assert pretrain_in_process([*FLAGS, "--ckpt-format", ckpt_format, "--save", str(parts),
                                "--resume", "auto"]) == 0


def _files_carry_the_pickle(run_dir) -> bool:
    return any(MARKER in path.read_bytes() for path in run_dir.rglob("*") if path.is_file())


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_resume_never_unpickles_te_extra_state(tmp_path, te_like_linears, uninterrupted,
                                                  ckpt_format):
    """Before the fix: torch_dist wrote the pickle and its load unpickled it; the torch
    format put each live module's own pickle back through `set_extra_state`."""
    parts = tmp_path / "parts"
    _stop_at_3(parts, ckpt_format)
    assert not _files_carry_the_pickle(parts)
    _resume(parts, ckpt_format)
    assert UNPICKLED == []
    assert train_losses(parts) == uninterrupted[ckpt_format]


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_checkpoint_carrying_te_pickles_resumes_without_unpickling_them(
        tmp_path, monkeypatch, te_like_linears, uninterrupted, ckpt_format):
    """A checkpoint whose files hold TE's pickled extra state (written as TE 2.9 and the
    earlier code write it, or crafted) is read with the pickle left unread."""
    from megatron_gnmr.training import resume
    from megatron_gnmr.checkpoints.torch_dist import te_extra_state

    parts = tmp_path / "parts"
    with monkeypatch.context() as as_before:
        as_before.setattr(te_extra_state, "written_empty", lambda sharded: sharded)
        as_before.setattr(resume, "model_state", lambda chunk: chunk.state_dict())
        _stop_at_3(parts, ckpt_format)
    assert _files_carry_the_pickle(parts)
    _resume(parts, ckpt_format)
    assert UNPICKLED == []
    assert train_losses(parts) == uninterrupted[ckpt_format]


def test_the_fake_is_te_unpickling():
    """The tripwire fires through the fake's `set_extra_state` as through TE 2.9's (so the
    tests above would see an unpickling), and TE's empty marker passes untouched."""
    from megatron_gnmr.checkpoints.torch_dist.te_extra_state import no_fp8_state

    UNPICKLED.clear()
    _set_extra_state(None, no_fp8_state())
    assert UNPICKLED == []
    _set_extra_state(None, _get_extra_state(None))
    assert UNPICKLED == [MARKER]
    UNPICKLED.clear()
