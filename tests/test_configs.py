"""Every shipped preset parses and validates for a launch that fits its layout, and flags
override YAML."""

from pathlib import Path

import pytest

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.validation import validate
from tests.helpers import REPO

PRESETS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_preset_is_valid(path: Path, tmp_path):
    config = parse_config(["--config", str(path), "--save", str(tmp_path)])
    p = config.parallel
    validate(config, world_size=p.tensor_model_parallel_size * p.pipeline_model_parallel_size
             * p.expert_model_parallel_size)  # EP is carved out of data parallelism


def test_flags_override_yaml():
    config = parse_config(["--config", str(REPO / "configs" / "tiny_cpu.yaml"),
                           "--num-layers", "4", "--gnmr-alpha", "3", "--gnmr"])
    assert config.model.num_layers == 4  # flag
    assert config.model.hidden_size == 128  # YAML
    assert config.gnmr.alpha == 3.0 and config.gnmr.enabled
    assert config.gnmr.max_o == 2  # YAML, kept an int (a count, not a fraction)


def test_a_negative_switch_turns_on_under_its_own_name():
    """A boolean field whose name is itself negative (`no_load_optim`) is turned on by its
    flag: argparse's --X/--no-X pair read `--no-load-optim` as the "no" form of a
    `--load-optim`, so the flag did nothing (found resuming with it). Every such field."""
    import dataclasses

    from megatron_gnmr.arguments import SECTIONS
    from megatron_gnmr.config import RunConfig, flag_name

    negative = [(section, field.name) for section in SECTIONS
                for field in dataclasses.fields(getattr(RunConfig(), section))
                if field.name.startswith("no_")]
    assert len(negative) >= 2
    for section, name in negative:
        config = parse_config([flag_name(section, name)])
        assert getattr(getattr(config, section), name) is True, name
    assert parse_config(["--gnmr", "--no-gnmr"]).gnmr.enabled is False  # the pair still works


def test_a_checkpoint_key_under_training_is_still_read_with_a_notice(tmp_path, capsys):
    """The checkpoint settings left `training:` for a section of their own; a YAML file (or a
    run's config.json) written before still reads, the YAML with a one-line notice."""
    from megatron_gnmr.config import RunConfig

    old = tmp_path / "old.yaml"
    old.write_text("training:\n  lr: 0.002\n  save_interval: 7\n  resume: auto\n")
    config = parse_config(["--config", str(old), "--save", str(tmp_path / "run")])
    assert config.checkpoint.save_interval == 7 and config.checkpoint.resume == "auto"
    assert config.training.lr == 0.002
    notices = [line for line in capsys.readouterr().err.splitlines() if "is read as" in line]
    assert len(notices) == 2 and "training.save_interval is read as checkpoint.save_interval" \
        in notices[0]
    before = RunConfig.from_dict({"training": {"save": "/runs/x", "lr": 0.5}})
    assert before.checkpoint.save == "/runs/x" and before.training.lr == 0.5
