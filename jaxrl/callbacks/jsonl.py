"""`metrics.jsonl` writer: one JSON object per logged step, written by process 0 only.

Floats are written with Python's shortest round-trip repr, so two runs with identical numbers
produce byte-identical files; a resumed run first drops the lines logged after the checkpoint it
resumes from, so its file matches an uninterrupted run's.
"""

import json
from pathlib import Path
from typing import IO, Any

from jaxrl.callbacks.base import TrainerCallback, TrainerControl, TrainerState


def _to_python(value: Any) -> Any:
    # numpy / jax scalars -> Python scalars; `.item()` of a float32 is exact as a float64.
    return value.item() if hasattr(value, "item") else value


def _parse(line: str) -> dict | None:
    # A run killed mid-write can leave a torn last line; it lies past any resume point.
    try:
        return json.loads(line) if line.endswith("\n") else None
    except json.JSONDecodeError:
        return None


class JsonlMetricsCallback(TrainerCallback):
    """Appends `{"step": ..., "epoch": ..., **logs}` to `path` on every `on_log`, flushed per line."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file: IO[str] | None = None

    def on_train_begin(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        if not state.is_world_process_zero:
            return
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            # Keep only the lines logged before the checkpoint we resume from (none on a fresh
            # run): the later ones were written by the interrupted run and will be logged again.
            # At the resumed step itself that is as many lines as the checkpoint's log_history
            # holds there (a step-0 evaluation of a run killed before its first save, or the
            # summary of a finished run, came after it).
            at_step = sum(1 for h in state.log_history if h.get("step") == state.global_step)
            kept = []
            for line in self.path.read_text().splitlines(keepends=True):
                record = _parse(line)
                if record is None or record["step"] > state.global_step:
                    continue
                if record["step"] == state.global_step:
                    if at_step == 0:
                        continue
                    at_step -= 1
                kept.append(line)
            tmp_path = self.path.with_name(self.path.name + ".tmp")
            tmp_path.write_text("".join(kept))
            tmp_path.replace(self.path)
        self._file = self.path.open("a", encoding="utf-8")

    def on_log(self, args, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        record = {"step": state.global_step, "epoch": state.epoch}
        record.update({key: _to_python(value) for key, value in (logs or {}).items()})
        # NaN/Inf are written as the JSON extensions NaN/Infinity that Python's json reads back.
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def on_train_end(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        self.close()

    def close(self) -> None:
        """Close the file (also safe to call when nothing was opened)."""
        if self._file is not None:
            self._file.close()
            self._file = None
