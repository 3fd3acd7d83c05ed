"""Llama 3.1's RoPE frequency scaling from Megatron-LM's own flags (`--use-rope-scaling
--rope-scaling-factor F`), as `--help`, the Hugging Face guide and `import-hf`'s model.yaml
use it: the model built from the command line holds Llama 3's scaled frequencies, computed
here by hand in float64."""

import math

import numpy as np
import pytest

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.errors import UserError

HEAD = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32"]


def llama3_inv_freq(head_dim: int, base: float, factor: float) -> np.ndarray:
    """Meta's Llama 3.1 `apply_scaling` (its bands: low/high frequency factors 1 and 4 over an
    8,192-token original context), in float64."""
    low, high, original = 1.0, 4.0, 8192
    inv = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for freq in inv:
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(freq)
        elif wavelength > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.fixture
def world_of_one():
    from megatron.core import parallel_state

    from megatron_gnmr.training import distributed

    yield lambda config: (distributed.initialize(config), distributed.set_seeds(1))
    parallel_state.destroy_model_parallel()
    distributed.shutdown()


def test_the_flags_are_accepted_as_megatron_lm_spells_them():
    config = parse_config([*HEAD, "--use-rope-scaling", "--rope-scaling-factor", "32"],
                          announce=False)
    assert config.model.use_rope_scaling and config.model.rope_scaling_factor == 32.0
    assert not parse_config(HEAD, announce=False).model.use_rope_scaling


def test_the_model_built_from_the_flags_holds_llama3s_frequencies(world_of_one):
    from megatron_gnmr.model import build_model, unwrap

    config = parse_config([*HEAD, "--use-rope-scaling", "--rope-scaling-factor", "8"],
                          announce=False)
    world_of_one(config)
    model = unwrap(build_model(config, config.data.vocab_size, for_training=False)[0])
    ours = model.rotary_pos_emb.inv_freq.double().numpy()
    expected = llama3_inv_freq(16, 10000.0, 8.0)  # head 64 / 4 = 16: all three bands
    plain = llama3_inv_freq(16, 10000.0, 1.0)
    assert (expected != plain).sum() >= 2  # the low and middle bands are scaled
    np.testing.assert_allclose(ours, expected, rtol=1e-6)


def test_the_scaling_is_refused_where_the_family_cannot_build_it():
    from megatron_gnmr.validation import validate_model

    with pytest.raises(UserError, match="--use-rope-scaling"):
        validate_model(parse_config([*HEAD, "--model-family", "deepseek-mla",
                                     "--use-rope-scaling"], announce=False))
