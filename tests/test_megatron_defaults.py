"""A flag left out of a Megatron-LM command line means Megatron-LM's default: every flag of its
parser that works here under its own name, held against the table read from its
`megatron/training/arguments.py` at the pinned tag (`interop/megatron_lm_defaults.json`,
written by `scripts/megatron_lm_inventory.py --defaults`). The differences we keep are named
with a reason, and only those differ."""

import json

import pytest

from megatron_gnmr.arguments import build_parser, parse_config
from megatron_gnmr.errors import UserError
from megatron_gnmr.interop.megatron_defaults import DIFFERENCES, megatron_lm_defaults
from megatron_gnmr.interop.megatron_flags import RULES, inventory, rule_of
from tests.helpers import REPO

OURS = {name: action for action in build_parser()._actions for name in action.option_strings}
# our field names that Megatron-LM's parser stores under another name, in the same sense
RENAMED = {"norm_epsilon": "layernorm_epsilon", "apply_layernorm_1p":
           "layernorm_zero_centered_gamma", "fp8_format": "fp8"}


def megatron_lm_meaning(flag: str, config) -> object:
    """What Megatron-LM's parser gives `flag` when it is absent, with what its
    `validate_args` fills in for a None (core_v0.16.1, arguments.py lines 497-498 and
    802-811), on this run's other settings and a launch of one process."""
    entry = megatron_lm_defaults()["flags"][flag]
    if entry["action"] == "store_true" and entry["default"] is None:
        return False  # a switch that is off: `if args.x` reads None as off
    if entry["default"] is None and OURS[flag].nargs == "+":
        return []  # no paths: our lists are empty where its `nargs='*'` gives None
    if flag == "--ffn-hidden-size":  # --swiglu, which both our families fix
        return int((4 * config.model.hidden_size * 2 / 3) / 64) * 64
    if flag == "--global-batch-size":  # micro-batch x data-parallel size (1 here)
        return config.training.micro_batch_size
    return entry["default"]


def absent_here(flag: str, config) -> object:
    section, name = OURS[flag].dest.split(".", 1)
    return getattr(getattr(config, section), name)


def test_the_table_is_megatron_lms_parser_at_the_pinned_tag():
    import megatron.core

    table = megatron_lm_defaults()
    # the tag of the megatron-core we run (setup.py pins 0.16.1)
    assert table["megatron_lm"] == f"core_v{megatron.core.__version__}" == "core_v0.16.1"
    flags = table["flags"]
    assert len(flags) == 681  # every --flag of add_megatron_arguments at 0.16.1
    # read by hand in arguments.py at core_v0.16.1 (lines 1960-2140)
    assert (flags["--min-lr"]["default"], flags["--weight-decay"]["default"],
            flags["--adam-beta2"]["default"], flags["--lr-decay-style"]["default"]) == \
        (0.0, 0.01, 0.999, "linear")
    # the flag inventory (written from the same parser, the releases' union) agrees
    for flag, entry in flags.items():
        assert "0.16.1" in inventory()[flag]["releases"], flag
        if isinstance(entry["default"], (int, float, bool)) and \
                inventory()[flag]["default"] is not None:
            assert inventory()[flag]["default"] == entry["default"], flag


def test_every_absent_flag_means_megatron_lms_default():
    """Every Megatron-LM flag that is also ours: left out, it has Megatron-LM's value, except
    the named differences, each of which does differ (no stale entry)."""
    config = parse_config([], announce=False)
    flags = megatron_lm_defaults()["flags"]
    shared = sorted(flag for flag in flags if flag in OURS and flag != "--help")
    assert len(shared) >= 140
    wrong, differing = [], set()
    for flag in shared:
        ours_name = OURS[flag].dest.split(".", 1)[1]
        assert RENAMED.get(ours_name, ours_name) == flags[flag]["dest"], flag  # same sense
        ours, theirs = absent_here(flag, config), megatron_lm_meaning(flag, config)
        if ours != theirs:
            differing.add(flag)
            if flag not in DIFFERENCES:
                wrong.append(f"{flag}: ours {ours!r}, Megatron-LM's {theirs!r}")
    assert not wrong, wrong
    assert differing == set(DIFFERENCES) & set(shared)  # no stale entry
    assert set(DIFFERENCES) <= set(flags)


def test_the_defaults_the_issue_names_are_megatron_lms():
    config = parse_config([], announce=False)
    t = config.training
    assert (t.min_lr, t.weight_decay, t.adam_beta2, t.lr_decay_style) == \
        (0.0, 0.01, 0.999, "linear")
    assert (t.log_interval, t.eval_iters, config.data.num_workers) == (100, 100, 2)
    assert config.model.moe_aux_loss_coeff == 0.0 and config.mla.kv_lora_rank == 32
    # 8/3 x 4096 = 10922.7, down to a multiple of 64: 10880 (Megatron-LM's SwiGLU width)
    assert parse_config(["--hidden-size", "4096", "--num-attention-heads", "32"],
                        announce=False).model.ffn_hidden_size == 10880
    # one micro-batch per data-parallel rank: 2 x (8 processes / TP 2)
    assert parse_config(["--micro-batch-size", "2", "--tensor-model-parallel-size", "2"],
                        world_size=8, announce=False).training.global_batch_size == 8


def test_a_fine_tune_below_the_old_min_lr_is_accepted():
    """--lr 1e-4 alone was refused (below the old --min-lr 3e-4): now it decays to 0."""
    from megatron_gnmr.validation import validate_schedule

    config = parse_config(["--lr", "1e-4"], announce=False)
    validate_schedule(config)
    assert config.training.min_lr == 0.0


def test_a_width_megatron_lm_would_round_to_zero_is_refused_by_name():
    with pytest.raises(UserError, match="--ffn-hidden-size"):
        parse_config(["--hidden-size", "16", "--num-attention-heads", "2"], announce=False)


def test_the_differences_are_in_the_flag_table():
    ours = frozenset(OURS)
    for flag, difference in DIFFERENCES.items():
        note = rule_of(flag, ours).note
        assert "differs from Megatron-LM's" in note and difference.reason in note, flag
    assert "differs" not in rule_of("--min-lr", ours).note


def test_a_launch_names_the_absent_flags_whose_default_differs_once(capsys, monkeypatch):
    copied = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "64", "--micro-batch-size", "2", "--lr", "1e-3",
              "--train-iters", "4", "--eval-interval", "2", "--tokenizer-type",
              "NullTokenizer", "--mock-data"]
    parse_config(copied)
    notice = capsys.readouterr().err
    assert notice.count("notice:") == 1
    for named in ("--transformer-impl local", "--split 95,5,0", "--attention-dropout 0.0",
                  "--vocab-size 4096"):
        assert named in notice, named
    for given in ("--num-layers", "--lr ", "--eval-interval", "--no-data-path"):
        assert given not in notice, given
    assert "bundled corpus" not in notice  # --mock-data is data
    parse_config([*copied, "--transformer-impl", "local", "--split", "95,5,0"])
    assert "--transformer-impl" not in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")  # said by the logging rank only
    parse_config(copied)
    assert capsys.readouterr().err == ""


def test_training_on_the_bundled_corpus_is_said():
    from megatron_gnmr.interop.start_notice import start_notice

    config = parse_config([], announce=False)
    assert "no --data-path: the bundled corpus --corpus shakespeare" in \
        start_notice(config, set())


def test_a_llama_run_saved_with_the_former_mla_default_resumes():
    """The deepseek-mla family's widths build nothing in a llama run: a llama checkpoint that
    recorded --kv-lora-rank 512 (its default before) resumes."""
    from megatron_gnmr.training.resume_contract import check_resume, resume_settings

    current = resume_settings(parse_config([], announce=False), "d", 4096, 1)
    saved = json.loads(json.dumps({**current, "--kv-lora-rank": 512}))
    check_resume("run", saved, current)
    mla = parse_config(["--model-family", "deepseek-mla", "--kv-lora-rank", "64"],
                       announce=False)
    with pytest.raises(UserError, match="--kv-lora-rank"):
        check_resume("run", {**resume_settings(mla, "d", 4096, 1), "--kv-lora-rank": 512},
                     resume_settings(mla, "d", 4096, 1))


# The defaults before they became Megatron-LM's (config.py at b3b3e7e): what every recorded
# run, shipped config and scenario ran with where it did not say otherwise.
FORMER = {"--min-lr": 3e-4, "--lr-decay-style": "cosine", "--weight-decay": 0.1,
          "--adam-beta2": 0.95, "--log-interval": 10, "--eval-iters": 4,
          "--global-batch-size": 8, "--ffn-hidden-size": 352, "--num-workers": 0}
FORMER_MOE, FORMER_MLA = {"--moe-aux-loss-coeff": 0.01}, {"--kv-lora-rank": 512}


def stated_in_yaml(path) -> set[str]:
    import yaml

    from megatron_gnmr.config import flag_name

    return {flag_name(section, name) for section, fields in yaml.safe_load(open(path)).items()
            for name in fields}


def moved_by_the_new_defaults(flags: list[str]) -> list[str]:
    """The settings a command line (with the YAML it names) leaves to a default that moved
    and that now differ from what it ran with."""
    config = parse_config(flags, announce=False)
    stated = set(flags)
    if "--config" in flags:
        stated |= stated_in_yaml(flags[flags.index("--config") + 1])
    former = {**FORMER, **(FORMER_MOE if config.model.num_experts else {}),
              **(FORMER_MLA if config.model.model_family == "deepseek-mla" else {})}
    if config.training.min_lr == config.training.lr:
        former.pop("--lr-decay-style")  # a constant LR: no decay to shape
    return [f"{flag} {absent_here(flag, config)} (ran with {value})"
            for flag, value in former.items()
            if flag not in stated and absent_here(flag, config) != value]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")),
                         ids=lambda path: path.stem)
def test_every_shipped_config_still_means_what_it_ran_with(path):
    assert moved_by_the_new_defaults(["--config", str(path)]) == []


def test_every_scenario_still_means_what_its_recorded_runs_ran_with():
    """Each run of each scenario (docs/runs holds their results) parses to the settings it
    ran with. The scenarios running while the defaults moved (attention_ladder, lr_edge and
    its pilot) are not edited; only --num-workers, which changes no sample, moved under them."""
    from megatron_gnmr.experiments.scenario import available, load_scenario

    moved = {}
    for name in available():
        scenario = load_scenario(name)
        runs = list({variant: flags for variant, _, flags in scenario.runs(smoke=False)}
                    .values())  # one seed of each variant: the seed moves no default
        if scenario.pretrain:
            runs.append(scenario.pretrain_flags(smoke=False))
        for flags in runs:
            flags = [str(f).replace("{pretrain}", "/nonexistent") for f in flags]
            found = moved_by_the_new_defaults(flags)
            if name.startswith(("attention_ladder", "lr_edge")):
                found = [f for f in found if not f.startswith("--num-workers")]
            if found:
                moved[name] = found
    assert moved == {}


# family switches whose absent meaning Megatron-LM takes from another flag of the table
DECIDED_BY = {"--use-rotary-position-embeddings": "--position-embedding-type",
              "--no-position-embedding": "--position-embedding-type"}
# translated switches whose Megatron-LM default is a behaviour megatron-gnmr does not have, read
# by hand in arguments.py at core_v0.16.1: left out, Megatron-LM checks every step for NaN and
# raises; here such a step is skipped (the other "--no-*" fusions change no arithmetic)
SWITCHED_OFF_HERE = {"--no-check-for-nan-in-loss-and-grad"}
# refused settings Megatron-LM reads only with a feature that is refused here whatever it is
# given (a flex dispatcher, multi-token prediction)
READ_ONLY_WITH = {"--moe-flex-dispatcher-backend": ("--moe-token-dispatcher-type", "flex"),
                  "--mtp-loss-scaling-factor": ("--mtp-num-layers", "1")}


def family_switches(config) -> dict[str, object]:
    """What each family switch would store in Megatron-LM's namespace for the model this
    config builds, read off megatron-core's TransformerConfig of it."""
    import torch.nn.functional as F

    from megatron_gnmr.model import transformer_config

    tc = transformer_config(config)
    silu = tc.activation_func is F.silu
    return {"--swiglu": tc.gated_linear_unit and silu, "--disable-bias-linear":
            tc.add_bias_linear, "--add-qkv-bias": tc.add_qkv_bias,
            "--qk-layernorm": tc.qk_layernorm,
            "--group-query-attention": tc.num_query_groups != tc.num_attention_heads,
            "--squared-relu": not silu, "--openai-gelu": not silu}


FAMILIES = {"llama": [], "deepseek-mla": ["--model-family", "deepseek-mla", "--q-lora-rank",
                                          "32", "--num-experts", "4"]}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_flag_of_the_table_left_out_means_megatron_lms_default(family):
    """Each of the flags the guide's table names (megatron_flags.RULES, 124), left out of a
    command line: what it means here is Megatron-LM's parser default, or a named difference
    that this run's notice names. Ours by name: compared value by value. A translation: its
    translation of Megatron-LM's default changes nothing. A family choice: the model built
    against the parser's default. A refused feature: Megatron-LM's default is the feature
    off, which is what runs here."""
    config = parse_config(FAMILIES[family], announce=False)
    flags = megatron_lm_defaults()["flags"]
    switches = family_switches(config)
    assert len(RULES) == 124 and set(RULES) <= set(flags)
    same, differ = set(), set()
    for flag, rule in RULES.items():
        entry = flags[flag]
        switch = entry["action"] in ("store_true", "store_false")
        if flag in OURS and rule.translate is None:
            equal = absent_here(flag, config) == megatron_lm_meaning(flag, config)
        elif rule.kind == "family" and switch:
            if flag in DECIDED_BY:
                assert DECIDED_BY[flag] in DIFFERENCES, flag
                continue
            equal = switches[flag] == entry["default"]
        elif rule.kind == "family":  # a valued choice: the family agrees with the default?
            equal = rule.agrees([str(entry["default"])], config.model.model_family)
        elif rule.kind == "works":  # a translation
            if switch:  # left out: nothing to translate, what runs here is the question
                assert entry["default"] != entry["given"], flag
                equal = flag not in SWITCHED_OFF_HERE
            else:
                argv = rule.translate([str(entry["default"])]) \
                    if entry["default"] is not None else []
                equal = parse_config([*FAMILIES[family], *argv], announce=False).to_dict() \
                    == config.to_dict()
        elif flag in READ_ONLY_WITH:  # refused settings of a feature refused here
            feature, on = READ_ONLY_WITH[flag]
            assert RULES[feature].kind == "refused" and not RULES[feature].unless([on])
            continue
        elif rule.unless is not None:  # refused but for the value that means "off"
            equal = entry["default"] is None or rule.unless([str(entry["default"])])
        else:  # refused outright: its default must be the feature off
            equal = entry["default"] in (None, False)
        (same if equal else differ).add(flag)
    matters = {flag for flag in DIFFERENCES if DIFFERENCES[flag].matters(config)}
    assert differ <= set(DIFFERENCES), sorted(differ - set(DIFFERENCES))
    assert not (same & matters), sorted(same & matters)  # no stale difference
    # the differences the table holds, by hand: the LLaMA architecture both families fix,
    # and the features megatron-gnmr runs in place of Megatron-LM's defaults
    expected = {"--swiglu", "--normalization", "--position-embedding-type",
                "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                "--transformer-impl", "--attention-dropout", "--hidden-dropout", "--split",
                "--no-check-for-nan-in-loss-and-grad", "--dist-ckpt-strictness"}
    if family == "deepseek-mla":
        expected |= {"--qk-layernorm", "--moe-token-dispatcher-type"}
    assert expected <= differ, sorted(expected - differ)
