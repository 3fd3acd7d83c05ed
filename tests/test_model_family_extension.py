"""Adding a model family is one file and one registry line (docs/architecture.md's Qwen3
example, written and registered as a contributor would, then trained in this process: its
own module, so no other test's megatron world is up around it)."""

from tests.helpers import TINY

QWEN3 = '''
from megatron_gnmr.model_families.llama import Llama
from megatron_gnmr.platform import megatron_compat


class Qwen3(Llama):
    name = "qwen3"

    def transformer_config(self, config):
        config_class, fields = super().transformer_config(config)
        return config_class, {**fields, "qk_layernorm": True}

    def local_layer_spec(self, config, num_experts):
        return megatron_compat.local_layer_spec(num_experts, qk_layernorm=True)

    def te_layer_spec(self, config, num_experts):
        return megatron_compat.te_layer_spec(num_experts, qk_layernorm=True)


QWEN3 = Qwen3()
'''


def test_a_third_family_is_one_file_and_one_registry_line(tmp_path, monkeypatch):
    """docs/architecture.md's example, as a contributor would add it: it trains under an
    emulated recipe with the controller and the attention monitor, its query/key norms are
    built, its units are the linears."""
    import importlib.util

    from megatron_gnmr import model_families
    from tests.helpers import read_jsonl, run_pretrain, saved_weight_shapes

    (tmp_path / "qwen3.py").write_text(QWEN3)
    spec = importlib.util.spec_from_file_location("qwen3", tmp_path / "qwen3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(model_families.FAMILIES, "qwen3", module.QWEN3)
    run = tmp_path / "run"
    run_pretrain([*TINY, "--model-family", "qwen3", "--precision-recipe", "fp8-emulated",
                  "--gnmr", "--gnmr-warmup", "3", "--gnmr-delta", "2", "--monitors",
                  "attention", "--monitor-interval", "2", "--monitor-delta", "1",
                  "--train-iters", "4", "--eval-interval", "100", "--save", str(run)])
    units = read_jsonl(run / "gnmr_trace.jsonl")[0]["units"]
    assert units[:2] == ["layers.0.self_attention.linear_qkv",
                         "layers.0.self_attention.linear_proj"]
    assert any(key.startswith("monitor/attention/layer1/H_D2")
               for record in read_jsonl(run / "metrics.jsonl") for key in record)
    assert any("q_layernorm" in name for name in saved_weight_shapes(run))
