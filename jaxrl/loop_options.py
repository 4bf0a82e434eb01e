"""Host-side rules for the TrainingArguments fields whose behaviour lives in the training loop:
`logging_strategy`, `save_strategy="best"`, `load_best_model_at_end` (with
`metric_for_best_model` / `greater_is_better`), with HF Trainer semantics.

The loop calls these pure functions; they hold no state and never touch arrays or files.
Where each hooks in: `should_log` from the flow callback at each step and epoch end;
`best_metric_name` + `is_improvement` after each `evaluate()` (keep the step of the best
checkpoint; with `save_strategy="best"` save exactly when it improves); the best step's params are
restored after the last step when `load_best_model_at_end`. `save_only_model` (HF: a checkpoint
without optimizer state, not resumable) is a flag for the checkpoint writer.
"""

from __future__ import annotations

import math
from typing import Any


def should_log(args: Any, step: int, logging_steps: int, epoch_ended: bool) -> bool:
    """Whether to log after optimizer step `step` (1-based) under `logging_strategy`."""
    if step == 1 and args.logging_first_step:
        return True
    if args.logging_strategy == "steps":
        return step % logging_steps == 0
    if args.logging_strategy == "epoch":
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
