"""Configs: TRL defaults, YAML/CLI loading, type coercion and validation messages."""

import dataclasses
import warnings
from pathlib import Path

import pytest

from jaxrl import DPOConfig, RewardConfig, SFTConfig, TrainingConfig, config_checks
from jaxrl.config import ConfigError
from jaxrl.config_cli import parse_config
from jaxrl.trainers.registry import ALGORITHMS

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "jaxrl" / "recipes"


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


# Deliberate differences from TRL/HF defaults (ours, theirs).
_DEVIATIONS = {
    "output_dir": ("trainer_output", None),  # HF resolves None to "trainer_output" later
    "optim": ("adamw_torch", "adamw_torch_fused"),  # both map to optax.adamw
    "disable_tqdm": (False, None),  # HF resolves None from the log level
}


@pytest.mark.parametrize("ours", [SFTConfig, RewardConfig, DPOConfig], ids=lambda c: c.__name__)
def test_defaults_match_trl(ours):
    trl = pytest.importorskip("trl")
    mine, theirs = _defaults(ours), _defaults(getattr(trl, ours.__name__))
    diff = {k: (mine[k], theirs[k]) for k in mine if k in theirs and mine[k] != theirs[k]}
    assert diff == {k: v for k, v in _DEVIATIONS.items() if k in mine and k in theirs}
    assert mine["learning_rate"] == theirs["learning_rate"]


def test_resolved_defaults():
    sft = SFTConfig()
    assert (sft.learning_rate, sft.logging_steps, sft.eval_steps) == (2e-5, 10, 10)
    assert sft.bf16 is True and sft.compute_dtype == "bfloat16"
    assert sft.remat_policy == "full" and sft.report_to == []
    assert SFTConfig(fp16=True).bf16 is False
    assert SFTConfig(report_to=None).report_to == SFTConfig(report_to="none").report_to == []
    assert SFTConfig(report_to="none,wandb").report_to == ["wandb"]
    assert SFTConfig(gradient_checkpointing=False).remat_policy == "none"
    assert RewardConfig().learning_rate == 1e-4
    dpo = DPOConfig(loss_type="ipo")
    assert dpo.learning_rate == 1e-6 and dpo.loss_type == ["ipo"]
    assert [ALGORITHMS[a].config_class for a in ("sft", "reward", "dpo")] == [
        SFTConfig,
        RewardConfig,
        DPOConfig,
    ]


@pytest.mark.parametrize("cls", [SFTConfig, RewardConfig, DPOConfig], ids=lambda c: c.__name__)
def test_pad_to_multiple_of_spellings(cls):
    """TRL's default "auto" is None off AWS Neuron; the CLI's strings resolve as TRL's do."""
    assert cls().pad_to_multiple_of is None
    assert cls(pad_to_multiple_of="64").pad_to_multiple_of == 64
    assert cls(pad_to_multiple_of="None").pad_to_multiple_of is None
    assert cls(pad_to_multiple_of="null").pad_to_multiple_of is None
    assert cls(pad_to_multiple_of=8).pad_to_multiple_of == 8
    with pytest.raises(ConfigError, match="integer >= 1, None or 'auto'; got 'eight'"):
        cls(pad_to_multiple_of="eight")
    with pytest.raises(ConfigError, match="must be None or >= 1; got 0"):
        cls(pad_to_multiple_of="0")


def test_warmup_steps_int_or_ratio():
    assert TrainingConfig(warmup_steps=5).get_warmup_steps(100) == 5
    assert TrainingConfig(warmup_steps=0.1).get_warmup_steps(95) == 10  # ceil(9.5)
    assert TrainingConfig(warmup_ratio=0.2).get_warmup_steps(10) == 2
    with pytest.raises(ConfigError, match="only one of `warmup_steps` and `warmup_ratio`"):
        TrainingConfig(warmup_steps=3, warmup_ratio=0.1)


def test_cli_yaml_overrides_precedence(tmp_path):
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text("learning_rate: 1.0e-3\nmax_steps: 7\ndataset_name: from_yaml\n")
    config, script = parse_config(
        DPOConfig,
        yaml_path,
        cli_args=[
            "--max_steps=9",
            "--loss_type",
            "sigmoid,ipo",
            "--loss_weights",
            "[0.25, 0.75]",
            "--bf16",
            "false",
            "--reference_free",
            "--lr_scheduler_type",
            "cosine_with_min_lr",
            "--lr_scheduler_kwargs",
            '{"min_lr": 1e-7}',
            "--model_name_or_path",
            "tiny",
            "--warmup_steps",
            "0.1",
        ],
        overrides={"max_steps": 11},
    )
    assert config.learning_rate == 1e-3  # yaml
    assert config.max_steps == 11  # overrides beat the command line
    assert config.loss_type == ["sigmoid", "ipo"] and config.loss_weights == [0.25, 0.75]
    assert config.bf16 is False and config.reference_free is True
    assert config.lr_scheduler_kwargs == {"min_lr": 1e-7}
    assert config.warmup_steps == 0.1
    assert script.model_name_or_path == "tiny" and script.dataset_name == "from_yaml"
    assert script.config == str(yaml_path)


def test_cli_config_flag_and_types(tmp_path):
    (tmp_path / "c.yaml").write_text("per_device_train_batch_size: 3\n")
    config, script = parse_config(
        SFTConfig,
        cli_args=[
            "--config",
            str(tmp_path / "c.yaml"),
            "--algo",
            "sft",
            "--learning-rate",
            "1e-4",
            "--max_length",
            "None",
            "--report_to",
            "wandb",
            "--resume_from_checkpoint",
            "latest",
            "--logical_axis_rules",
            '[["embed", "fsdp"], ["mlp", ["tensor"]], ["vocab", null]]',
        ],
    )
    assert config.per_device_train_batch_size == 3 and script.algo == "sft"
    assert config.learning_rate == 1e-4 and config.max_length is None
    assert config.report_to == ["wandb"] and config.resume_from_checkpoint is True
    assert config.logical_axis_rules == [["embed", "fsdp"], ["mlp", ["tensor"]], ["vocab", None]]


@pytest.mark.parametrize(
    "cli, message",
    [
        (["--learning_rat", "1"], r"Unknown key 'learning_rat'.*Did you mean 'learning_rate'"),
        (["--max_steps", "abc"], r"`max_steps` expects int; got 'abc'"),
        (["--packing", "maybe"], r"`packing` expects bool"),
        (
            ["--optim", "adam_w"],
            r"`optim='adam_w'` is not valid; choose one of \['adamw_torch'",
        ),
        (["--max_steps"], r"Flag `--max_steps` needs a value"),
        (["stray"], r"Unexpected command-line argument 'stray'"),
        (["--eval_steps", "2.5"], r"`eval_steps` must be an integer when >= 1"),
        (["--mesh_data", "-1", "--mesh_fsdp", "-1"], r"At most one of"),
        (["--logical_axis_rules", '[["embed", "model"]]'], r"unknown mesh axis 'model'"),
    ],
)
def test_bad_cli_raises_clear_error(cli, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(SFTConfig, cli_args=cli)


def test_unknown_yaml_key(tmp_path):
    (tmp_path / "c.yaml").write_text("betta: 0.2\n")
    with pytest.raises(ConfigError, match=r"Unknown key 'betta' in .*c.yaml.*'beta'"):
        parse_config(DPOConfig, tmp_path / "c.yaml")


def test_dpo_validation_like_trl():
    with pytest.raises(ConfigError, match="same length as `loss_type`"):
        DPOConfig(loss_type=["sigmoid", "ipo"], loss_weights=[1.0])
    with pytest.raises(ConfigError, match="sync_ref_model=True` cannot be combined"):
        DPOConfig(sync_ref_model=True, precompute_ref_log_probs=True)
    with pytest.raises(ConfigError, match="label_smoothing` > 0"):
        DPOConfig(loss_type="exo_pair")
    with pytest.raises(ConfigError, match="`loss_type='kto'` is not valid"):
        DPOConfig(loss_type="kto")
    with pytest.raises(ConfigError, match="ref_model_quantization"):
        DPOConfig(ref_model_quantization="int4")


def test_unsupported_trl_values_are_rejected():
    # The models' dropout is implemented: TRL's default True and False are both accepted.
    assert RewardConfig().disable_dropout and DPOConfig().disable_dropout
    assert not RewardConfig(disable_dropout=False).disable_dropout
    assert not DPOConfig(disable_dropout=False).disable_dropout
    with pytest.raises(ConfigError, match="label_pad_token_id"):
        DPOConfig(label_pad_token_id=0)


def test_choices_match_the_code_that_honours_them():
    from jaxrl.losses import dpo, sft
    from jaxrl.losses.dpo import LOSS_TYPES
    from jaxrl.models.config import REMAT_POLICIES

    assert config_checks.DPO_LOSS_TYPES == LOSS_TYPES
    assert config_checks.DPO_F_DIVERGENCE_TYPES == dpo.F_DIVERGENCE_TYPES
    assert config_checks.DPO_F_DIVERGENCE_LOSS_TYPES == dpo.F_DIVERGENCE_LOSS_TYPES
    assert config_checks.SFT_LOSS_TYPES == sft.SFT_LOSS_TYPES
    assert config_checks.REMAT_POLICIES == REMAT_POLICIES
    for remat_policy in REMAT_POLICIES:
        assert SFTConfig(remat_policy=remat_policy).remat_policy == remat_policy


def test_model_init_kwargs_sets_param_dtype():
    config = SFTConfig(model_init_kwargs={"torch_dtype": "bfloat16"})
    assert config.param_dtype == "bfloat16" and config.model_init_kwargs == {"dtype": "bfloat16"}
    # TRL scripts pass attn_implementation: exact-attention kernels map to jaxrl's attention.
    assert SFTConfig(model_init_kwargs={"attn_implementation": "sdpa"}).param_dtype == "float32"
    with pytest.raises(ConfigError, match="`attn_implementation='flex_attention'` has no JAX"):
        SFTConfig(model_init_kwargs={"attn_implementation": "flex_attention"})
    with pytest.raises(ConfigError, match=r"keys \['device_map'\] are not supported"):
        SFTConfig(model_init_kwargs={"device_map": "auto"})
    with pytest.raises(ConfigError, match="conflicts with `param_dtype='float16'`"):
        SFTConfig(model_init_kwargs={"dtype": "bfloat16"}, param_dtype="float16")


def test_max_seq_length_alias_warns_and_maps():
    with pytest.warns(FutureWarning, match="max_seq_length"):
        config = SFTConfig(max_seq_length=256)
    assert config.max_length == 256


def test_yaml_round_trip(tmp_path):
    config, _ = parse_config(DPOConfig, cli_args=["--beta", "0.5", "--loss_type", "ipo"])
    config.to_yaml(tmp_path / "out" / "config.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, _ = parse_config(DPOConfig, tmp_path / "out" / "config.yaml")
    assert again == config and again.beta == 0.5


@pytest.mark.parametrize("algo", ["sft", "reward", "dpo"])
def test_embedded_yaml_configs_load(algo):
    spec = ALGORITHMS[algo]
    config, _ = parse_config(spec.config_class, CONFIGS_DIR / f"{spec.recipe}.yaml")
    assert config.output_dir == f"outputs/{algo}" and config.bf16 is False
    assert config.max_steps > 0 and config.save_steps % config.eval_steps == 0


def test_dpo_truncation_defaults_follow_trl_1_16():
    """TRL 1.16 has no max_prompt_length and keeps a long sequence's start; jaxrl's default is
    the same, and TRL < 1.0's prompt truncation is opt-in with `max_prompt_length`."""
    config = DPOConfig()
    assert (config.truncation_mode, config.max_prompt_length) == ("keep_start", None)
    assert DPOConfig(max_prompt_length=32, truncation_mode="keep_end").truncation_mode == "keep_end"
    with pytest.raises(ConfigError, match="needs `max_prompt_length` set"):
        DPOConfig(truncation_mode="keep_end")
    with pytest.raises(ConfigError, match="`loss_type='kl'` is not valid"):
        SFTConfig(loss_type="kl")
    with pytest.warns(FutureWarning, match="alias"):
        assert SFTConfig(loss_type="chunked_nll").loss_type == "nll"
