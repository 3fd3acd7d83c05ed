"""The logging and backend flags copied Megatron-LM scripts carry, with Megatron-LM's meaning:
`--distributed-backend nccl` (gloo where there is no GPU, said once), `--timing-log-level`,
`--tensorboard-log-interval` (TensorBoard and W&B every N steps, the console every
--log-interval), and `--log-throughput` / `--log-params-norm` printed on the console line as
Megatron-LM's `training_log` prints them."""

import io

import pytest

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.errors import UserError
from megatron_gnmr.observe import loggers
from tests.helpers import TINY, run_pretrain

COPIED = ["--distributed-backend", "nccl", "--timing-log-level", "1",
          "--tensorboard-log-interval", "5", "--log-throughput", "--log-params-norm"]


def test_the_copied_flags_are_accepted():
    config = parse_config(COPIED, announce=False)
    assert config.parallel.distributed_backend == "nccl"
    assert config.logging.timing_log_level == 1 and config.logging.tensorboard_log_interval == 5
    assert config.housekeeping.log_throughput and config.logging.log_params_norm


def test_nccl_without_a_gpu_is_said_once_as_gloo(capsys, monkeypatch):
    from megatron_gnmr.platform import device

    monkeypatch.setattr(device, "has_accelerator", lambda: False)
    parse_config(COPIED)
    said = [line for line in capsys.readouterr().err.splitlines() if "notice:" in line]
    assert sum("no GPU, so the collectives run on gloo" in line for line in said) == 1
    assert sum("--timing-log-level 1: the step time is logged" in line for line in said) == 1
    parse_config(["--timing-log-level", "0"])  # level 0 is the step time: nothing to say
    assert "timing" not in capsys.readouterr().err
    monkeypatch.setattr(device, "has_accelerator", lambda: True)  # NCCL runs: nothing to say
    parse_config(COPIED)
    assert "gloo" not in capsys.readouterr().err


def test_gloo_on_a_gpu_machine_is_refused_by_name(monkeypatch):
    from megatron_gnmr.platform import device
    from megatron_gnmr.validation import validate_layout

    monkeypatch.setattr(device, "has_accelerator", lambda: True)
    with pytest.raises(UserError, match="--distributed-backend gloo"):
        validate_layout(parse_config(["--distributed-backend", "gloo"], announce=False), 1)
    validate_layout(parse_config(["--distributed-backend", "nccl"], announce=False), 1)


def test_each_logger_keeps_its_interval(monkeypatch, tmp_path):
    """Steps 1-12, --log-interval 4, --tensorboard-log-interval 5: the console and
    metrics.jsonl at 4, 8, 12 (the last), TensorBoard at 5, 10, 12; a validation record at
    step 6 reaches all three."""
    from megatron_gnmr.observe import tensorboard_logger

    written = []

    class FakeTensorBoard:
        def __init__(self, *args, **kwargs):
            pass

        def log(self, step, metrics):
            written.append(step)

        def close(self):
            pass

    monkeypatch.setattr(tensorboard_logger, "TensorBoardLogger", FakeTensorBoard)
    config = parse_config(["--train-iters", "12", "--log-interval", "4",
                           "--tensorboard-log-interval", "5", "--tensorboard-dir",
                           str(tmp_path / "tb")], announce=False)
    stream = io.StringIO()
    monkeypatch.setattr("sys.stdout", stream)
    logger = loggers.build_loggers(config, str(tmp_path / "run"), rank=0)
    for step in range(1, 13):
        logger.log(step, {"train/loss": 1.0, "train/lr": 1e-3})
        if step == 6:
            logger.log(step, {"valid/loss": 2.0, "valid/ppl": 7.4})
    logger.close()
    assert written == [5, 6, 10, 12]
    console = [line.split("/")[0] for line in stream.getvalue().splitlines()
               if line.startswith("step")]
    assert console == ["step  4", "step  8", "step 12"]
    jsonl = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [line.split(",")[0] for line in jsonl] == \
        ['{"step": 4', '{"step": 6', '{"step": 8', '{"step": 12']


def test_the_console_line_prints_megatron_lms_statistics():
    stream = io.StringIO()
    loggers.ConsoleLogger(10, stream=stream).log(3, {
        "train/loss": 2.5, "train/tflops_per_device": 12.345, "train/params_norm": 123.45678,
        "train/num_zeros_in_grad": 7})
    line = stream.getvalue()
    # Megatron-LM: f' throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |',
    # f' num zeros: {num_zeros_in_grad} |', f' params norm: {params_norm:.3f} |'
    for shown in ("throughput per GPU (TFLOP/s/GPU): 12.3", "num zeros: 7",
                  "params norm: 123.457"):
        assert shown in line, line


def test_a_run_with_the_flags_prints_them_on_its_progress_lines(tmp_path):
    result = run_pretrain([*TINY, *COPIED, "--train-iters", "3", "--eval-interval", "100",
                           "--save", str(tmp_path / "run")])
    lines = [line for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(lines) == 3, result.stdout  # TINY's --log-interval 1
    for line in lines:
        assert "throughput per GPU (TFLOP/s/GPU): " in line and "params norm: " in line, line
