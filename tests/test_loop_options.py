"""HF rules for best-model tracking and logging_strategy, and their config validation."""

import pytest

from jaxrl import SFTConfig, loop_options
from jaxrl.config import ConfigError


def test_best_model_defaults_and_comparison():
    args = SFTConfig(
        eval_strategy="steps", eval_steps=10, save_steps=20, metric_for_best_model="accuracy"
    )
    assert args.greater_is_better is True and loop_options.best_metric_name(args) == "eval_accuracy"
    assert loop_options.is_improvement(args, {"eval_accuracy": 0.5}, None)
    assert not loop_options.is_improvement(args, {"eval_accuracy": 0.4}, 0.5)
    loss = SFTConfig(eval_strategy="steps", metric_for_best_model="eval_loss")
    assert loss.greater_is_better is False
    assert loop_options.is_improvement(loss, {"eval_loss": 0.3}, 0.4)
    assert not loop_options.is_improvement(loss, {"eval_loss": float("nan")}, 0.4)
    with pytest.raises(KeyError, match="eval_accuracy"):
        loop_options.is_improvement(args, {"eval_loss": 1.0}, None)


def test_should_log():
    args = SFTConfig(logging_first_step=True)
    assert loop_options.should_log(args, 1, 10, False)
    assert loop_options.should_log(args, 20, 10, False) and not loop_options.should_log(
        args, 21, 10, True
    )


def test_best_model_validation_as_hf():
    with pytest.raises(ConfigError, match="needs `save_strategy` equal to `eval_strategy`"):
        SFTConfig(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="steps")
    with pytest.raises(ConfigError, match="multiple of `eval_steps`"):
        SFTConfig(load_best_model_at_end=True, eval_strategy="steps", eval_steps=30, save_steps=50)
    with pytest.raises(ConfigError, match="needs `eval_strategy` 'steps' or 'epoch'"):
        SFTConfig(save_strategy="best")
    SFTConfig(load_best_model_at_end=True, eval_strategy="steps", eval_steps=10, save_steps=20)
    SFTConfig(save_strategy="best", eval_strategy="epoch", save_only_model=True)


def test_remove_unused_columns_false_is_refused_where_nothing_reads_them():
    with pytest.raises(ConfigError, match="remove_unused_columns=False` would change nothing"):
        SFTConfig(remove_unused_columns=False)


@pytest.mark.parametrize(
    "value, want",
    [
        (None, None),
        (False, None),
        ("", None),
        ("false", None),
        ("None", None),
        (True, True),
        ("true", True),
        ("True", True),
        ("latest", True),
        ("runs/a/checkpoints/checkpoint-5", "runs/a/checkpoints/checkpoint-5"),
    ],
)
def test_resume_from_checkpoint_reads_the_same_in_every_config(value, want):
    """One reading of the field: what the SIGTERM message tells the user to run
    (`--resume_from_checkpoint true`) resumes PPO and DDPO too, instead of being a path."""
    from pathlib import Path

    from jaxrl.trainers.ddpo_config import DDPOConfig, parse_ddpo_cli
    from jaxrl.trainers.ppo_config import PPOConfig

    assert loop_options.parse_resume_from_checkpoint(value) == want
    assert SFTConfig(resume_from_checkpoint=value).resume_from_checkpoint == want
    assert PPOConfig(resume_from_checkpoint=value).resume_from_checkpoint == want
    assert DDPOConfig(resume_from_checkpoint=value).resume_from_checkpoint == want
    assert DDPOConfig(resume_from=value).resume_from_checkpoint == want  # TRL's field
    if isinstance(value, str):  # the command lines: strings only
        assert parse_ddpo_cli(["--resume_from_checkpoint", value])[0].resume_from_checkpoint == want
        if want is not None:
            assert parse_ddpo_cli(["--resume_from", value])[0].resume_from_checkpoint == want
    if isinstance(want, str):
        assert loop_options.parse_resume_from_checkpoint(Path(want)) == want
    with pytest.raises(ValueError, match="resume_from_checkpoint=5 must be true"):
        loop_options.parse_resume_from_checkpoint(5)
