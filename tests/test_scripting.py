"""TrlParser / ScriptArguments / ModelConfig / get_dataset with TRL's semantics."""

import os

import pytest

from jaxrl import (
    DatasetMixtureConfig,
    DPOConfig,
    ModelConfig,
    ScriptArguments,
    TrlParser,
    get_dataset,
    get_peft_config,
    get_quantization_config,
)

TYPES = (ScriptArguments, DPOConfig, ModelConfig)


def test_yaml_defaults_cli_overrides_env_no_flags_and_lists(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXRL_TEST_ENV", raising=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "env:\n  JAXRL_TEST_ENV: yes-set\nlearning_rate: 3.0e-4\nbeta: 0.2\n"
        "model_name_or_path: some/model\ndataset_name: d\n"
    )
    script, args, model = TrlParser(TYPES).parse_args_and_config(
        ["--config", str(recipe), "--beta", "0.5", "--loss_type", "sigmoid", "sft",
         "--no_gradient_checkpointing", "--dtype", "bfloat16"]
    )  # fmt: skip
    assert os.environ["JAXRL_TEST_ENV"] == "yes-set"
    assert (args.learning_rate, args.beta) == (3e-4, 0.5)  # YAML < command line
    assert args.loss_type == ["sigmoid", "sft"] and args.gradient_checkpointing is False
    assert (model.model_name_or_path, model.dtype, script.dataset_name) == (
        "some/model", "bfloat16", "d"
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--use_peft", "--use_dora"], "DoRA"),
        (["--load_in_4bit", "--bnb_4bit_quant_type", "fp4"], "NF4"),
        (["--load_in_8bit", "--load_in_4bit"], "at most one"),
        (["--dataset_streaming"], "map-style dataset"),
        (["--fsdp", "full_shard"], "use `mesh_fsdp`"),
        (["--bta", "0.1"], "Unknown arguments ['--bta', '0.1']"),
    ],
)
def test_bad_flags_exit_2_with_one_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        TrlParser(TYPES).parse_args_and_config(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_yaml_keys_are_errors_or_returned(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("beta: 0.3\nnot_a_field: 1\n")
    parser = TrlParser(TYPES)
    *_, remaining = parser.parse_args_and_config(
        ["--config", str(recipe)], return_remaining_strings=True
    )
    assert remaining == ["--not_a_field", "1"]
    with pytest.raises(SystemExit):
        parser.parse_args_and_config(["--config", str(recipe)], fail_with_unknown_args=False)
    assert "not_a_field" in capsys.readouterr().err


def test_peft_and_quantization_helpers():
    assert get_peft_config(ModelConfig()) is None
    assert get_quantization_config(ModelConfig()) is None


def test_get_dataset_mixture_with_fractions_and_split(tmp_path):
    for name, n in (("a", 10), ("b", 30)):
        rows = "\n".join(f'{{"text": "{name}{i}", "extra": {i}}}' for i in range(n))
        (tmp_path / f"{name}.jsonl").write_text(rows + "\n")
    mixture = DatasetMixtureConfig(
        datasets=[
            {"path": "json", "data_files": str(tmp_path / "a.jsonl"), "columns": ["text"],
             "fraction": 1.0},
            {"path": "json", "data_files": str(tmp_path / "b.jsonl"), "columns": ["text"],
             "fraction": 1.0},
        ],
        test_split_size=0.25,
    )  # fmt: skip
    ds = get_dataset(mixture)
    # Equal shares capped by the smaller dataset: 10 + 10 rows, then a 25% test split.
    assert (len(ds["train"]), len(ds["test"])) == (15, 5)
    assert ds["train"].column_names == ["text"]


def test_peft_fields_build_the_lora_and_quantization_configs():
    from jaxrl import ModelConfig, get_peft_config, get_quantization_config
    from jaxrl.lora import ALL_LINEAR, LoraConfig

    args = ModelConfig(
        use_peft=True,
        lora_r=8,
        lora_alpha=16,
        lora_target_modules=["all-linear"],
        load_in_4bit=True,
    )
    peft = get_peft_config(args)
    assert isinstance(peft, LoraConfig)
    assert (peft.r, peft.lora_alpha, peft.target_modules) == (8, 16, ALL_LINEAR)
    assert get_quantization_config(args) == "nf4"
    assert get_peft_config(ModelConfig()) is None and get_quantization_config(ModelConfig()) is None
