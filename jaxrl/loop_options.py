"""Host-side rules for the TrainingArguments fields whose behaviour lives in the training loop:
`logging_strategy` / `logging_first_step`, best-model tracking (`metric_for_best_model`,
`greater_is_better`) behind `save_strategy="best"` and `load_best_model_at_end`, with HF Trainer
semantics, and the one reading of `resume_from_checkpoint` every trainer's config shares.

Pure functions of the config and metrics; they hold no state and never touch arrays or files.
`should_log` is asked by the flow callback after each step; `best_metric_name` and
`is_improvement` by the loop after each evaluation (jaxrl.trainers.loop).
"""

from __future__ import annotations

import math
import os
from typing import Any

# `resume_from_checkpoint` spellings from YAML or a command line (any case).
_RESUME_LATEST = ("true", "latest", "yes", "on", "1")
_RESUME_OFF = ("", "false", "no", "off", "0", "none", "null")


def parse_resume_from_checkpoint(value: Any) -> bool | str | None:
    """The one reading of `resume_from_checkpoint` (every config and `train()`): None when the
    run starts fresh (None, False, "", "false", "none"), True for the newest checkpoint of this
    run (HF's True; also "true" and "latest", as the CLI spells it), else the path as a string.
    A command line gives strings only, so "true" must not be taken for a path."""
    if value is None or value is False:
        return None
    if value is True:
        return True
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _RESUME_OFF:
            return None
        if text in _RESUME_LATEST:
            return True
        return value
    raise ValueError(
        f"resume_from_checkpoint={value!r} must be true (the newest checkpoint of this run), "
        "false, or the path of a checkpoint-N directory or of a run's output_dir."
    )


def should_log(args: Any, step: int, logging_steps: int, epoch_ended: bool) -> bool:
    """Whether to log after optimizer step `step` (1-based) under `logging_strategy`."""
    if step == 1 and getattr(args, "logging_first_step", False):
        return True
    strategy = getattr(args, "logging_strategy", "steps")  # configs without the field: "steps"
    if strategy == "steps":
        return step % logging_steps == 0
    if strategy == "epoch":
        return epoch_ended
    return False


def best_metric_name(args: Any) -> str:
    """The logged eval metric `metric_for_best_model` names (HF adds the "eval_" prefix)."""
    name = args.metric_for_best_model or "loss"
    return name if name.startswith("eval_") else f"eval_{name}"


def is_improvement(args: Any, metrics: dict[str, float], best: float | None) -> bool:
    """Whether `metrics` (an `evaluate()` result) beats `best` (None: nothing seen yet)."""
    name = best_metric_name(args)
    if name not in metrics:
        raise KeyError(
            f"metric_for_best_model={args.metric_for_best_model!r} names {name!r}, which the "
            f"evaluation did not produce; choose one of {sorted(metrics)}."
        )
    value = metrics[name]
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    return value > best if args.greater_is_better else value < best
