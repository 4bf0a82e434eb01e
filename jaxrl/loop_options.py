"""Host-side rules for the TrainingArguments fields whose behaviour lives in the training loop:
`logging_strategy` / `logging_first_step`, and best-model tracking (`metric_for_best_model`,
`greater_is_better`) behind `save_strategy="best"` and `load_best_model_at_end`, with HF Trainer
semantics.

Pure functions of the config and metrics; they hold no state and never touch arrays or files.
`should_log` is asked by the flow callback after each step; `best_metric_name` and
`is_improvement` by the loop after each evaluation (jaxrl.trainers.loop).
"""

from __future__ import annotations

import math
from typing import Any


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
