"""The table of algorithms: every `--algo` has one entry whose config class, trainer class,
recipe and script flags agree with the trainers and the CLI."""

import dataclasses
from pathlib import Path

import pytest

from jaxrl.config_cli import OnlineScriptArguments, ScriptArguments, parse_config
from jaxrl.train import CONFIG_DIR, usage
from jaxrl.trainers.registry import ALGORITHMS


def test_every_algorithm_has_one_entry_under_its_name():
    assert list(ALGORITHMS) == [
        "sft", "reward", "dpo", "kto", "ppo", "grpo", "rloo", "distill", "ddpo"
    ]  # fmt: skip
    assert all(spec.name == name for name, spec in ALGORITHMS.items())
    online = [name for name, spec in ALGORITHMS.items() if spec.takes_reward_funcs]
    assert online == ["grpo", "rloo"]


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_entry_agrees_with_its_trainer_and_recipe(name):
    spec = ALGORITHMS[name]
    # Trainers that check `args` against a config class check against the registered one.
    assert getattr(spec.trainer_class, "config_class", spec.config_class) is spec.config_class
    assert spec.script_class in (ScriptArguments, OnlineScriptArguments, None)
    if spec.recipe is None:
        assert spec.script_class is None  # DDPO: its defaults are the embedded job
        return
    recipe = Path(CONFIG_DIR) / f"{spec.recipe}.yaml"
    config, script = parse_config(spec.config_class, recipe, script_class=spec.script_class)
    assert type(config) is spec.config_class and type(script) is spec.script_class


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_help_lists_the_registered_classes(name):
    spec = ALGORITHMS[name]
    text = usage(name)
    assert f"{spec.config_class.__name__} (the algorithm's own):" in text
    if spec.script_class is not None:  # the script's flags are listed too
        for field in dataclasses.fields(spec.script_class):
            if field.init and field.name != "algo":
                assert f"  --{field.name} (" in text, field.name
