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
    ("configs: {a: {}}\nmatchers:\n  m: {type: glob, pattern: '*', config: b, enabled: true}",
     "config"),
    ("configs: [", "not valid YAML"),
])
def test_bad_files_are_refused_by_name(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        pcf.high_precision_units(str(path), UNITS)


TE = "transformer_engine_config_type: TEQuantizationParams"
BF16_ONLY_OPTIONS = f"""
configs:
  options_only: {{{TE}, training_recipe: {{tp_only_amax_red: true}}}}
  keep_context: {{{TE}, training_recipe: {{override_quantized_autocast: false}}}}
  fp8: {{{TE}, training_recipe: {{fp8_quantization_recipe: blockwise}},
         evaluation_recipe: {{}}}}
  unused_and_broken: {{training_recipe: {{nonsense: 1}}}}
matchers:
  attention: {{config: options_only, type: glob, pattern: "*self_attention*", enabled: true}}
  fc1: {{config: keep_context, type: glob, pattern: "*linear_fc1", enabled: true}}
  rest: {{config: fp8, type: glob, pattern: "*", enabled: 1}}
  never: {{config: unused_and_broken, type: glob, pattern: "*", enabled: false}}
"""
ONE_MATCHER = "configs:\n  c: {{{config}}}\nmatchers:\n  m: {{{matcher}}}\n"
EVERY = "config: c, type: glob, pattern: '*', enabled: true"
FILES = {  # name -> text; every kind of file megatron's format document allows or forbids
    "hand_written": HAND_WRITTEN,
    "options_only_is_bf16": BF16_ONLY_OPTIONS,
    **{name: ONE_MATCHER.format(config=config, matcher=EVERY) for name, config in {
        "bf16": f"{TE}, training_recipe: {{}}",
        "unknown_recipe_key": f"{TE}, training_recipe: {{fp8_recipe: tensorwise}}",
        "unknown_recipe_name": f"{TE}, training_recipe: {{fp8_quantization_recipe: fp9}}",
        "unknown_fp4_name": f"{TE}, training_recipe: {{fp4_quantization_recipe: mxfp4}}",
        "delayed": f"{TE}, training_recipe: {{fp8_quantization_recipe: delayed}}",
        "fp8_and_fp4": f"{TE}, training_recipe: {{fp8_quantization_recipe: mxfp8, "
                       "fp4_quantization_recipe: nvfp4}",
        "custom_without_factory": f"{TE}, training_recipe: {{fp8_quantization_recipe: custom}}",
        "bad_fp8_format": f"{TE}, training_recipe: {{fp8_quantization_recipe: tensorwise, "
                          "fp8_format: e5m2}",
        "no_training_recipe": TE,
        "no_config_type": "training_recipe: {}",
        "unknown_config_type": "transformer_engine_config_type: Kitchen, training_recipe: {}",
        "extra_config_key": f"{TE}, training_recipe: {{}}, serving_recipe: {{}}",
        "bad_evaluation_recipe": f"{TE}, training_recipe: {{}}, evaluation_recipe: {{x: 1}}",
        "recipe_not_a_mapping": f"{TE}, training_recipe: fp8",
    }.items()},
    **{name: ONE_MATCHER.format(config=f"{TE}, training_recipe: {{}}", matcher=matcher)
       for name, matcher in {
           "matcher_without_type": "config: c, pattern: '*', enabled: true",
           "matcher_regex": "config: c, type: regex, pattern: '.*', enabled: true",
           "matcher_without_pattern": "config: c, type: glob, enabled: true",
           "matcher_unknown_config": "config: d, type: glob, pattern: '*', enabled: true",
           "disabled_broken_matcher": "type: regex, enabled: false",
       }.items()},
    "configs_not_mappings": "configs:\n  c: [1]\nmatchers:\n  m: {" + EVERY + "}\n",
}


def _megatron_forward_checks(recipe) -> None:
    """What megatron's `_get_fp8_autocast_for_quant_recipe` checks at the first forward (it
    needs Transformer Engine, absent here), transcribed from its source (0.16.1 = 0.19.2)."""
    if recipe is None or "custom" in (recipe.fp8_quantization_recipe,
                                      recipe.fp4_quantization_recipe):
        return
    if recipe.fp8_quantization_recipe is not None:
        if recipe.fp8_format not in ("e4m3", "hybrid"):
            raise ValueError(f"Unhandled fp8_format {recipe.fp8_format}")
        if recipe.fp8_quantization_recipe not in ("tensorwise", "blockwise", "mxfp8"):
            raise ValueError("Unhandled fp8 recipe")
    elif recipe.fp4_quantization_recipe not in (None, "nvfp4"):
        raise ValueError("Unhandled fp4 recipe")


def megatron_reading(path, units) -> list[str] | None:
    """megatron-core's own reader on a file: the units its modules run in BF16 inside the
    run's FP8 autocast, or None if it refuses the file (at load, build or first forward)."""
    from megatron.core.extensions.transformer_engine import (
        TEQuantizationParams,
        _get_should_context_be_quantized_params,
    )
    from megatron.core.quantization.quant_config import RecipeConfig
    from megatron.core.quantization.utils import get_quant_config_or_none

    try:
        recipe = RecipeConfig.from_yaml_file(str(path))
        kept = []
        for unit in units:
            matched = get_quant_config_or_none(pcf.module_path(unit), recipe)
            params = TEQuantizationParams.parse_from_config(matched) if matched else None
            if params is not None:
                _megatron_forward_checks(params.training_recipe)
                _megatron_forward_checks(params.evaluation_recipe)
            if not _get_should_context_be_quantized_params(params, True, True):
                kept.append(unit)
        return kept
    except Exception:  # noqa: BLE001 (any refusal: assert, KeyError, TypeError, ValueError)
        return None


def our_reading(path, units) -> list[str] | None:
    try:
        return pcf.high_precision_units(str(path), units)
    except UserError as error:
        message = str(error)
        assert "\n" not in message and str(path) in message, message  # one line, the file
        return None


@pytest.mark.parametrize("name", sorted(FILES))
def test_our_reader_and_megatron_s_agree_on_every_file(tmp_path, name):
    path = tmp_path / f"{name}.yaml"
    path.write_text(FILES[name])
    ours, theirs = our_reading(path, UNITS), megatron_reading(path, UNITS)
    assert ours == theirs, (ours, theirs)


def test_the_kinds_of_files_are_both_accepted_and_refused(tmp_path):
    """The comparison above means something: both verdicts occur, and a config with options
    but no quantization recipe is BF16 (megatron's rule), unless it keeps the context."""
    verdicts = {}
    for name, text in FILES.items():
        (tmp_path / f"{name}.yaml").write_text(text)
        verdicts[name] = megatron_reading(tmp_path / f"{name}.yaml", UNITS)
    assert sum(v is None for v in verdicts.values()) >= 15
    assert verdicts["options_only_is_bf16"] == [u for u in UNITS if "self_attention" in u]
    assert verdicts["disabled_broken_matcher"] == []


def test_a_binary_file_is_refused_in_one_line(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(UserError, match="not a text file"):
        pcf.high_precision_units(str(path), UNITS)


def _trace(tmp_path, oracle_rows, loss_cost_rows=None):
    lines = [{"type": "header", "format": 2, "units": UNITS[:4], "config": {},
              "signal_settings": {}}]
    lines += [{"step": step, "norms": [1.0] * 4, "recovery": [], "oracle": row,
               **({"loss_cost": loss_cost_rows[step - 1]} if loss_cost_rows else {})}
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


def test_calibrate_prefers_the_loss_cost_and_takes_the_measure_asked_for(tmp_path):
    """A trace with the first-order loss cost ranks by it (signed: a unit whose rounding
    lowers the loss ranks last); --measure picks another recorded one; an unrecorded one is
    refused by name."""
    trace = _trace(tmp_path, [[0.1, 0.5, 0.2, 0.9]] * 2,
                   loss_cost_rows=[[0.02, -0.01, 0.05, 0.0], [0.04, -0.03, 0.01, 0.0]])
    measure, ranked = rank_units(trace)
    assert measure == "loss_cost"
    assert [unit for unit, _ in ranked] == [UNITS[2], UNITS[0], UNITS[3], UNITS[1]]
    assert ranked[0][1] == pytest.approx(0.03) and ranked[-1][1] == pytest.approx(-0.02)
    assert rank_units(trace, "oracle")[1][0][0] == UNITS[3]
    with pytest.raises(UserError, match="no measured qerr values; record them with --gnmr "
                       "--gnmr-measure qerr"):
        rank_units(trace, "qerr")


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
    assert start["kept_in_bf16"] == ["layers.1.mlp.linear_fc2"]
    assert np.isfinite(list(losses["file_one"].values())).all()


def test_calibrate_command_writes_the_config(tmp_path, capsys):
    from megatron_gnmr.cli import main

    _trace(tmp_path, [[0.1, 0.5, 0.2, 0.0], [0.3, 0.3, 0.2, 0.0]])
    main(["calibrate", str(tmp_path), "--budget", "0.5", "--budget-in", "units"])
    out = tmp_path / "precision_config.yaml"
    assert pcf.high_precision_units(str(out), UNITS[:4]) == [UNITS[0], UNITS[1]]
    assert "keeping 2 (50.0% of the units) in BF16" in capsys.readouterr().out


@pytest.mark.parametrize("gemms, kept", [("fprop,dgrad,wgrad", [0, 1]), ("wgrad", [0, 1, 2])])
def test_calibrate_fills_a_flop_budget_by_damage(tmp_path, capsys, gemms, kept):
    """2 layers x 64, ffn 176, 4 heads, 2 groups: by hand a layer's qkv, proj, fc1, fc2 are
    8192, 4096, 22528, 11264 MACs per token, so of the whole model 8.9%, 4.4%, 24.4% and
    12.2% (a third of that for their wgrad alone). Damage ranks proj, qkv, fc1, fc2; 15% of
    the FLOPs buys proj + qkv (13.3%; fc1 and fc2 do not fit), or with wgrad alone proj, qkv
    and fc1 (12.6%; fc2 would make 16.7%)."""
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.cli import main

    config = parse_config(["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size",
                           "176", "--num-attention-heads", "4", "--num-query-groups", "2"])
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    _trace(tmp_path, [[0.1, 0.5, 0.2, 0.0], [0.3, 0.3, 0.2, 0.0]])
    main(["calibrate", str(tmp_path), "--budget", "0.15", "--gemms", gemms])
    out = tmp_path / "precision_config.yaml"
    assert pcf.high_precision_units(str(out), UNITS[:4]) == [UNITS[i] for i in kept]
    share = "13.3%" if len(kept) == 2 else "12.6%"
    assert f"keeping {len(kept)} ({share} of the flops)" in capsys.readouterr().out


def test_calibrate_keeps_the_first_layers_first(tmp_path):
    """--first-layers 1: layer 1's units come only after all of layer 0's, whatever their
    damage (units budget: 6 of the 8 units of 2 layers)."""
    from megatron_gnmr.cli import main

    units = canonical_unit_names(2)
    lines = [{"type": "header", "format": 2, "units": units, "config": {},
              "signal_settings": {}},
             {"step": 1, "norms": [1.0] * 8, "recovery": [],
              "oracle": [0.1, 0.2, 0.3, 0.4, 0.9, 0.8, 0.7, 0.6]}]
    (tmp_path / "gnmr_trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    main(["calibrate", str(tmp_path), "--budget", "0.75", "--budget-in", "units",
          "--first-layers", "1"])
    kept = pcf.high_precision_units(str(tmp_path / "precision_config.yaml"), units)
    assert kept == units[:4] + [units[4], units[5]]
    main(["calibrate", str(tmp_path), "--budget", "0.5", "--budget-in", "units"])
    assert pcf.high_precision_units(str(tmp_path / "precision_config.yaml"), units) == units[4:]
