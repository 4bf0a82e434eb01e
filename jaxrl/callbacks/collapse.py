"""Warn when training has collapsed: the gradient is exactly zero while the loss is not.

A zero gradient norm with a non-zero loss for several logged steps in a row means nothing is
learning any more (every trained token masked out, a frozen model, dead activations after a
blow-up, or an underflowed loss scale) and the rest of the run is wasted compute. This callback
only reads the logs and warns; it never stops the run.
"""

import logging

from jaxrl.callbacks.base import TrainerCallback, TrainerControl, TrainerState

logger = logging.getLogger("jaxrl")


class CollapseWarningCallback(TrainerCallback):
    """Log one warning after `patience` consecutive logs with `grad_norm == 0` and `loss != 0`."""

    def __init__(self, patience: int = 3):
        if patience < 1:
            raise ValueError(f"patience must be >= 1; got {patience}.")
        self.patience = patience
        self._streak = 0

    def on_train_begin(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        self._streak = 0

    def on_log(self, args, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        logs = logs or {}
        if "grad_norm" not in logs or "loss" not in logs:
            return  # eval and summary logs carry no gradient
        if logs["grad_norm"] == 0.0 and logs["loss"] != 0.0:
            self._streak += 1
        else:
            self._streak = 0
        if self._streak == self.patience:
            logger.warning(
                "Training has collapsed: grad_norm is exactly 0 with loss %.4g for %d logged "
                "steps in a row (up to step %d), so the parameters no longer change. Check that "
                "some tokens are trained (labels not all -100, completion_only_loss / "
                "assistant_only_loss masks), lower learning_rate if the loss blew up earlier, "
                "and with fp16 try bf16.",
                logs["loss"],
                self.patience,
                state.global_step,
            )
