"""The loop's callbacks: HF's lifecycle events with `trainer=`, `add_callback` / `pop_callback` /
`remove_callback`, the reporting callbacks `report_to` and `disable_tqdm` select, and the pure
in-step `state_update`s callbacks contribute (e.g. TR-DPO's reference sync), recompiled when they
change.

`LoopCallbacksMixin` is a piece of `jaxrl.trainers.loop.TrainLoop`; the callbacks themselves are
`jaxrl.callbacks`'. No loop, checkpoint or training code here.
"""

from __future__ import annotations

from jaxrl.callbacks.base import TrainerCallback
from jaxrl.callbacks.progress import RichProgressCallback
from jaxrl.callbacks.tensorboard import TensorBoardCallback
from jaxrl.callbacks.wandb import WandbCallback


class LoopCallbacksMixin:
    """Callback dispatch and management of `TrainLoop` (`self.callback_handler`, `self.args`,
    `self.state`, `self.control` are the loop's)."""

    def _event(self, name: str, **kwargs):
        """Dispatch a lifecycle event; callbacks get `trainer=self` besides HF's kwargs."""
        self.control = getattr(self.callback_handler, name)(
            self.args,
            self.state,
            self.control,
            trainer=self,
            processing_class=self.processing_class,
            **kwargs,
        )

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Add a callback (an instance or a class), as HF's `Trainer.add_callback`."""
        before = self._state_update_callbacks()
        self.callback_handler.add_callback(callback)
        self._check_state_updates(before)

    def pop_callback(self, callback: TrainerCallback | type[TrainerCallback]):
        """Remove and return a callback (by instance or class); None if absent (HF)."""
        before = self._state_update_callbacks()
        popped = self.callback_handler.pop_callback(callback)
        self._check_state_updates(before)
        return popped

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Remove a callback (by instance or class), as HF's `Trainer.remove_callback`."""
        before = self._state_update_callbacks()
        self.callback_handler.remove_callback(callback)
        self._check_state_updates(before)

    def _state_update_callbacks(self) -> list[TrainerCallback]:
        return [cb for cb in self.callback_handler.callbacks if hasattr(cb, "state_update")]

    def _check_state_updates(self, before: list[TrainerCallback]) -> None:
        """A callback with an in-step `state_update` added or removed after the train step was
        compiled: compile it again, so the change is not silently ignored."""
        if list(map(id, self._state_update_callbacks())) != list(map(id, before)):
            self._state_updates_changed()

    def _state_updates_changed(self) -> None:
        """Hook: the callbacks' `state_update`s changed (trainers with a compiled step rebuild
        it)."""

    def _wandb_options(self) -> dict:
        """`WandbCallback` arguments (project, init_kwargs) a trainer's config sets; none here."""
        return {}

    def _reporting_callbacks(self) -> list[TrainerCallback]:
        cbs: list[TrainerCallback] = []
        report = self.args.report_to
        report = [report] if isinstance(report, str) else list(report or [])
        if "wandb" in report or "all" in report:
            cbs.append(WandbCallback(**self._wandb_options()))
        if "tensorboard" in report:
            cbs.append(TensorBoardCallback())
        if not self.args.disable_tqdm:
            cbs.append(RichProgressCallback())
        return cbs

    def _state_updates(self) -> list:
        """Pure in-step `state -> state` updates contributed by callbacks (`state_update(trainer)`),
        e.g. TR-DPO reference sync; compiled into the jitted step."""
        return [
            cb.state_update(self)
            for cb in self.callback_handler.callbacks
            if hasattr(cb, "state_update")
        ]
