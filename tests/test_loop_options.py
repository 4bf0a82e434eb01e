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
