"""Host-side training lifecycle with HF Trainer names: state, control flags and callbacks.

`TrainerCallback`, `TrainerState`, `TrainerControl`, `CallbackHandler` and `DefaultFlowCallback`
mirror `transformers.trainer_callback` so HF/TRL callbacks port with few changes. Callbacks run on
the host between jitted steps; they must never hold the only copy of training math.
"""

import dataclasses
import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxrl import loop_options

logger = logging.getLogger(__name__)


@dataclass
class TrainerState:
    """Loop progress saved with every checkpoint (same field names as HF `TrainerState`)."""

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: float = 0.0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    # HF: training input tokens so far (counted when `include_num_input_tokens_seen` is set).
    num_input_tokens_seen: int = 0
    # HF: class name -> `state()` (or a list, for several) of the `ExportableState` callbacks
    # at the last save; restored with `restore_callback_states_from_checkpoint`.
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True

    def compute_steps(self, args: Any, max_steps: int) -> None:
        """Resolve `args.{logging,eval,save}_steps` (a count, or a ratio < 1 of max_steps) as HF."""
        self.max_steps = max_steps
        for kind in ("logging", "eval", "save"):
            num_steps = getattr(args, f"{kind}_steps")
            if num_steps is not None:
                if num_steps < 1:
                    num_steps = math.ceil(max_steps * num_steps)
                setattr(self, f"{kind}_steps", int(num_steps))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict (what checkpoints store as metadata)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainerState":
        """Inverse of `to_dict`."""
        return cls(**data)

    def save_to_json(self, json_path: str | Path) -> None:
        """Write the state to `json_path` (HF format: indented, sorted keys)."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        Path(json_path).write_text(text, encoding="utf-8")

    @classmethod
    def load_from_json(cls, json_path: str | Path) -> "TrainerState":
        """Read a state written by `save_to_json`."""
        return cls.from_dict(json.loads(Path(json_path).read_text(encoding="utf-8")))


@dataclass
class TrainerControl:
    """Flags callbacks set to steer the loop; the handler resets them as HF does."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False


class TrainerCallback:
    """Base class: override the events you need. Each gets `(args, state, control, **kwargs)`.

    Returning a `TrainerControl` replaces the loop's control; returning None keeps it.
    `on_log` receives `logs=`, `on_evaluate` receives `metrics=`.
    """

    def on_init_end(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        """Called at the end of the trainer's `__init__`."""

    def on_train_begin(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        """Called before the first step (after a resume, `state.global_step` > 0)."""

    def on_train_end(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        """Called once training stops."""

    def on_epoch_begin(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        """Called at the start of each epoch."""

    def on_epoch_end(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        """Called at the end of each epoch."""

    def on_step_begin(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        """Called before each optimizer step (one step covers all accumulation micro-batches)."""

    def on_step_end(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        """Called after each optimizer step, with `state.global_step` already incremented."""

    def on_evaluate(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        """Called after an evaluation, with `metrics=`."""

    def on_predict(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        """Called after `trainer.predict()`, with `metrics=`."""

    def on_save(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        """Called after a checkpoint save is started."""

    def on_log(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        """Called with `logs=` (a dict of host floats) whenever metrics are logged."""


_EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_step_end",
    "on_evaluate",
    "on_predict",
    "on_save",
    "on_log",
)


class CallbackHandler(TrainerCallback):
    """Calls a list of callbacks in order and threads `control` through them (HF semantics)."""

    def __init__(self, callbacks: list[TrainerCallback | type[TrainerCallback]] | None = None):
        self.callbacks: list[TrainerCallback] = []
        for callback in callbacks or []:
            self.add_callback(callback)

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Append a callback instance, or instantiate and append a callback class."""
        instance = callback() if isinstance(callback, type) else callback
        if any(type(c) is type(instance) for c in self.callbacks):
            logger.warning(
                "Adding a second %s; current callbacks: %s",
                type(instance).__name__,
                self.callback_list,
            )
        self.callbacks.append(instance)

    def pop_callback(
        self, callback: TrainerCallback | type[TrainerCallback]
    ) -> TrainerCallback | None:
        """Remove and return the first callback of this class (or this instance); None if absent."""
        for candidate in self.callbacks:
            if (isinstance(callback, type) and isinstance(candidate, callback)) or (
                candidate is callback
            ):
                self.callbacks.remove(candidate)
                return candidate
        return None

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Remove the first callback of this class (or this instance)."""
        self.pop_callback(callback)

    @property
    def callback_list(self) -> str:
        return ", ".join(type(c).__name__ for c in self.callbacks)

    def call_event(self, event: str, args, state: TrainerState, control: TrainerControl, **kwargs):
        """Dispatch `event` to every callback in order; returns the resulting control."""
        if event not in _EVENTS:
            raise ValueError(f"Unknown callback event {event!r}; valid events: {list(_EVENTS)}.")
        for callback in self.callbacks:
            result = getattr(callback, event)(args, state, control, **kwargs)
            if result is not None:
                control = result
        return control

    def on_init_end(self, args, state, control, **kwargs):
        return self.call_event("on_init_end", args, state, control, **kwargs)

    def on_train_begin(self, args, state, control, **kwargs):
        control.should_training_stop = False
        return self.call_event("on_train_begin", args, state, control, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        return self.call_event("on_train_end", args, state, control, **kwargs)

    def on_epoch_begin(self, args, state, control, **kwargs):
        control.should_epoch_stop = False
        return self.call_event("on_epoch_begin", args, state, control, **kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):
        return self.call_event("on_epoch_end", args, state, control, **kwargs)

    def on_step_begin(self, args, state, control, **kwargs):
        control._new_step()
        return self.call_event("on_step_begin", args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        return self.call_event("on_step_end", args, state, control, **kwargs)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        control.should_evaluate = False
        return self.call_event("on_evaluate", args, state, control, metrics=metrics, **kwargs)

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        return self.call_event("on_predict", args, state, control, metrics=metrics, **kwargs)

    def on_save(self, args, state, control, **kwargs):
        control.should_save = False
        return self.call_event("on_save", args, state, control, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        control.should_log = False
        return self.call_event("on_log", args, state, control, logs=logs, **kwargs)


class ExportableState:
    """HF's protocol for a callback whose state checkpoints keep: `state()` returns
    `{"args": constructor kwargs, "attributes": attributes to set}`; `from_state` rebuilds it."""

    def state(self) -> dict:
        raise NotImplementedError("An ExportableState callback implements `state()`.")

    @classmethod
    def from_state(cls, state: dict):
        instance = cls(**state.get("args", {}))
        for name, value in state.get("attributes", {}).items():
            setattr(instance, name, value)
        return instance


def is_exportable(callback: Any) -> bool:
    """jaxrl's `ExportableState`, or transformers' (a callback written for HF's Trainer)."""
    if isinstance(callback, ExportableState):
        return True
    # Importing `transformers.trainer_callback` pulls in torch and peft (seconds): if nobody has
    # imported it, no object can be an instance of its classes.
    hf_module = sys.modules.get("transformers.trainer_callback")
    return hf_module is not None and isinstance(callback, hf_module.ExportableState)


class EarlyStoppingCallback(TrainerCallback, ExportableState):
    """HF's `EarlyStoppingCallback`: stop training once `metric_for_best_model` has failed to
    improve on the best value so far (by more than `early_stopping_threshold`) for
    `early_stopping_patience` evaluations in a row. Needs `metric_for_best_model` and an
    `eval_strategy`; warns without `load_best_model_at_end`. Its counter is saved with each
    checkpoint (`restore_callback_states_from_checkpoint` brings it back on resume)."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0):
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.early_stopping_patience_counter = 0  # evaluations in a row without improvement

    def on_train_begin(self, args, state, control, **kwargs):
        if not args.load_best_model_at_end:
            logger.warning(
                "EarlyStoppingCallback without load_best_model_at_end=True: the best model is "
                "not loaded when training ends."
            )
        if args.metric_for_best_model is None:
            raise ValueError("EarlyStoppingCallback needs `metric_for_best_model` to be set.")
        if args.eval_strategy == "no":
            raise ValueError(
                "EarlyStoppingCallback needs evaluations: set `eval_strategy` to 'steps' or 'epoch'."
            )

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        name = args.metric_for_best_model
        name = name if name.startswith("eval_") else f"eval_{name}"
        value = (metrics or {}).get(name)
        if value is None:
            logger.warning("EarlyStoppingCallback: no %r in the eval metrics; not stopping.", name)
            return
        # `state.best_metric` is the best before this evaluation (the loop updates it after).
        best = state.best_metric
        if best is None:
            improved = True
        else:
            better = value > best if args.greater_is_better else value < best
            improved = better and abs(value - best) > self.early_stopping_threshold
        if improved:
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True

    def state(self) -> dict:
        return {
            "args": {
                "early_stopping_patience": self.early_stopping_patience,
                "early_stopping_threshold": self.early_stopping_threshold,
            },
            "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter},
        }


class DefaultFlowCallback(TrainerCallback):
    """Sets should_log / should_evaluate / should_save / should_training_stop from the config.

    Same rules as HF: log every `logging_steps` under `logging_strategy="steps"` or at each epoch
    end under "epoch" (and step 1 if `logging_first_step`), evaluate and save every `eval_steps` /
    `save_steps` under the "steps" strategies or at each epoch end under "epoch", and at
    `max_steps` stop, evaluate (if not just done) and save. `save_strategy="best"` saves after an
    evaluation that improved the best metric (the loop decides that). No periodic evaluation
    happens before `eval_delay` steps ("steps") or epochs ("epoch").
    """

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if loop_options.should_log(args, step, state.logging_steps, epoch_ended=False):
            control.should_log = True
        delayed = step < getattr(args, "eval_delay", 0)
        if args.eval_strategy == "steps" and step % state.eval_steps == 0 and not delayed:
            control.should_evaluate = True
        if args.save_strategy == "steps" and state.save_steps > 0 and step % state.save_steps == 0:
            control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            if args.eval_strategy == "steps" and step % state.eval_steps != 0 and not delayed:
                control.should_evaluate = True
            if args.save_strategy == "steps":
                control.should_save = True
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if getattr(args, "logging_strategy", "steps") == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch" and state.epoch >= getattr(args, "eval_delay", 0):
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control
