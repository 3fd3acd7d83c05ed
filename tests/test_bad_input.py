"""Every user mistake: exit status 2 (or a UserError), one line naming the input and the fix,
no traceback, nothing written into --save, within seconds.

Most of the table is checked in-process through `parse_config` + `validate`, exactly what the
entry point runs before anything is built (milliseconds each); the mistakes that only show
against real files, a checkpoint or a launch go through `pretrain_llama.py` itself.
"""

import os
import shutil
import time
from pathlib import Path

import pytest

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.errors import UserError
from megatron_gnmr.validation import validate
from tests.helpers import LAUNCH_TIMEOUT_S, REPO, TINY, pretrain_in_process, run_pretrain

DATA = REPO / ".cache" / "megatron_gnmr" / "shakespeare-v4096"
# Megatron precision configs that megatron-core refuses (tests/test_precision_config_file.py
# runs megatron's own reader on the same kinds of file); every matcher picks every unit.
_CONFIG = ("configs:\n  c:\n{body}"
           "matchers:\n  m: {{config: c, type: glob, pattern: '*', enabled: true}}\n")
_TE = "    transformer_engine_config_type: TEQuantizationParams\n"
PRECISION_CONFIGS = {
    "recipe_unknown_key": _CONFIG.format(body=_TE + "    training_recipe: {fp8_recipe: x}\n"),
    "recipe_unknown_name": _CONFIG.format(
        body=_TE + "    training_recipe: {fp8_quantization_recipe: fp9}\n"),
    "recipe_delayed": _CONFIG.format(
        body=_TE + "    training_recipe: {fp8_quantization_recipe: delayed}\n"),
    "recipe_fp8_and_fp4": _CONFIG.format(body=_TE + "    training_recipe: "
                                         "{fp8_quantization_recipe: mxfp8, "
                                         "fp4_quantization_recipe: nvfp4}\n"),
    "no_training_recipe": _CONFIG.format(body=_TE),
    "no_config_type": _CONFIG.format(body="    training_recipe: {}\n"),
    "unknown_config_type": _CONFIG.format(
        body="    transformer_engine_config_type: Kitchen\n    training_recipe: {}\n"),
    "configs_not_mappings": "configs:\n  c: [1, 2]\nmatchers:\n  m: {config: c, type: glob, "
                            "pattern: '*', enabled: true}\n",
}
NO_SAVE = "<no --save>"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    yamls = {
        "unknown_key": "model:\n  num_layer: 2\n",
        "unknown_section": "modle:\n  num_layers: 2\n",
        "wrong_type": "model:\n  num_layers: two\n",
        "not_yaml": "model: [unclosed\n",
        "float_for_int": "model:\n  num_layers: 2.5\n",
        "string_for_bool": "training:\n  bf16: 'yes'\n",
        "list_for_float": "gnmr:\n  alpha: [1, 2]\n",
        "section_not_mapping": "model: [1, 2]\n",
        "top_level_list": "- model\n- training\n",
        "yaml_nan": "training:\n  clip_grad: .nan\n",
        "bool_for_int": "model:\n  num_layers: true\n",
        "schedule_not_pairs": "gnmr:\n  alpha_schedule: 5\n",
    }
    for name, text in yamls.items():
        (root / f"{name}.yaml").write_text(text)
    for name, text in PRECISION_CONFIGS.items():
        (root / f"pc_{name}.yaml").write_text(text)
    (root / "pc_binary.yaml").write_bytes(bytes(range(256)) * 4)
    (root / "not_records").mkdir()  # a "run" whose metrics.jsonl is JSON, but no records
    (root / "not_records" / "metrics.jsonl").write_text('[1, 2]\n"step"\n5\n')
    (root / "config_dir.yaml").mkdir()
    corrupt = root / "corrupt"
    corrupt.mkdir()
    shutil.copy(DATA / "text_document.bin", corrupt / "text_document.bin")
    shutil.copy(DATA / "tokenizer.model", corrupt / "tokenizer.model")
    (corrupt / "text_document.idx").write_bytes((DATA / "text_document.idx").read_bytes()[:200])
    garbage = root / "garbage"
    garbage.mkdir()
    for suffix in (".bin", ".idx"):
        (garbage / f"text_document{suffix}").write_bytes(os.urandom(4096))
    (root / "not_a_tokenizer.model").write_text("this is not a sentencepiece model\n")
    small_vocab = root / "small_vocab"  # data whose ids exceed a smaller tokenizer's vocab
    small_vocab.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(DATA / f"text_document{suffix}", small_vocab / f"text_document{suffix}")
    from megatron_gnmr.data.tokenizer import train_tokenizer

    train_tokenizer(["to be or not to be, that is the question\n" * 50],
                    small_vocab / "tokenizer.model", 300)
    (root / "a_file").write_text("not a directory\n")
    only_bin = root / "only_bin"
    only_bin.mkdir()
    shutil.copy(DATA / "text_document.bin", only_bin / "text_document.bin")
    wrong_dtype = root / "wrong_dtype"  # an index that says uint16 over int32 tokens
    wrong_dtype.mkdir()
    import numpy as np

    tokens = np.fromfile(DATA / "text_document.bin", dtype=np.uint16).astype(np.int32)
    tokens.tofile(wrong_dtype / "text_document.bin")
    shutil.copy(DATA / "text_document.idx", wrong_dtype / "text_document.idx")
    shutil.copy(DATA / "tokenizer.model", wrong_dtype / "tokenizer.model")
    (root / "per_split_bad_key.json").write_text(
        '{"training": "' + str(DATA / "text_document") + '", "valid": "x"}')
    run = root / "run"
    run_pretrain([*TINY, "--train-iters", "4", "--exit-interval", "3", "--eval-interval",
                  "100", "--gnmr", "--monitors", "attention", "--monitor-interval", "1",
                  "--monitor-delta", "1", "--save", str(run)])
    truncated = root / "truncated"
    shutil.copytree(run, truncated)
    shard = next(truncated.glob("iter_*/*.distcp"))  # the default format's data file
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return root


# Checked in-process: parse + validate, the steps that run before anything is built.
IN_PROCESS = {
    # flag values
    "alpha_zero": (["--gnmr", "--gnmr-alpha", "0"], "--gnmr-alpha"),
    "negative_max_o": (["--gnmr", "--gnmr-max-o", "-1"], "--gnmr-max-o"),
    "delta_zero": (["--gnmr", "--gnmr-delta", "0"], "--gnmr-delta"),
    "warmup_too_short": (["--gnmr", "--gnmr-delta", "8", "--gnmr-warmup", "3"], "--gnmr-warmup"),
    "bad_nonfinite_mode": (["--gnmr-nonfinite", "ignore"], "--gnmr-nonfinite"),
    "units_bad_regex": (["--gnmr", "--gnmr-units", "("], "--gnmr-units"),
    "units_match_nothing": (["--gnmr", "--gnmr-units", "router"], "--gnmr-units"),
    "static_units_bad_regex": (["--gnmr", "--gnmr-signals", "static", "--gnmr-static-units",
                                "fc2[("], "--gnmr-static-units"),
    "tp_not_dividing_heads": (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel"),
    "pp_not_dividing_layers": (["--pipeline-model-parallel-size", "3"], "--pipeline-model-par"),
    "tp_larger_than_world": (["--tensor-model-parallel-size", "2"], "processes"),
    "hidden_not_dividing_heads": (["--hidden-size", "66"], "--hidden-size"),
    "odd_head_dim_for_rope": (["--hidden-size", "36", "--num-attention-heads", "4",
                               "--num-query-groups", "4"], "RoPE"),
    "zero_query_groups": (["--num-query-groups", "0"], "--num-query-groups"),
    "zero_heads": (["--num-attention-heads", "0"], "--num-attention-heads"),
    "batch_not_multiple": (["--global-batch-size", "6"], "--global-batch-size"),
    "zero_micro_batch": (["--micro-batch-size", "0"], "--micro-batch-size"),
    "unknown_flag": (["--num-layerz", "2"], "--num-layerz"),
    "abbreviated_flag": (["--num-layer", "2"], "--num-layer"),
    "wrong_type_flag": (["--num-layers", "two"], "--num-layers"),
    "negative_lr": (["--lr", "-1"], "--lr"),
    "nan_lr": (["--lr", "nan"], "--lr"),
    "inf_lr": (["--lr", "inf"], "--lr"),
    "nan_clip_grad": (["--clip-grad", "nan"], "--clip-grad"),
    "nan_monitor_band": (["--monitors", "attention", "--monitor-band", "nan"], "--monitor-band"),
    "inf_init_std": (["--init-method-std", "inf"], "--init-method-std"),
    "zero_init_std": (["--init-method-std", "0"], "--init-method-std"),
    "nan_weight_decay": (["--weight-decay", "nan"], "--weight-decay"),
    "beta1_one": (["--adam-beta1", "1.0"], "--adam-beta1"),
    "negative_beta2": (["--adam-beta2", "-0.1"], "--adam-beta2"),
    "zero_norm_epsilon": (["--norm-epsilon", "0"], "--norm-epsilon"),
    "nan_qerr_ratio": (["--gnmr", "--gnmr-qerr-ratio", "nan"], "--gnmr-qerr-ratio"),
    "inf_gnmr_eps": (["--gnmr", "--gnmr-eps", "inf"], "--gnmr-eps"),
    "nan_max_o": (["--gnmr", "--gnmr-max-o", "nan"], "--gnmr-max-o"),
    "nan_budget_rate": (["--gnmr", "--gnmr-budget-rate", "nan"], "--gnmr-budget-rate"),
    "negative_seed": (["--seed", "-1"], "--seed"),
    "seed_beyond_numpy": (["--seed", str(2**32)], "--seed"),
    "negative_selection_seed": (["--gnmr-selection-seed", "-3"], "--gnmr-selection-seed"),
    "zero_eval_iters": (["--eval-iters", "0"], "--eval-iters"),
    "negative_save_interval": (["--save-interval", "-1"], "--save-interval"),
    "zero_keep_last": (["--keep-last", "0"], "--keep-last"),
    "zero_timeout": (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes"),
    "negative_image_interval": (["--image-interval", "-1"], "--image-interval"),
    "vocab_too_small": (["--vocab-size", "100"], "--vocab-size"),
    "fault_bits_out_of_range": (["--attention-fault-bits", "11"], "--attention-fault-bits"),
    "fault_share_without_fault": (["--attention-fault-share", "0.5"], "--attention-fault-share"),
    "fault_share_above_one": (["--attention-fault-bits", "1", "--attention-fault-share", "1.5"],
                              "--attention-fault-share"),
    "fault_peak_of_one": (["--attention-fault-bits", "1", "--attention-fault-peak", "1"],
                          "--attention-fault-peak"),
    "fault_rounding_unknown": (["--attention-fault-bits", "1", "--attention-fault-rounding",
                                "up"], "--attention-fault-rounding"),
    "warmup_beyond_run": (["--lr-warmup-iters", "50", "--train-iters", "10"], "--lr-warmup"),
    "min_lr_above_lr": (["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr"),
    "resume_without_save": (["--resume", "auto", NO_SAVE], "--resume"),
    "resume_bad_value": (["--resume", "latest"], "--resume"),
    "overwrite_with_resume": (["--overwrite", "--resume", "auto"], "--overwrite"),
    "unknown_recipe": (["--precision-recipe", "fp4-magic"], "--precision-recipe"),
    "te_without_te": (["--precision-recipe", "te-fp8"], "Transformer Engine"),
    "delayed_scaling": (["--precision-recipe", "fp8-emulated", "--fp8-recipe", "delayed"],
                        "--fp8-recipe delayed"),
    "act_quant_bits": (["--precision-recipe", "act-quant", "--act-quant-bits", "5"],
                       "--act-quant-bits"),
    "torchao_blockwise": (["--precision-recipe", "fp8-torchao", "--fp8-recipe", "blockwise"],
                          "--fp8-recipe"),
    "bad_static_path": (["--precision-static", "both"], "--precision-static"),
    "unknown_monitor": (["--monitors", "attention,loss"], "--monitors"),
    "router_without_moe": (["--monitors", "router"], "--num-experts"),
    "delta_above_interval": (["--monitors", "attention", "--monitor-interval", "5",
                              "--monitor-delta", "6"], "--monitor-delta"),
    "ep_not_dividing_experts": (["--num-experts", "3", "--expert-model-parallel-size", "2"],
                                "--expert-model-parallel-size"),
    "one_expert": (["--num-experts", "1"], "--num-experts"),
    "topk_above_experts": (["--num-experts", "2", "--moe-router-topk", "3"],
                           "--moe-router-topk"),
    "precision_config_missing": (["--precision-recipe", "fp8-emulated",
                                  "--precision-config-file", "/nonexistent.yaml"],
                                 "--precision-config-file"),
    "precision_config_without_recipe": (["--precision-config-file", "/nonexistent.yaml"],
                                        "--precision-recipe"),
    "nvfp4_bad_recovery": (["--precision-recipe", "nvfp4", "--nvfp4-recovery", "fp16"],
                           "--nvfp4-recovery"),
    "recovery_gemm_unknown": (["--precision-recipe", "act-quant", "--precision-recovery-gemms",
                               "wgrad,bprop"], "--precision-recovery-gemms"),
    "recovery_gemm_twice": (["--precision-recipe", "act-quant", "--precision-recovery-gemms",
                             "wgrad,wgrad"], "--precision-recovery-gemms"),
    "recovery_gemm_on_te": (["--precision-recipe", "te-fp8", "--precision-recovery-gemms",
                             "wgrad"], "--precision-recovery-gemms"),
    "bf16_layers_above_model": (["--precision-recipe", "act-quant", "--first-last-layers-bf16",
                                 "--num-layers-at-end-in-bf16", "99"],
                                "--num-layers-at-end-in-bf16"),
    "bf16_layers_without_recipe": (["--first-last-layers-bf16"], "--first-last-layers-bf16"),
    # the DeepSeek-style MoE fields
    "bad_score_function": (["--num-experts", "4", "--moe-router-score-function", "tanh"],
                           "--moe-router-score-function"),
    "bad_balancing": (["--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"],
                      "--moe-router-load-balancing-type"),
    "bias_with_softmax": (["--num-experts", "4", "--moe-router-enable-expert-bias"],
                          "--moe-router-score-function sigmoid"),
    "all_layers_dense": (["--num-experts", "4", "--moe-first-dense-layers", "2"],
                         "--moe-first-dense-layers"),
    "dispatch_quant_dense": (["--precision-recipe", "deepseek", "--moe-dispatch-quant"],
                             "--num-experts"),
    "dispatch_quant_act_quant": (["--num-experts", "4", "--precision-recipe", "act-quant",
                                  "--moe-dispatch-quant"], "--moe-dispatch-quant"),
    "torchao_experts": (["--num-experts", "4", "--precision-recipe", "fp8-torchao"],
                        "--num-experts"),
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
    # megatron's scale features
    "param_gather_without_distopt": (["--overlap-param-gather"], "--use-distributed-optimizer"),
    "param_gather_without_grad_overlap": (["--use-distributed-optimizer",
                                           "--overlap-param-gather"], "--overlap-grad-reduce"),
    "recompute_unknown": (["--recompute-granularity", "partial"], "--recompute-granularity"),
    "full_recompute_without_method": (["--recompute-granularity", "full"], "--recompute-method"),
    "recompute_method_unknown": (["--recompute-granularity", "full", "--recompute-method",
                                  "random", "--recompute-num-layers", "1"], "--recompute-method"),
    "recompute_layers_beyond_stage": (["--recompute-granularity", "full", "--recompute-method",
                                       "block", "--recompute-num-layers", "3"],
                                      "--recompute-num-layers"),
    "selective_with_layers": (["--recompute-granularity", "selective",
                               "--recompute-num-layers", "1"], "--recompute-num-layers"),
    "zero_recompute_layers": (["--recompute-num-layers", "0"], "--recompute-num-layers"),
    "grad_fusion_on_cpu": (["--gradient-accumulation-fusion"], "--gradient-accumulation-fusion"),
    "unknown_attention_backend": (["--attention-backend", "triton"], "--attention-backend"),
    "flash_and_other_backend": (["--use-flash-attn", "--attention-backend", "local"],
                                "--use-flash-attn"),
    "split_train_empty": (["--split", "0,5,0"], "--split"),
    "split_valid_empty": (["--split", "100,0,0"], "--split"),
    "split_not_numbers": (["--split", "ninety,ten"], "--split"),
    "split_negative": (["--split", "95,-5"], "--split"),
    "split_nan": (["--split", "nan,5"], "--split"),
    # files and paths
    "reference_not_a_run": (["--monitors", "attention", "--monitor-reference", "{root}"],
                            "--monitor-reference"),
    "reference_is_a_file": (["--monitors", "attention", "--monitor-reference", "{root}/a_file"],
                            "--monitor-reference"),
    "missing_config": (["--config", "{root}/nope.yaml"], "nope.yaml"),
    "config_is_a_directory": (["--config", "{root}/config_dir.yaml"], "config_dir.yaml"),
    "unknown_yaml_key": (["--config", "{root}/unknown_key.yaml"], "model.num_layer"),
    "unknown_yaml_section": (["--config", "{root}/unknown_section.yaml"], "modle"),
    "wrong_yaml_type": (["--config", "{root}/wrong_type.yaml"], "model.num_layers"),
    "yaml_float_for_int": (["--config", "{root}/float_for_int.yaml"], "model.num_layers"),
    "yaml_string_for_bool": (["--config", "{root}/string_for_bool.yaml"], "training.bf16"),
    "yaml_list_for_float": (["--config", "{root}/list_for_float.yaml"], "gnmr.alpha"),
    "yaml_bool_for_int": (["--config", "{root}/bool_for_int.yaml"], "model.num_layers"),
    "yaml_section_not_mapping": (["--config", "{root}/section_not_mapping.yaml"], "'model'"),
    "yaml_top_level_list": (["--config", "{root}/top_level_list.yaml"], "mapping"),
    "yaml_nan": (["--config", "{root}/yaml_nan.yaml"], "training.clip_grad"),
    "invalid_yaml": (["--config", "{root}/not_yaml.yaml"], "not valid YAML"),
    "missing_data": (["--data-path", "{root}/missing/text_document"], "--data-path"),
    "corrupt_idx": (["--data-path", "{root}/corrupt/text_document"], "truncated"),
    "garbage_data": (["--data-path", "{root}/garbage/text_document"], "not a Megatron index"),
    "tokenizer_not_a_model": (["--data-path", "{root}/small_vocab/text_document",
                               "--tokenizer-model", "{root}/not_a_tokenizer.model"],
                              "not a SentencePiece model"),
    "tokenizer_is_a_directory": (["--data-path", "{root}/small_vocab/text_document",
                                  "--tokenizer-model", "{root}"], "--tokenizer-model"),
    "tokenizer_smaller_than_data": (["--data-path", "{root}/small_vocab/text_document"],
                                    "beyond the tokenizer's vocabulary"),
    "tokenizer_without_data_path": (["--tokenizer-model", "{root}/not_a_tokenizer.model"],
                                    "--tokenizer-model goes with --data-path"),
    "save_is_a_file": (["--save", "{root}/a_file"], "is a file"),
    "save_under_a_file": (["--save", "{root}/a_file/run"], "is a file"),
    "save_unwritable": (["--save", "/proc/megatron_gnmr_run"], "not writable"),
    "tensorboard_dir_is_a_file": (["--tensorboard-dir", "{root}/a_file"], "--tensorboard-dir"),
    "data_cache_dir_is_a_file": (["--data-cache-dir", "{root}/a_file"], "--data-cache-dir"),
    "missing_checkpoint": (["--load", "{root}/no_run"], "--load"),
    "load_is_a_file": (["--load", "{root}/a_file"], "--load"),
    "load_not_a_run": (["--load", "{root}"], "neither a run directory"),
    "reused_save_directory": (["--save", "{root}/run"], "--resume auto"),
    "finetune_without_load": (["--finetune"], "--finetune"),
    "lora_unknown_target": (["--lora", "--lora-target-modules", "linear_q"],
                            "--lora-target-modules"),
    "lora_with_experts": (["--lora", "--num-experts", "4"], "--lora"),
    "lora_with_te_fp8": (["--lora", "--precision-recipe", "te-fp8"], "--lora"),
    "lora_dropout_position": (["--lora", "--lora-dropout-position", "middle"],
                              "--lora-dropout-position"),
    "lora_negative_dropout": (["--lora", "--lora-dropout", "-0.1"], "--lora-dropout"),
    "unknown_corpus": (["--corpus", "bible"], "--corpus"),
    "int_bits": (["--precision-recipe", "w8a8", "--int-weight-bits", "5"], "--int-weight-bits"),
    "fp8_format_unknown": (["--precision-recipe", "fp8-emulated", "--fp8-format", "e5m2"],
                           "--fp8-format"),
    "deepseek_format_unknown": (["--precision-recipe", "deepseek", "--deepseek-low-format",
                                 "e4m3"], "--deepseek-low-format"),
    "negative_layers_kept_high": (["--num-layers-at-end-in-bf16", "-1"],
                                  "--num-layers-at-end-in-bf16"),
    "qerr_baseline_unknown": (["--gnmr", "--gnmr-qerr-baseline", "median"],
                              "--gnmr-qerr-baseline"),
    "nonfinite_unknown": (["--gnmr", "--gnmr-nonfinite", "ignore"], "--gnmr-nonfinite"),
    **{f"precision_config_{name}": (["--precision-recipe", "fp8-emulated",
                                     "--precision-config-file", f"{{root}}/pc_{name}.yaml"],
                                    f"pc_{name}.yaml")
       for name in [*PRECISION_CONFIGS, "binary"]},
    # a recipe's option given to another recipe (it would be ignored)
    "nvfp4_option_elsewhere": (["--precision-recipe", "fp8-emulated", "--no-nvfp4-hadamard"],
                               "--no-nvfp4-hadamard applies to --precision-recipe nvfp4"),
    "int_bits_without_w8a8": (["--precision-recipe", "fp8-emulated", "--int-activation-bits",
                               "4"], "--int-activation-bits"),
    "fp8_recipe_for_deepseek": (["--precision-recipe", "deepseek", "--fp8-recipe",
                                 "blockwise"], "--fp8-recipe"),
    "act_quant_option_elsewhere": (["--precision-recipe", "nvfp4", "--act-quant-bits", "3"],
                                   "--act-quant-bits"),
    # shapes no cluster builds (a typo), sizes a layer cannot have
    "layers_beyond_any_model": (["--num-layers", "1000000000000"], "--num-layers"),
    "width_beyond_any_model": (["--hidden-size", "100000000000"], "--hidden-size"),
    "lora_rank_above_the_layer": (["--finetune", "--load", "{root}/run", "--lora",
                                   "--lora-dim", "128"], "--lora-dim 128 exceeds"),
    # corpus flags that would be ignored
    "tokenizer_corpus_is_own": (["--tokenizer-corpus", "shakespeare"], "--tokenizer-corpus"),
    "corpus_with_data_path": (["--data-path", "{root}/small_vocab/text_document", "--corpus",
                               "austen"], "--corpus"),
    "yaml_schedule_not_pairs": (["--config", "{root}/schedule_not_pairs.yaml"],
                                "gnmr.alpha_schedule"),
    "attention_precision_unknown": (["--attention-precision", "fp4"], "--attention-precision"),
    "attention_precision_with_te": (["--attention-precision", "fp8", "--precision-recipe",
                                     "te-fp8"], "--attention-precision"),
}

# Through the entry point (in this process): mistakes that show against a checkpoint or a
# launch.
THROUGH_THE_ENTRY_POINT = {
    "truncated_checkpoint": (["--load", "{root}/truncated"], "truncated"),
    "checkpoint_other_shape": (["--load", "{root}/run", "--hidden-size", "128"],
                               "--hidden-size"),
    "checkpoint_other_units": (["--load", "{root}/run", "--gnmr", "--gnmr-units", "fc2"],
                               "--gnmr-units"),
    "resume_other_delta": (["--load", "{root}/run", "--gnmr", "--monitors", "attention",
                            "--monitor-interval", "1", "--monitor-delta", "1",
                            "--gnmr-delta", "4", "--gnmr-warmup", "5"], "--gnmr-delta"),
    "resume_other_detector": (["--load", "{root}/run", "--gnmr", "--monitors", "attention",
                               "--monitor-interval", "1", "--monitor-delta", "1",
                               "--monitor-detector", "online"], "--monitor-detector"),
    "resume_with_experts": (["--load", "{root}/run", "--gnmr", "--num-experts", "4"],
                            "--num-experts"),
    "resume_in_bf16": (["--load", "{root}/run", "--gnmr", "--monitors", "attention",
                        "--monitor-interval", "1", "--monitor-delta", "1", "--bf16"], "--bf16"),
    "resume_without_controller": (["--load", "{root}/run"], "--gnmr"),
    "split_valid_almost_empty": (["--split", "100000,1,0"], "--split 100000,1,0: the valid "
                                 "split gets"),
    "reference_metrics_not_records": (["--monitors", "attention", "--monitor-reference",
                                       "{root}/not_records"], "holds no step records"),
    "finetune_base_other_shape": (["--finetune", "--load", "{root}/run", "--hidden-size",
                                   "128", "--save", "{root}/ft"], "--hidden-size"),
    # Megatron-LM's command line (interop/megatron_flags.py), its data forms and the input
    # files: refused by the same entry point as the launches below, without a launch each
    "megatron_family_disagrees": (["--normalization", "LayerNorm"], "RMSNorm"),
    "megatron_fp8_without_te": (["--fp8-format", "hybrid"], "fp8-emulated"),
    "megatron_bad_choice": (["--lr-decay-style", "exponential"], "--lr-decay-style"),
    "megatron_iters_and_samples": (["--train-samples", "64"], "--train-samples"),
    "megatron_samples_form_with_iters": (["--lr-decay-samples", "32"], "--lr-decay-samples"),
    "megatron_warmup_fraction_and_iters": (["--lr-warmup-fraction", "0.1"],
                                           "--lr-warmup-fraction"),
    "megatron_optimizer_refused": (["--optimizer", "sgd"], "--optimizer sgd"),
    "megatron_te_layers_without_te": (["--transformer-impl", "transformer_engine"],
                                      "--transformer-impl"),
    "blend_weight_not_number": (["--data-path", "0.3", f"{DATA}/text_document", "x",
                                 f"{DATA}/text_document"], "--data-path"),
    "blend_weight_negative": (["--data-path", "-1", f"{DATA}/text_document", "2",
                               f"{DATA}/text_document"], "negative"),
    "blend_prefix_missing_idx": (["--data-path", "1", f"{DATA}/text_document", "1",
                                  "{root}/only_bin/text_document"], ".idx"),
    "tokenizer_vocab_below_data": (["--data-path", f"{DATA}/text_document",
                                    "--tokenizer-type", "HuggingFaceTokenizer",
                                    "--tokenizer-model", str(REPO / "tests" / "fixtures" /
                                                             "megatron_preprocess" /
                                                             "tokenizers" / "huggingface")],
                                   "vocabulary"),
    "per_split_unknown_key": (["--per-split-data-args-path", "{root}/per_split_bad_key.json"],
                              "'training'"),
    "per_split_and_data_path": (["--data-path", f"{DATA}/text_document", "--train-data-path",
                                 f"{DATA}/text_document"], "exclusive"),
    "per_split_without_valid": (["--train-data-path", f"{DATA}/text_document"],
                                "--valid-data-path"),
    "mock_data_without_tokenizer": (["--mock-data"], "NullTokenizer"),
    "units_bad_regex": (["--gnmr", "--gnmr-units", "("], "--gnmr-units"),
}
# Launched as a user launches, a process of its own: one mistake of each kind of input (a
# checkpoint, a number, Megatron-LM's command line, data, a tokenizer, a YAML file), so the
# exit status, the one line and no traceback hold for a real process.
END_TO_END = {
    "e2e_truncated_checkpoint": (["--load", "{root}/truncated"], "truncated"),
    "e2e_nan_lr": (["--lr", "nan"], "--lr"),
    "megatron_feature_refused": (["--context-parallel-size", "2", "--fp16"],
                                 "--context-parallel-size 2"),
    "blend_dtype_mismatch": (["--data-path", "{root}/wrong_dtype/text_document"],
                             "index describes"),
    "hf_tokenizer_missing": (["--data-path", f"{DATA}/text_document", "--tokenizer-type",
                              "HuggingFaceTokenizer", "--tokenizer-model", "{root}/a_file"],
                             "tokenizer"),
    "e2e_unknown_yaml_key": (["--config", "{root}/unknown_key.yaml"], "model.num_layer"),
}


def _arguments(args, files, save) -> list[str]:
    args = [a.format(root=files) for a in args]
    if NO_SAVE in args:
        args.remove(NO_SAVE)
    elif "--save" not in args:
        args += ["--save", str(save)]
    return [*TINY, "--train-iters", "4", *args]


def _untouched(save: Path, files: Path) -> bool:
    return not save.exists() or not any(save.iterdir()) or save.is_relative_to(files)


@pytest.mark.parametrize("name", sorted(IN_PROCESS))
def test_bad_input_is_refused_before_anything_is_built(files, tmp_path, name):
    args, needle = IN_PROCESS[name]
    save = tmp_path / "save"
    start = time.perf_counter()
    with pytest.raises(UserError) as caught:
        validate(parse_config(_arguments(args, files, save)), world_size=1)
    message = str(caught.value)
    assert needle in message and "\n" not in message, message
    assert time.perf_counter() - start < 30  # milliseconds: nothing is built (busy machine: x10)
    assert _untouched(save, files), f"{name} wrote into --save"


def test_the_table_is_large_and_covers_every_class():
    assert len(IN_PROCESS) + len(THROUGH_THE_ENTRY_POINT) + len(END_TO_END) >= 60


@pytest.mark.parametrize("name", sorted(THROUGH_THE_ENTRY_POINT))
def test_bad_input_through_the_entry_point(files, tmp_path, capfd, name):
    args, needle = THROUGH_THE_ENTRY_POINT[name]
    save = tmp_path / "save"
    code = pretrain_in_process(_arguments(args, files, save))
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and needle in errors[0], errors
    assert _untouched(save, files), f"{name} wrote into --save"


@pytest.mark.parametrize("name", sorted(END_TO_END))
def test_bad_input_exits_2_with_one_line(files, tmp_path, name):
    args, needle = END_TO_END[name]
    save = tmp_path / "save"
    start = time.perf_counter()
    result = run_pretrain(_arguments(args, files, save), check=False, timeout=LAUNCH_TIMEOUT_S,
                          new_process=True)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(errors) == 1 and needle in errors[0], result.stderr[-2000:]
    print(f"\n{name}: {errors[0]}")  # `pytest -s` lists what each mistake is told
    assert "Traceback" not in result.stderr + result.stdout
    assert _untouched(save, files), f"{name} wrote into --save"
    assert time.perf_counter() - start < 300  # seconds: refused before training starts
