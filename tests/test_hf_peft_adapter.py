"""A LoRA run exported as a PEFT adapter, judged by PEFT and transformers: the exported base with
the adapter applied by `peft.PeftModel` gives the logits of the same run merged by
`merge-lora` and exported (merge-lora's W + s B A, in float64, is checked against the live
LoRA model in tests/test_lora.py). Bound: tests/test_hf_interop.py's (float32 rounding of
the same arithmetic in another order). The adapter must matter: merged and base logits
differ by far more than the bound, so a wrong split of a fused linear's B, a swapped
gate/up or a wrong scale cannot pass. TP 2: tests/distributed/test_hf_interop_tp.py.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import pretrain_in_process
from tests.test_hf_interop import BOUND, FAST, cli, relative_gap, tokens

pytest.importorskip("transformers", reason="transformers is a test dependency "
                    "(pip install -e .[dev])")
pytest.importorskip("peft", reason="peft is a test dependency (pip install -e .[dev])")

# A large learning rate, so that three steps move the adapters' B well away from zero.
LORA = ["--train-iters", "3", "--finetune", "--lora", "--lora-dim", "4", "--lora-alpha", "8",
        "--lr", "5e-2"]


def peft_logits(base: Path, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_gnmr.interop.hf import judge

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)).float(),
                                      str(adapter))
    return judge.logits(model.eval(), ids)


def check_adapter_against_merged(root: Path, lora_run: Path, tag: str) -> None:
    """merge-lora + export-hf of `lora_run` vs the base export + export-hf --adapter, both in
    the runs' own dtype (no --dtype: float32 here, as the adapters were trained)."""
    from safetensors.torch import load_file

    from megatron_gnmr.interop.hf import judge

    adapter, merged_hf = root / f"{tag}_adapter", root / f"{tag}_merged_hf"
    assert cli("export-hf", str(lora_run), str(adapter), "--adapter",
               "--base-model", str(root / "hf")) == 0
    assert cli("export-hf", str(root / f"{tag}_merged"), str(merged_hf)) == 0
    assert {t.dtype for t in load_file(str(adapter / "adapter_model.safetensors")).values()} \
        == {torch.float32}
    ids = tokens(4096)
    merged = judge.logits(judge.load(merged_hf), ids)
    gap = relative_gap(peft_logits(root / "hf", adapter, ids), merged)
    moved = relative_gap(judge.logits(judge.load(root / "hf"), ids), merged)
    print(f"\n{tag}: PEFT adapter vs merged: {gap:.2e}; base vs merged: {moved:.2e}")
    assert gap <= BOUND
    assert moved >= 1000 * BOUND  # the adapter matters: the bound bites
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(root / "hf")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    assert pretrain_in_process([*FAST, "--train-iters", "4", "--save", str(root / "run")]) == 0
    assert cli("export-hf", str(root / "run"), str(root / "hf"), "--dtype", "fp32") == 0
    return root


@pytest.mark.parametrize("targets", [[], ["linear_qkv", "*.layers.1.*.linear_fc1"]],
                         ids=["every_linear", "qkv_and_one_layers_fc1"])
def test_a_peft_adapter_gives_the_merged_runs_logits(base, targets):
    tag = "all" if not targets else "some"
    run = base / f"{tag}_lora"
    extra = ["--lora-target-modules", *targets] if targets else []
    assert pretrain_in_process([*FAST, *LORA, *extra, "--load", str(base / "run"),
                                "--save", str(run)]) == 0
    assert cli("merge-lora", str(run), "--out", str(base / f"{tag}_merged")) == 0
    check_adapter_against_merged(base, run, tag)
    modules = json.loads((base / f"{tag}_adapter" / "adapter_config.json").read_text())[
        "target_modules"]
    expected = 2 * (3 + 1 + 2 + 1) if not targets else 2 * 3 + 2  # layers x projections
    assert len(modules) == expected, modules


def test_an_adapter_of_a_run_without_lora_is_refused(base, tmp_path, capfd):
    assert cli("export-hf", str(base / "run"), str(tmp_path / "out"), "--adapter") == 2
    assert "not a LoRA run" in capfd.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("defect", ["gate_up_swapped", "b_scaled"])
def test_a_planted_defect_in_the_adapter_breaks_the_bound(base, defect, tmp_path):
    """The judge can fail: the every-linear run's adapter with fc1's gate and up B swapped
    (what a wrong split of the fused [gate; up] linear gives), or every B scaled by 1.5 (a
    wrong alpha / r), is far outside the bound against the merged run."""
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron_gnmr.interop.hf import judge

    run = base / "all_lora"
    if not (base / "all_adapter").exists():  # run alone: make what the test above makes
        assert pretrain_in_process([*FAST, *LORA, "--load", str(base / "run"),
                                    "--save", str(run)]) == 0
        assert cli("merge-lora", str(run), "--out", str(base / "all_merged")) == 0
        check_adapter_against_merged(base, run, "all")
    planted = tmp_path / "planted"
    shutil.copytree(base / "all_adapter", planted)
    weights = load_file(str(planted / "adapter_model.safetensors"))
    if defect == "gate_up_swapped":
        gates = [k for k in weights if ".gate_proj.lora_B." in k]
        assert gates
        for gate in gates:
            up = gate.replace(".gate_proj.", ".up_proj.")
            weights[gate], weights[up] = weights[up], weights[gate]
    else:
        weights = {k: v * 1.5 if ".lora_B." in k else v for k, v in weights.items()}
    save_file(weights, str(planted / "adapter_model.safetensors"))
    ids = tokens(4096)
    merged = judge.logits(judge.load(base / "all_merged_hf"), ids)
    gap = relative_gap(peft_logits(base / "hf", planted, ids), merged)
    print(f"\n{defect}: planted adapter vs merged: {gap:.2e} (bound {BOUND:.0e})")
    assert gap > 100 * BOUND
