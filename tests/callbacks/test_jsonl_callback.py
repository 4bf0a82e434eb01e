"""metrics.jsonl: one line per log, full float precision, resume truncation."""

import json

import numpy as np

from jaxrl.callbacks import JsonlMetricsCallback, TrainerControl, TrainerState
from jaxrl.config import TrainingConfig

ARGS = TrainingConfig()


def _log_steps(callback, state, steps):
    for step in steps:
        state.global_step, state.epoch = step, step / 40
        logs = {"loss": np.float32(1.0 / step), "rewards/chosen": 0.1 + 0.2 * step}
        callback.on_log(ARGS, state, TrainerControl(), logs=logs)


def test_lines_have_step_epoch_and_exact_floats(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    callback = JsonlMetricsCallback(path)
    state = TrainerState()
    callback.on_train_begin(ARGS, state, TrainerControl())
    _log_steps(callback, state, [10, 20])
    # Flushed per line: readable before the run ends.
    records = [json.loads(line) for line in path.read_text().splitlines()]
    callback.on_train_end(ARGS, state, TrainerControl())
    assert [r["step"] for r in records] == [10, 20]
    assert list(records[0]) == ["step", "epoch", "loss", "rewards/chosen"]
    assert records[1]["epoch"] == 0.5
    assert records[1]["rewards/chosen"] == 0.1 + 0.2 * 20  # bit-exact round trip
    assert np.float32(records[0]["loss"]) == np.float32(1.0 / 10)


def test_resume_truncates_to_match_uninterrupted_run(tmp_path):
    full_path, resumed_path = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    full = JsonlMetricsCallback(full_path)
    state = TrainerState()
    full.on_train_begin(ARGS, state, TrainerControl())
    _log_steps(full, state, [10, 20, 30, 40])
    full.on_train_end(ARGS, state, TrainerControl())

    # Interrupted after logging 30, resumed from the checkpoint at step 20.
    first = JsonlMetricsCallback(resumed_path)
    state = TrainerState()
    first.on_train_begin(ARGS, state, TrainerControl())
    _log_steps(first, state, [10, 20, 30])
    first.close()
    with resumed_path.open("a") as f:
        f.write('{"step": 40, "loss": 0.')  # killed mid-line
    second = JsonlMetricsCallback(resumed_path)
    # The checkpoint's state: its log_history holds what was logged before it was saved.
    state = TrainerState(global_step=20, log_history=[{"step": 10}, {"step": 20}])
    second.on_train_begin(ARGS, state, TrainerControl())
    assert [json.loads(x)["step"] for x in resumed_path.read_text().splitlines()] == [10, 20]
    _log_steps(second, state, [30, 40])
    second.on_train_end(ARGS, state, TrainerControl())

    assert resumed_path.read_bytes() == full_path.read_bytes()


def test_fresh_run_replaces_old_file_and_non_zero_process_writes_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 5, "loss": 1.0}\n')
    callback = JsonlMetricsCallback(path)
    callback.on_train_begin(ARGS, TrainerState(), TrainerControl())
    assert path.read_text() == ""
    other = TrainerState(global_step=3, is_world_process_zero=False)
    JsonlMetricsCallback(path).on_log(ARGS, other, TrainerControl(), logs={"loss": 1.0})
    callback.close()
    assert path.read_text() == ""


def test_resume_drops_lines_logged_after_the_checkpoint_at_its_step(tmp_path):
    """At the resumed step, only as many lines as the checkpoint's log_history holds there: a
    step-0 eval of a run killed before its first save and a finished run's summary (both logged
    after that checkpoint) would otherwise appear twice once logged again."""
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 0, "eval_loss": 2.0},
        {"step": 1, "loss": 1.5},
        {"step": 2, "loss": 1.0},
        {"step": 2, "eval_loss": 1.2},
        {"step": 2, "train_loss": 1.25},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Killed before the first checkpoint: a relaunch starts at step 0 with no history.
    JsonlMetricsCallback(path).on_train_begin(ARGS, TrainerState(), TrainerControl())
    assert path.read_text() == ""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Resumed from a checkpoint at step 2 saved after the step's log and eval lines.
    state = TrainerState(global_step=2, log_history=rows[:4])
    callback = JsonlMetricsCallback(path)
    callback.on_train_begin(ARGS, state, TrainerControl())
    callback.close()
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows[:4]
