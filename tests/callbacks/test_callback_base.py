"""HF-style lifecycle: DefaultFlowCallback flags, handler dispatch, TrainerState JSON."""

import pytest

from jaxrl.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from jaxrl.config import TrainingConfig


def _run(args: TrainingConfig, max_steps: int, steps_per_epoch: int | None = None) -> dict:
    """Drive the handler like a training loop; record the steps at which each flag fired."""
    handler = CallbackHandler([DefaultFlowCallback])
    state, control = TrainerState(), TrainerControl()
    state.compute_steps(args, max_steps)
    fired = {"log": [], "evaluate": [], "save": [], "stop": []}
    control = handler.on_train_begin(args, state, control)
    while not control.should_training_stop:
        control = handler.on_step_begin(args, state, control)
        state.global_step += 1
        control = handler.on_step_end(args, state, control)
        if steps_per_epoch and state.global_step % steps_per_epoch == 0:
            control = handler.on_epoch_end(args, state, control)
        for name in ("log", "evaluate", "save"):
            if getattr(control, f"should_{name}"):
                fired[name].append(state.global_step)
        if control.should_log:
            control = handler.on_log(args, state, control, logs={"loss": 1.0})
            assert control.should_log is False
    fired["stop"].append(state.global_step)
    return fired


def test_default_flow_steps_strategy():
    args = TrainingConfig(
        logging_steps=10, logging_first_step=True, eval_strategy="steps", save_steps=20
    )
    assert _run(args, max_steps=25) == {
        "log": [1, 10, 20],
        "evaluate": [10, 20, 25],  # eval_steps defaults to logging_steps; +final step
        "save": [20, 25],
        "stop": [25],
    }


def test_default_flow_epoch_strategy_and_ratio_steps():
    args = TrainingConfig(logging_steps=0.25, eval_strategy="epoch", save_strategy="epoch")
    fired = _run(args, max_steps=8, steps_per_epoch=4)
    assert fired == {"log": [2, 4, 6, 8], "evaluate": [4, 8], "save": [4, 8], "stop": [8]}


class _Stopper(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(kwargs.get("extra"))
        return TrainerControl(should_training_stop=True)


def test_handler_threads_control_and_manages_callbacks():
    stopper = _Stopper()
    handler = CallbackHandler([DefaultFlowCallback(), stopper])
    control = handler.on_step_end(
        TrainingConfig(), TrainerState(global_step=1, max_steps=9), TrainerControl(), extra=7
    )
    assert control.should_training_stop is True and stopper.seen == [7]

    assert handler.pop_callback(_Stopper) is stopper
    assert handler.pop_callback(_Stopper) is None
    handler.add_callback(stopper)
    handler.remove_callback(stopper)
    handler.remove_callback(DefaultFlowCallback)
    assert handler.callbacks == []
    with pytest.raises(ValueError, match="Unknown callback event 'on_banana'"):
        handler.call_event("on_banana", None, TrainerState(), TrainerControl())


def test_step_begin_resets_step_flags_only():
    control = TrainerControl(should_log=True, should_save=True, should_training_stop=True)
    control = CallbackHandler().on_step_begin(None, TrainerState(), control)
    assert (control.should_log, control.should_save, control.should_training_stop) == (
        False,
        False,
        True,
    )


def test_trainer_state_json_round_trip(tmp_path):
    state = TrainerState(global_step=12, epoch=1.5, max_steps=40, train_batch_size=8)
    state.log_history.append({"step": 12, "loss": 0.123456789012345})
    state.save_to_json(tmp_path / "trainer_state.json")
    assert TrainerState.load_from_json(tmp_path / "trainer_state.json") == state
