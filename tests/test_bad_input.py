"""Every user mistake: exit status 2, one `error:` line naming the input, no traceback,
nothing written into --save."""

import shutil
from pathlib import Path

import pytest

from tests.helpers import REPO, TINY, run_pretrain

DATA = REPO / ".cache" / "megatron_gnmr" / "shakespeare-v4096"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    (root / "unknown_key.yaml").write_text("model:\n  num_layer: 2\n")
    (root / "unknown_section.yaml").write_text("modle:\n  num_layers: 2\n")
    (root / "wrong_type.yaml").write_text("model:\n  num_layers: two\n")
    (root / "not_yaml.yaml").write_text("model: [unclosed\n")
    corrupt = root / "corrupt"
    corrupt.mkdir()
    shutil.copy(DATA / "text_document.bin", corrupt / "text_document.bin")
    shutil.copy(DATA / "tokenizer.model", corrupt / "tokenizer.model")
    (corrupt / "text_document.idx").write_bytes((DATA / "text_document.idx").read_bytes()[:200])
    run = root / "run"
    run_pretrain([*TINY, "--train-iters", "3", "--eval-interval", "100", "--gnmr",
                  "--save", str(run)])
    truncated = root / "truncated"
    shutil.copytree(run, truncated)
    shard = next((truncated / "checkpoints").glob("iter_*/rank_00000.pt"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return root


NO_SAVE = "<no --save>"
CASES = {
    # flag values
    "alpha_zero": (["--gnmr", "--gnmr-alpha", "0"], "--gnmr-alpha"),
    "negative_max_o": (["--gnmr", "--gnmr-max-o", "-1"], "--gnmr-max-o"),
    "delta_zero": (["--gnmr", "--gnmr-delta", "0"], "--gnmr-delta"),
    "warmup_too_short": (["--gnmr", "--gnmr-delta", "8", "--gnmr-warmup", "3"], "--gnmr-warmup"),
    "bad_nonfinite_mode": (["--gnmr-nonfinite", "ignore"], "--gnmr-nonfinite"),
    "units_bad_regex": (["--gnmr", "--gnmr-units", "("], "--gnmr-units"),
    "units_match_nothing": (["--gnmr", "--gnmr-units", "router"], "--gnmr-units"),
    "tp_not_dividing_heads": (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel"),
    "pp_not_dividing_layers": (["--pipeline-model-parallel-size", "3"], "--pipeline-model-par"),
    "tp_larger_than_world": (["--tensor-model-parallel-size", "2"], "processes"),
    "hidden_not_dividing_heads": (["--hidden-size", "66"], "--hidden-size"),
    "batch_not_multiple": (["--global-batch-size", "6"], "--global-batch-size"),
    "unknown_flag": (["--num-layerz", "2"], "--num-layerz"),
    "abbreviated_flag": (["--num-layer", "2"], "--num-layer"),
    "wrong_type_flag": (["--num-layers", "two"], "--num-layers"),
    "negative_lr": (["--lr", "-1"], "--lr"),
    "warmup_beyond_run": (["--lr-warmup-iters", "50", "--train-iters", "10"], "--lr-warmup"),
    "resume_without_save": (["--resume", "auto", NO_SAVE], "--resume"),
    "resume_bad_value": (["--resume", "latest", "--save", "{save}"], "--resume"),
    "unknown_recipe": (["--precision-recipe", "fp4-magic"], "--precision-recipe"),
    "te_without_te": (["--precision-recipe", "te-fp8"], "Transformer Engine"),
    "delayed_scaling": (["--precision-recipe", "fp8-emulated", "--fp8-recipe", "delayed"],
                        "--fp8-recipe delayed"),
    "act_quant_bits": (["--precision-recipe", "act-quant", "--act-quant-bits", "5"],
                       "--act-quant-bits"),
    "bad_static_path": (["--precision-static", "both"], "--precision-static"),
    "unknown_monitor": (["--monitors", "attention,loss"], "--monitors"),
    "router_without_moe": (["--monitors", "router"], "--num-experts"),
    "delta_above_interval": (["--monitors", "attention", "--monitor-interval", "5",
                              "--monitor-delta", "6"], "--monitor-delta"),
    "ep_not_dividing_experts": (["--num-experts", "3", "--expert-model-parallel-size", "2"],
                                "--expert-model-parallel-size"),
    "wandb_without_save": (["--wandb-project", "x", NO_SAVE], "--save"),
    "bad_wandb_mode": (["--wandb-mode", "cloud"], "--wandb-mode"),
    "inject_unknown_unit": (["--inject-nonfinite", "3:layers.9.mlp.linear_fc1"],
                            "--inject-nonfinite"),
    "unknown_signal": (["--gnmr", "--gnmr-signals", "gnmr,entropy"], "--gnmr-signals"),
    "qerr_without_emulation": (["--gnmr", "--gnmr-signals", "qerr"], "--precision-recipe"),
    "monitor_signal_without_monitors": (["--gnmr", "--gnmr-signals", "monitor"], "--monitors"),
    "budget_rate_above_one": (["--gnmr", "--gnmr-budget-rate", "2"], "--gnmr-budget-rate"),
    "unknown_detector": (["--monitors", "attention", "--monitor-detector", "cusum"],
                         "--monitor-detector"),
    "reference_not_a_run": (["--monitors", "attention", "--monitor-reference", "{root}"],
                            "--monitor-reference"),
    # files
    "missing_config": (["--config", "{root}/nope.yaml"], "nope.yaml"),
    "unknown_yaml_key": (["--config", "{root}/unknown_key.yaml"], "model.num_layer"),
    "unknown_yaml_section": (["--config", "{root}/unknown_section.yaml"], "modle"),
    "wrong_yaml_type": (["--config", "{root}/wrong_type.yaml"], "model.num_layers"),
    "invalid_yaml": (["--config", "{root}/not_yaml.yaml"], "not valid YAML"),
    "missing_data": (["--data-path", "{root}/missing/text_document"], "--data-path"),
    "corrupt_idx": (["--data-path", "{root}/corrupt/text_document"], "truncated"),
    "missing_checkpoint": (["--load", "{root}/no_run"], "--load"),
    "truncated_checkpoint": (["--load", "{root}/truncated"], "truncated"),
    "checkpoint_other_shape": (["--load", "{root}/run", "--hidden-size", "128"], "model"),
    "checkpoint_other_units": (["--load", "{root}/run", "--gnmr", "--gnmr-units", "fc2"],
                               "--gnmr-units"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_exits_2_with_one_line(files, tmp_path, name):
    args, needle = CASES[name]
    save = tmp_path / "save"
    args = [a.format(root=files, save=save) for a in args]
    if NO_SAVE in args:
        args.remove(NO_SAVE)
    elif "--save" not in args:
        args += ["--save", str(save)]
    result = run_pretrain([*TINY, "--train-iters", "4", *args], check=False, timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(errors) == 1 and needle in errors[0], result.stderr[-2000:]
    print(f"\n{name}: {errors[0]}")  # `pytest -s` lists what each mistake is told
    assert "Traceback" not in result.stderr + result.stdout
    assert not save.exists() or not any(save.iterdir()), f"{name} wrote into --save"
