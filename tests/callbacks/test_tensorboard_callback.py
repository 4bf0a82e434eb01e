"""report_to=tensorboard: event files with HF's key names, one scalar per logged value and step."""

import struct

import pytest

from jaxrl import SFTConfig
from jaxrl.callbacks import TrainerControl, TrainerState


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Read TFRecord-framed Event protos (length, crc, payload, crc) without TensorFlow."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_logs_scalars_with_hf_names(tmp_path):
    pytest.importorskip("tensorboardX")
    from jaxrl.callbacks.tensorboard import TensorBoardCallback

    args = SFTConfig(output_dir=str(tmp_path), report_to="tensorboard")
    assert args.report_to == ["tensorboard"]
    callback, state = TensorBoardCallback(), TrainerState()
    callback.on_train_begin(args, state, TrainerControl())
    for step in (1, 2):
        state.global_step = step
        logs = {"loss": 1.0 / step, "eval_loss": 2.0 / step, "step": step, "note": "text"}
        callback.on_log(args, state, TrainerControl(), logs=logs)
    callback.on_train_end(args, state, TrainerControl())
    scalars = _scalars(tmp_path / "runs")
    assert scalars["train/loss"] == [(1, 1.0), (2, 0.5)]
    assert scalars["eval/loss"] == [(1, 2.0), (2, 1.0)]
    assert "train/step" not in scalars and "train/note" not in scalars


def test_only_process_zero_writes(tmp_path):
    pytest.importorskip("tensorboardX")
    from jaxrl.callbacks.tensorboard import TensorBoardCallback

    callback = TensorBoardCallback()
    state = TrainerState(is_world_process_zero=False)
    callback.on_train_begin(SFTConfig(output_dir=str(tmp_path)), state, TrainerControl())
    assert callback.writer is None and not (tmp_path / "runs").exists()
