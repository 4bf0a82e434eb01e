"""TensorBoard logging (report_to includes "tensorboard"), process 0 only.

Writes with tensorboardX, which needs neither TensorFlow nor torch (only protobuf), so a JAX
install stays light. Same layout as HF's TensorBoardCallback: event files under
`TENSORBOARD_LOGGING_DIR`, else `output_dir/runs/<time>_<host>`; keys rewritten `eval_x` ->
`eval/x`, others `train/x`, against the global step; the config as text.
"""

import json
import os
import socket
from datetime import datetime

from jaxrl.callbacks.base import TrainerCallback, TrainerControl, TrainerState
from jaxrl.callbacks.wandb import rewrite_logs


class TensorBoardCallback(TrainerCallback):
    """Scalars of every log to TensorBoard event files."""

    def __init__(self, log_dir: str | None = None):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as error:
            raise ImportError(
                "report_to includes 'tensorboard' but tensorboardX is not installed: "
                "`pip install tensorboardX` (or `pip install jaxrl[tensorboard]`), or drop "
                "'tensorboard' from report_to."
            ) from error
        self._writer_cls = SummaryWriter
        self.log_dir = log_dir or os.environ.get("TENSORBOARD_LOGGING_DIR")
        self.writer = None

    def on_train_begin(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        if not state.is_world_process_zero or self.writer is not None:
            return
        if self.log_dir is None:
            stamp = datetime.now().strftime("%b%d_%H-%M-%S")
            self.log_dir = os.path.join(args.output_dir, "runs", f"{stamp}_{socket.gethostname()}")
        self.writer = self._writer_cls(log_dir=os.path.expanduser(self.log_dir))
        self.writer.add_text("args", json.dumps(args.to_dict(), indent=2, default=str))

    def on_log(self, args, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if self.writer is None:
            return
        logs = {key: value for key, value in (logs or {}).items() if key != "step"}
        for key, value in rewrite_logs(logs).items():
            if isinstance(value, int | float):
                self.writer.add_scalar(key, value, state.global_step)
        self.writer.flush()

    def on_train_end(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        if self.writer is not None:
            self.writer.close()
            self.writer = None
