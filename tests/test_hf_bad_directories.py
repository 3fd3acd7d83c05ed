"""Bad or hostile Hugging Face directories given to import-hf: each is refused with exit 2 and
one line naming the field or tensor and the file, with no traceback and nothing written (no
OUT, no OUT.partial). The damage is done to random models of transformers' own classes (a
Llama, a Mixtral, a DeepSeek-V3): config.json disagreeing with the weights both ways, fields
out of range or of the wrong type, shapes the fields do not make, weights that are not
floating point or not finite, and an index that names files outside the directory.

The reference for what a directory must hold is transformers itself:
`test_the_expected_weights_are_what_transformers_saves` holds every family's expected tensors
(names and shapes) equal to what transformers' `save_pretrained` writes for the same config.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_gnmr.limits import MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_SEQUENCE, MAX_WIDTH
from tests.test_hf_deepseek_v3 import random_deepseek_v3
from tests.test_hf_interop import cli, random_llama
from tests.test_hf_llama3 import LLAMA3, _random_mistral
from tests.test_hf_mixtral import random_mixtral

pytest.importorskip("transformers", reason="transformers is a test dependency "
                    "(pip install -e .[dev])")

MAKERS = {"llama": random_llama, "tied_llama": lambda d: random_llama(d, tie_word_embeddings=True),
          "llama3": lambda d: random_llama(d, rope_parameters={"rope_theta": 10000.0, **LLAMA3,
                                                         "factor": 8.0}),
          "mistral": _random_mistral, "mixtral": random_mixtral,
          "deepseek_v3": random_deepseek_v3,
          "deepseek_v3_no_query_latent": lambda d: random_deepseek_v3(d, q_lora_rank=None)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {name: make(root / name) for name, make in MAKERS.items()}


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_the_expected_weights_are_what_transformers_saves(sources, name):
    from safetensors.torch import load_file

    from megatron_gnmr.model_families import family_reading

    hf = json.loads((sources[name] / "config.json").read_text())
    mapping = family_reading(hf, "test").hf
    expected = dict(mapping.expected_weights(mapping.sections(hf, "test"), hf))
    saved = load_file(str(sources[name] / "model.safetensors"))
    assert {k: e.shape for k, e in expected.items()} == \
        {k: tuple(v.shape) for k, v in saved.items()}


def _config(**changes):
    def damage(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        for key, value in changes.items():
            if value is _DROP:
                config.pop(key, None)
            else:
                config[key] = value
        (directory / "config.json").write_text(json.dumps(config))
    return damage


def _rope(**changes):
    def damage(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        config["rope_parameters"] = {**config["rope_parameters"], **changes}
        (directory / "config.json").write_text(json.dumps(config))
    return damage


def _weights(change):
    def damage(directory: Path) -> None:
        from safetensors.torch import load_file, save_file

        weights = load_file(str(directory / "model.safetensors"))
        change(weights)
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return damage


def _text(name: str, text: str):
    return lambda directory: (directory / name).write_text(text)


def _split_in_two(overlap: bool):
    """The weights in two files with an index (one tensor in both, with `overlap`)."""
    def damage(directory: Path) -> None:
        from safetensors.torch import load_file, save_file

        weights = load_file(str(directory / "model.safetensors"))
        names = sorted(weights)
        first, second = names[: len(names) // 2], names[len(names) // 2:]
        if overlap:
            second = [first[0], *second]
        for file, part in (("a.safetensors", first), ("b.safetensors", second)):
            save_file({k: weights[k] for k in part}, str(directory / file),
                      metadata={"format": "pt"})
        (directory / "model.safetensors").unlink()
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {**dict.fromkeys(first, "a.safetensors"),
                            **dict.fromkeys(second, "b.safetensors")}}))
    return damage


def _bytes(name: str, data: bytes):
    return lambda directory: (directory / name).write_bytes(data)


def _sentencepiece_only(data: bytes | None):
    """tokenizer.json gone, and `data` as tokenizer.model (None: no tokenizer at all)."""
    def damage(directory: Path) -> None:
        (directory / "tokenizer.json").unlink()
        if data is not None:
            (directory / "tokenizer.model").write_bytes(data)
    return damage


def _index_naming(file: str):
    return _text("model.safetensors.index.json",
                 json.dumps({"weight_map": {"model.norm.weight": file}}))


_DROP = object()
L0 = "model.layers.0."
CASES = {  # name: (source, damage, what the one line must say)
    # config.json disagreeing with the weights
    "three_layers_declared_two_on_disk": (
        "llama", _config(num_hidden_layers=3), "no model.layers.2.self_attn.q_proj.weight, "
        "which the model config.json describes has (config.json's num_hidden_layers 3)"),
    "one_layer_declared_two_on_disk": ("llama", _config(num_hidden_layers=1),
                                       "config.json's num_hidden_layers 1"),
    "mistral_three_layers_declared": ("mistral", _config(num_hidden_layers=3),
                                      "config.json's num_hidden_layers 3"),
    "mixtral_three_layers_declared": ("mixtral", _config(num_hidden_layers=3),
                                      "config.json's num_hidden_layers 3"),
    "deepseek_four_layers_declared": ("deepseek_v3", _config(num_hidden_layers=4),
                                      "config.json's num_hidden_layers 4"),
    "deepseek_one_layer_declared_three_on_disk": (  # layer 1 its multi-token prediction's,
        "deepseek_v3", _config(num_hidden_layers=1),  # as transformers saves 1 of them; not 2
        "holds model.layers.2.input_layernorm.weight, which the model config.json describes has "
        "no place for (config.json's num_hidden_layers 1)"),
    "deepseek_heads_disagree": ("deepseek_v3", _config(num_attention_heads=3),
                                "config.json's num_attention_heads 3"),
    "mistral_heads_that_do_not_divide_the_width": (
        "mistral", _config(num_attention_heads=6, num_key_value_heads=3, head_dim=_DROP),
        "config.json's num_attention_heads 6 x head_dim 10"),
    "heads_that_do_not_divide_the_width": (
        "llama", _config(num_attention_heads=6, num_key_value_heads=2, head_dim=_DROP),
        "config.json's num_attention_heads 6 x head_dim 10"),
    "head_dim_disagrees": ("llama", _config(head_dim=8), "q_proj.weight in model.safetensors "
                           "has shape (64, 64)"),
    "vocab_size_disagrees": ("llama", _config(vocab_size=700),
                             "model.embed_tokens.weight in model.safetensors has shape"),
    "ffn_disagrees": ("llama", _config(intermediate_size=192), "intermediate_size 192"),
    "fewer_experts_declared": ("mixtral", _config(num_local_experts=3),
                               "block_sparse_moe.experts.3"),
    "deepseek_latent_disagrees": ("deepseek_v3", _config(kv_lora_rank=16),
                                  "kv_lora_rank 16"),
    "deepseek_query_latent_declared_but_absent": (
        "deepseek_v3_no_query_latent", _config(q_lora_rank=48),
        "no model.layers.0.self_attn.q_a_proj.weight, which the model config.json describes has "
        "(of shape (48, 64): config.json's q_lora_rank 48, hidden_size 64)"),
    # fields out of range or of the wrong type
    "negative_layer_count": ("llama", _config(num_hidden_layers=-2),
                             "num_hidden_layers -2: must be"),
    "nan_vocab_size": ("llama", _config(vocab_size=float("nan")),  # written as NaN
                       "vocab_size nan: must be a whole number"),
    "absurd_layer_count": ("llama", _config(num_hidden_layers=10 ** 9),
                           "must be from 1 to 4096"),
    "layer_count_as_text": ("llama", _config(num_hidden_layers="2"), "num_hidden_layers '2'"),
    "layer_count_as_float": ("llama", _config(num_hidden_layers=2.5), "num_hidden_layers 2.5"),
    "zero_heads": ("llama", _config(num_attention_heads=0), "num_attention_heads 0"),
    "key_value_heads_not_dividing": ("llama", _config(num_key_value_heads=3),
                                     "num_key_value_heads 3: must divide"),
    "more_key_value_heads_than_heads": ("llama", _config(num_key_value_heads=8),
                                        "num_key_value_heads 8"),
    "negative_norm_epsilon": ("llama", _config(rms_norm_eps=-1e-5), "rms_norm_eps -1e-05"),
    "no_intermediate_size": ("llama", _config(intermediate_size=_DROP),
                             "has no intermediate_size"),
    "zero_context": ("llama", _config(max_position_embeddings=0), "max_position_embeddings 0"),
    "infinite_rope_theta": ("llama", _rope(rope_theta=float("inf")), "rope_theta inf"),
    "fractional_rope_theta": ("llama", _rope(rope_theta=10000.5), "rope_theta 10000.5"),
    "rope_theta_past_an_integer": ("llama", _rope(rope_theta=1e30),  # OverflowError before
                                   "rope_theta 1e+30: must be at most 1e+12"),
    "rope_table_not_an_object": ("llama", _config(rope_parameters="llama3"),
                                 "rope_parameters is str"),
    "llama3_factor_below_one": ("llama", _rope(rope_type="llama3", factor=0.5),
                                "factor 0.5"),
    "tie_as_text": ("llama", _config(tie_word_embeddings="yes"),
                    "tie_word_embeddings 'yes': must be true or false"),
    "config_not_an_object": ("llama", _text("config.json", "[1, 2]"),
                             "config.json is list, not a JSON object"),
    "architectures_as_text": ("llama", _config(architectures="LlamaForCausalLM"),
                              "architectures 'LlamaForCausalLM'"),
    "top_k_beyond_the_experts": ("mixtral", _config(num_experts_per_tok=5),
                                 "num_experts_per_tok 5: must be from 1 to 4"),
    "one_expert": ("mixtral", _config(num_local_experts=1), "num_local_experts 1"),
    "mixtral_top_1": ("mixtral", _config(num_experts_per_tok=1),  # megatron's ValueError before
                      "num_experts_per_tok 1: megatron-core builds top-1 routing only"),
    "groups_not_dividing_experts": ("deepseek_v3", _config(n_group=3),
                                    "n_group 3: must divide n_routed_experts 8"),
    "yarn_beta_past_the_positions": ("deepseek_v3", _rope(beta_fast=1e300),  # ValueError before
                                     "beta_fast 1e+300: must be at most 4194304"),
    "odd_rope_head_dim": ("deepseek_v3", _config(qk_rope_head_dim=7), "qk_rope_head_dim 7"),
    "dense_layers_beyond_the_model": ("deepseek_v3", _config(first_k_dense_replace=9),
                                      "first_k_dense_replace 9"),
    # the weights themselves
    "integer_weight": ("llama", _weights(lambda w: w.update(
        {"model.norm.weight": w["model.norm.weight"].long()})), "is torch.int64"),
    "nan_weight": ("llama", _weights(lambda w: w["model.norm.weight"].__setitem__(
        0, float("nan"))), "model.norm.weight in model.safetensors holds NaN"),
    "missing_projection": ("llama", _weights(lambda w: w.pop(L0 + "self_attn.k_proj.weight")),
                           "no model.layers.0.self_attn.k_proj.weight"),
    "foreign_tensor": ("llama", _weights(lambda w: w.update(
        {L0 + "self_attn.q_norm.weight": torch.ones(16)})),
        "holds model.layers.0.self_attn.q_norm.weight, which the model config.json"),
    "transposed_projection": ("llama", _weights(lambda w: w.update(
        {L0 + "mlp.gate_proj.weight": w[L0 + "mlp.gate_proj.weight"].t().contiguous()})),
        "gate_proj.weight in model.safetensors has shape (64, 176)"),
    "tied_with_another_head": ("tied_llama", _weights(lambda w: w.update(
        {"lm_head.weight": torch.zeros_like(w["model.embed_tokens.weight"])})),
        "tie_word_embeddings true, but the weights hold an lm_head.weight"),
    # the files
    "index_leaving_the_directory": ("llama", _index_naming("../model.safetensors"),
                                    "names '../model.safetensors', not a file"),
    "index_not_json": ("llama", _text("model.safetensors.index.json", "{"),
                       "model.safetensors.index.json is not JSON"),
    "index_without_weight_map": ("llama", _text("model.safetensors.index.json", "{}"),
                                 "has no weight_map"),
    "tensor_in_two_files": ("llama", _split_in_two(overlap=True), "is in both a.safetensors"),
    "truncated_weights": ("llama", _text("model.safetensors", "garbage"),
                          "model.safetensors is not a safetensors file"),
    "config_nested_too_deeply": ("llama", _text("config.json", "[" * 100_000 + "]" * 100_000),
                                 "config.json is nested too deeply"),
    "float8_weight": ("llama", _weights(lambda w: w.update(
        {"model.norm.weight": w["model.norm.weight"].to(torch.float8_e4m3fn)})),
        "is torch.float8_e4m3fn, not a float32, bfloat16 or float16 weight"),
    "tokenizer_config_not_an_object": ("llama", _text("tokenizer_config.json", "[]"),
                                       "tokenizer_config.json: a list, not a JSON object"),
    # the tokenizer's files
    "tokenizer_config_not_json": ("llama", _text("tokenizer_config.json", "{"),
                                  "tokenizer_config.json: not valid JSON"),
    "tokenizer_config_not_text": ("llama", _bytes("tokenizer_config.json", b"\xff\xfe\x00{"),
                                  "tokenizer_config.json: not valid JSON"),
    "tokenizer_config_nested_too_deeply": (
        "llama", _text("tokenizer_config.json", "[" * 100_000 + "]" * 100_000),
        "tokenizer_config.json: nested too deeply"),
    "special_tokens_map_not_an_object": ("llama", _text("special_tokens_map.json", "7"),
                                         "special_tokens_map.json: a int, not a JSON object"),
    "no_eos_token": ("llama", _text("tokenizer_config.json", "{}"), "names no eos_token"),
    "eos_token_not_in_the_vocabulary": (
        "llama", _text("tokenizer_config.json", json.dumps({"eos_token": "<nowhere>"})),
        "names no eos_token"),
    "tokenizer_json_not_json": ("llama", _text("tokenizer.json", "{"),
                                "tokenizer.json: not a Hugging Face tokenizer"),
    "tokenizer_json_a_list": ("llama", _text("tokenizer.json", "[]"),
                              "tokenizer.json: not a Hugging Face tokenizer"),
    "tokenizer_json_not_text": ("llama", _bytes("tokenizer.json", bytes(range(256))),
                                "tokenizer.json: not a Hugging Face tokenizer"),
    "sentencepiece_model_garbage": ("llama", _sentencepiece_only(b"garbage"),
                                    "tokenizer.model: not a SentencePiece model"),
    "no_tokenizer": ("llama", _sentencepiece_only(None), "no tokenizer.json or tokenizer.model"),
    # a config that asks for more tensors than any disk holds: refused at the first one missing,
    # without listing 4,096 x 16,384 x 3 expert weights first
    "every_bound_at_once": ("mixtral", _config(num_hidden_layers=4096, num_local_experts=16384),
                            "config.json's num_local_experts 16384, hidden_size 64 make it "
                            "(16384, 64)"),
}


GOOD_VARIANTS = {  # published layouts the checks must let through: (source, change)
    # DeepSeek-V3's multi-token-prediction layer after the last one, which transformers' class
    # does not hold: left out, and said
    "deepseek_v3_with_its_prediction_layer": (
        "deepseek_v3", _config(num_hidden_layers=2, num_nextn_predict_layers=1)),
    # YaRN's optional settings absent (transformers' and megatron-core's defaults: 32 and 1)
    "yarn_without_its_betas": ("deepseek_v3", lambda d: _config(rope_parameters={
        k: v for k, v in json.loads((d / "config.json").read_text())["rope_parameters"].items()
        if k not in ("beta_fast", "beta_slow")})(d)),
}


@pytest.mark.parametrize("variant", sorted(GOOD_VARIANTS))
def test_a_good_variant_still_imports(sources, tmp_path, variant):
    source, change = GOOD_VARIANTS[variant]
    shutil.copytree(sources[source], tmp_path / "hf")
    change(tmp_path / "hf")
    assert cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")) == 0


def test_a_split_directory_still_imports(sources, tmp_path):
    """The index the damage above builds on is a good one without the overlap."""
    shutil.copytree(sources["llama"], tmp_path / "hf")
    _split_in_two(overlap=False)(tmp_path / "hf")
    assert cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")) == 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_directory_is_one_line_and_writes_nothing(sources, tmp_path, capfd, case):
    source, damage, expected = CASES[case]
    shutil.copytree(sources[source], tmp_path / "hf")
    damage(tmp_path / "hf")
    capfd.readouterr()
    assert cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "out")) == 2
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], err[-3000:]
    assert "Traceback" not in err and str(tmp_path / "hf") in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no out, no out.partial


# Every field import-hf reads, by its class, with values outside that class: the line must
# name the field and config.json. (source, field, its least value, its greatest or None); a
# table's field is "table.field".
WHOLE = [("llama", "num_hidden_layers", 1, MAX_LAYERS), ("llama", "hidden_size", 1, MAX_WIDTH),
         ("mistral", "num_hidden_layers", 1, MAX_LAYERS), ("mistral", "head_dim", 1, MAX_WIDTH),
         ("deepseek_v3", "num_hidden_layers", 1, MAX_LAYERS),
         ("deepseek_v3", "num_attention_heads", 1, MAX_HEADS),
         ("deepseek_v3", "hidden_size", 1, MAX_WIDTH), ("deepseek_v3", "vocab_size", 1, None),
         ("deepseek_v3", "intermediate_size", 1, MAX_WIDTH),
         ("deepseek_v3", "max_position_embeddings", 1, MAX_SEQUENCE),
         ("deepseek_v3", "num_nextn_predict_layers", 0, MAX_LAYERS),
         ("mixtral", "num_hidden_layers", 1, MAX_LAYERS),
         ("mixtral", "intermediate_size", 1, MAX_WIDTH),
         ("llama", "num_attention_heads", 1, MAX_HEADS), ("llama", "num_key_value_heads", 1, 4),
         ("llama", "intermediate_size", 1, MAX_WIDTH), ("llama", "head_dim", 1, MAX_WIDTH),
         ("llama", "max_position_embeddings", 1, MAX_SEQUENCE), ("llama", "vocab_size", 1, None),
         ("mixtral", "num_local_experts", 2, MAX_EXPERTS),
         ("mixtral", "num_experts_per_tok", 1, 4),
         ("deepseek_v3", "n_routed_experts", 2, MAX_EXPERTS),
         ("deepseek_v3", "num_experts_per_tok", 1, 8), ("deepseek_v3", "n_group", 1, 8),
         ("deepseek_v3", "topk_group", 1, 4), ("deepseek_v3", "n_shared_experts", 1, MAX_EXPERTS),
         ("deepseek_v3", "moe_intermediate_size", 1, MAX_WIDTH),
         ("deepseek_v3", "first_k_dense_replace", 0, 3),
         ("deepseek_v3", "q_lora_rank", 1, MAX_WIDTH),
         ("deepseek_v3", "kv_lora_rank", 1, MAX_WIDTH),
         ("deepseek_v3", "qk_nope_head_dim", 1, MAX_WIDTH),
         ("deepseek_v3", "qk_rope_head_dim", 2, MAX_WIDTH),
         ("deepseek_v3", "v_head_dim", 1, MAX_WIDTH),
         ("deepseek_v3", "rope_parameters.original_max_position_embeddings", 1, MAX_SEQUENCE)]
# (source, field, a value just below its range)
POSITIVE = [("llama", "rms_norm_eps", 0), ("llama", "initializer_range", 0),
            ("llama", "rope_parameters.rope_theta", 0), ("mixtral", "router_aux_loss_coef", -0.5),
            ("deepseek_v3", "routed_scaling_factor", 0), ("deepseek_v3", "rms_norm_eps", 0),
            ("deepseek_v3", "rope_parameters.factor", 0.5),
            ("deepseek_v3", "rope_parameters.mscale", 0),
            ("deepseek_v3", "rope_parameters.mscale_all_dim", -1),
            ("deepseek_v3", "rope_parameters.beta_fast", 0),
            ("deepseek_v3", "rope_parameters.beta_slow", 0),
            ("llama3", "rope_parameters.factor", 0.5),
            ("llama3", "rope_parameters.low_freq_factor", 2.0),
            ("llama3", "rope_parameters.high_freq_factor", 0),
            ("llama3", "rope_parameters.original_max_position_embeddings", 4096),
            ("mistral", "rms_norm_eps", 0)]
SWITCHES = [("llama", "tie_word_embeddings"), ("llama", "attention_bias"), ("llama", "mlp_bias"),
            ("deepseek_v3", "rope_interleave"), ("deepseek_v3", "norm_topk_prob"),
            ("deepseek_v3", "attention_bias"), ("tied_llama", "tie_word_embeddings")]
WORDS = [("llama", "hidden_act"), ("llama", "model_type"), ("mixtral", "model_type"),
         ("llama", "rope_parameters.rope_type"), ("deepseek_v3", "hidden_act"),
         ("deepseek_v3", "rope_parameters.rope_type")]
NOT_A_NUMBER = ["3", True, [3], float("nan"), float("inf")]


def _field_cases():
    """(source, field, the values outside its class to try)."""
    for source, field, least, greatest in WHOLE:
        beyond = [least - 1, -(10 ** 6), 10 ** 30, 2.5] + \
            ([greatest + 1] if greatest is not None else [])
        yield source, field, [*NOT_A_NUMBER, *beyond]
    for source, field, below in POSITIVE:
        yield source, field, [*NOT_A_NUMBER, float("-inf"), below]
    for source, field in SWITCHES:
        yield source, field, ["true", 1, 0, [], {}, float("nan")]
    for source, field in WORDS:
        yield source, field, [1, True, [], {"name": "silu"}, float("nan")]


def _with_field(config: dict, field: str, value) -> dict:
    config = json.loads(json.dumps(config))
    *tables, name = field.split(".")
    held = config
    for table in tables:
        held = held[table]
    held[name] = value
    return config


FIELD_CASES = list(_field_cases())


@pytest.mark.parametrize("source, field, values", FIELD_CASES,
                         ids=[f"{s}-{f}" for s, f, _ in FIELD_CASES])
def test_a_field_out_of_its_class_is_one_line_naming_it(sources, tmp_path, capfd, source, field,
                                                       values):
    """Each value in turn in one copy of the directory (config.json written as Python's json
    writes it: NaN and Infinity too); every one must be refused naming the field."""
    shutil.copytree(sources[source], tmp_path / "hf")
    good = json.loads((sources[source] / "config.json").read_text())
    wrong = []
    for value in values:
        (tmp_path / "hf" / "config.json").write_text(json.dumps(_with_field(good, field, value)))
        capfd.readouterr()
        try:
            code = cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "out"))
        except Exception as error:  # a traceback, had it run as the command
            code = f"{type(error).__name__}: {error}"
        err = capfd.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        left = sorted(p.name for p in tmp_path.iterdir())
        if code != 2 or len(errors) != 1 or "Traceback" in err or \
                field.split(".")[-1] not in errors[0] or "config.json" not in errors[0] or \
                left != ["hf"]:  # no out, no out.partial
            wrong.append(f"{value!r}: exit {code}, {errors}, left {left}")
        for name in left:
            if name != "hf":
                shutil.rmtree(tmp_path / name)
    assert not wrong, "\n".join(wrong)


def test_the_weights_expected_are_listed_no_further_than_the_disk(sources):
    """A config asking for more tensors than the files hold is refused after reading one past
    their number from the family's list, not after building all of it."""
    from megatron_gnmr.errors import UserError
    from megatron_gnmr.model_families.checked_hf import Expected, check_weights

    weights = {"a": torch.zeros(2), "b": torch.zeros(2)}
    handed = []

    def endless():
        for index in range(10 ** 9):
            handed.append(index)
            yield ("a", "b", f"c{index}")[min(index, 2)], Expected((2,), "x 2")

    with pytest.raises(UserError, match="hold no c2"):
        check_weights(endless(), weights, dict.fromkeys(weights, "w.safetensors"), "test", 1)
    assert len(handed) == len(weights) + 1


def test_the_real_command_refuses_in_one_line(sources, tmp_path):
    """The installed console script, as a user runs it, on the issue's first example (3 layers
    declared, 2 on disk: a KeyError traceback before)."""
    import subprocess
    import sys

    shutil.copytree(sources["llama"], tmp_path / "hf")
    _config(num_hidden_layers=3)(tmp_path / "hf")
    script = Path(sys.executable).with_name("megatron-gnmr")
    done = subprocess.run([str(script), "import-hf", str(tmp_path / "hf"), str(tmp_path / "out")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "num_hidden_layers 3" in errors[0], done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
