"""CollapseWarningCallback: warns once after `patience` zero-gradient logs, not before."""

import logging

from jaxrl.callbacks.base import TrainerControl, TrainerState
from jaxrl.callbacks.collapse import CollapseWarningCallback


def _feed(cb, rows):
    state = TrainerState()
    for step, (loss, grad_norm) in enumerate(rows, start=1):
        state.global_step = step
        cb.on_log(None, state, TrainerControl(), logs={"loss": loss, "grad_norm": grad_norm})


def test_warns_after_patience_zero_grad_logs(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxrl"):
        _feed(CollapseWarningCallback(patience=3), [(2.0, 1.0), (2.0, 0.0), (2.0, 0.0), (2.0, 0.0)])
    warnings = [r for r in caplog.records if "collapsed" in r.getMessage()]
    assert len(warnings) == 1 and "up to step 4" in warnings[0].getMessage()


def test_no_warning_for_a_streak_broken_or_a_zero_loss(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxrl"):
        cb = CollapseWarningCallback(patience=3)
        _feed(cb, [(2.0, 0.0), (2.0, 0.0), (2.0, 0.5), (2.0, 0.0), (2.0, 0.0)])
        _feed(CollapseWarningCallback(patience=3), [(0.0, 0.0)] * 5)  # solved, not collapsed
    assert "collapsed" not in caplog.text
