"""Megatron's precision config (--te-precision-config-file): our reader agrees with
megatron-core's own matcher (ordered, enabled only, first match wins), `calibrate` writes one
that both read back, and a run keeps exactly the configured units in high precision."""

import json

import numpy as np
import pytest

from megatron_gnmr.controller.calibrate import rank_units, units_for_budget
from megatron_gnmr.controller.trace import read_trace
from megatron_gnmr.controller.units import canonical_unit_names
from megatron_gnmr.errors import UserError
from megatron_gnmr.precision import precision_config_file as pcf
from tests.helpers import TINY, run_pretrain, train_losses

UNITS = canonical_unit_names(2) + canonical_unit_names(1, num_experts=2)[2:]  # + experts
HAND_WRITTEN = """
configs:
  bf16:
    transformer_engine_config_type: TEQuantizationParams
    training_recipe: {}
  fp8:
    transformer_engine_config_type: TEQuantizationParams
    training_recipe:
      fp8_quantization_recipe: tensorwise
matchers:
  qkv_off:                # disabled: skipped
    config: bf16
    type: glob
    pattern: "*linear_qkv"
    enabled: false
  layer1_fp8:             # first match wins: layer 1's fc2 stays quantized
    config: fp8
    type: glob
    pattern: "*layers.1.*"
    enabled: true
  fc2_bf16:
    config: bf16
    type: glob
    pattern: "*linear_fc2"
    enabled: true
  expert1_bf16:
    config: bf16
    type: glob
    pattern: "*experts.local_experts.1.*"
    enabled: true
"""


def _megatron_choice(path, unit):
    """megatron-core's own reading of the file (quantization/quant_config.py)."""
    from megatron.core.quantization.quant_config import MatchContext, RecipeConfig

    recipe = RecipeConfig.from_yaml_file(str(path))
    key = recipe.match_to_config_key(MatchContext(pcf.module_path(unit), None))
    return key is not None and recipe.configs[key]["training_recipe"] == {}


def test_reader_matches_megatron_s_matcher(tmp_path):
    path = tmp_path / "precision.yaml"
    path.write_text(HAND_WRITTEN)
    chosen = pcf.high_precision_units(str(path), UNITS)
    assert chosen == ["layers.0.mlp.linear_fc2", "layers.0.mlp.experts.0.linear_fc2",
                      "layers.0.mlp.experts.1.linear_fc1", "layers.0.mlp.experts.1.linear_fc2"]
    assert chosen == [unit for unit in UNITS if _megatron_choice(path, unit)]


def test_written_file_is_read_back_by_both(tmp_path):
    path = tmp_path / "calibrated.yaml"
    keep = ["layers.1.self_attention.linear_proj", "layers.0.mlp.experts.0.linear_fc2"]
    pcf.write(str(path), keep, note="a note\non two lines")
    assert path.read_text().startswith("# a note\n# on two lines\n")
    assert pcf.high_precision_units(str(path), UNITS) == sorted(keep, key=UNITS.index)
    assert [unit for unit in UNITS if _megatron_choice(path, unit)] == \
        sorted(keep, key=UNITS.index)


@pytest.mark.parametrize("text, message", [
    ("matchers: [1, 2]", "mappings"),
    ("configs: {}\nmatchers:\n  m: {type: regex, pattern: x, config: a, enabled: true}",
     "glob only"),
    ("configs: {a: {}}\nmatchers:\n  m: {type: glob, pattern: x, config: b, enabled: true}",
     "config"),
    ("configs: [", "not valid YAML"),
])
def test_bad_files_are_refused_by_name(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        pcf.matchers(str(path))


def _trace(tmp_path, oracle_rows):
    lines = [{"type": "header", "format": 2, "units": UNITS[:4], "config": {},
              "signal_settings": {}}]
    lines += [{"step": step, "norms": [1.0] * 4, "recovery": [], "oracle": row}
              for step, row in enumerate(oracle_rows, start=1)]
    (tmp_path / "gnmr_trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return read_trace(str(tmp_path / "gnmr_trace.jsonl"))


def test_calibrate_ranks_by_mean_damage_and_rounds_the_budget(tmp_path):
    trace = _trace(tmp_path, [[0.1, 0.5, 0.2, None], [0.3, 0.1, 0.2, 0.9]])  # NaN skipped
    measure, ranked = rank_units(trace)
    assert measure == "oracle"
    assert [unit for unit, _ in ranked] == [UNITS[3], UNITS[1], UNITS[0], UNITS[2]]
    assert ranked[0][1] == pytest.approx(0.9) and ranked[1][1] == pytest.approx(0.3)
    assert units_for_budget(ranked, 0.3) == [UNITS[3]]  # 1.2 units -> 1
    assert units_for_budget(ranked, 0.4) == [UNITS[3], UNITS[1]]  # 1.6 -> 2
    assert units_for_budget(ranked, 0.01) == [UNITS[3]]  # at least one


def test_a_run_keeps_the_configured_units_in_high_precision(tmp_path):
    """fp8-emulated with every unit kept in BF16 by the file trains exactly like the same
    recipe with --precision-static recovery; keeping one unit changes the run."""
    common = [*TINY, "--train-iters", "4", "--eval-interval", "4", "--precision-recipe",
              "fp8-emulated"]
    everything = tmp_path / "all.yaml"
    pcf.write(str(everything), canonical_unit_names(2))
    one = tmp_path / "one.yaml"
    pcf.write(str(one), ["layers.1.mlp.linear_fc2"])
    runs = {name: tmp_path / name for name in ("file_all", "static", "file_one", "low")}
    run_pretrain([*common, "--precision-config-file", str(everything),
                  "--save", str(runs["file_all"])])
    run_pretrain([*common, "--precision-static", "recovery", "--save", str(runs["static"])])
    run_pretrain([*common, "--precision-config-file", str(one), "--save", str(runs["file_one"])])
    run_pretrain([*common, "--save", str(runs["low"])])
    losses = {name: train_losses(path) for name, path in runs.items()}
    assert losses["file_all"] == losses["static"]
    assert losses["file_one"] != losses["low"] and losses["file_one"] != losses["static"]
    start = [json.loads(line) for line in (runs["file_one"] / "metrics.jsonl").open()
             if '"start"' in line][0]
    assert start["kept_in_bf16"] == 1
    assert np.isfinite(list(losses["file_one"].values())).all()


def test_calibrate_command_writes_the_config(tmp_path, capsys):
    from megatron_gnmr.cli import main

    _trace(tmp_path, [[0.1, 0.5, 0.2, 0.0], [0.3, 0.3, 0.2, 0.0]])
    main(["calibrate", str(tmp_path), "--budget", "0.5"])
    out = tmp_path / "precision_config.yaml"
    assert pcf.high_precision_units(str(out), UNITS[:4]) == [UNITS[0], UNITS[1]]
    assert "keeping 2 (50.0%) in BF16" in capsys.readouterr().out
