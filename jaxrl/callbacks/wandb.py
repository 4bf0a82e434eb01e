"""Weights & Biases logging (report_to includes "wandb"), process 0 only.

The run id is kept in `output_dir/wandb_run_id.txt`, so a run resumed from a checkpoint continues
the same W&B run. Keys are rewritten like HF's WandbCallback: `eval_x` -> `eval/x`, others
`train/x`, against the `train/global_step` axis. Honours WANDB_MODE / WANDB_PROJECT / WANDB_DIR.
"""

import os
import secrets
import string
from pathlib import Path

from jaxrl.callbacks.base import TrainerCallback, TrainerControl, TrainerState

RUN_ID_FILE = "wandb_run_id.txt"
_ID_CHARS = string.ascii_lowercase + string.digits  # the alphabet of W&B run ids


def rewrite_logs(logs: dict) -> dict:
    """HF naming: `eval_loss` -> `eval/loss`, `rewards/chosen` -> `train/rewards/chosen`."""
    return {
        f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}": value
        for key, value in logs.items()
    }


class WandbCallback(TrainerCallback):
    """Logs config and metrics to W&B; resumes the same run id after a restart."""

    def __init__(self, project: str | None = None, init_kwargs: dict | None = None):
        try:
            import wandb
        except ImportError as error:
            raise ImportError(
                "report_to includes 'wandb' but wandb is not installed: `pip install wandb`, or "
                "drop 'wandb' from report_to."
            ) from error
        self._wandb = wandb
        self.project = project or os.environ.get("WANDB_PROJECT", "jaxrl")
        # Extra `wandb.init` arguments (entity, tags, notes, ...), as accelerate's
        # `init_trackers(init_kwargs={"wandb": {...}})` passes them; they override ours.
        self.init_kwargs = dict(init_kwargs or {})
        self.run = None

    def on_train_begin(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        if not state.is_world_process_zero or self.run is not None:
            return
        output_dir = Path(args.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        id_path = output_dir / RUN_ID_FILE
        if id_path.exists():
            run_id = id_path.read_text().strip()
        else:
            run_id = "".join(secrets.choice(_ID_CHARS) for _ in range(8))
            id_path.write_text(run_id + "\n")
        options = dict(
            project=self.project,
            name=args.run_name,
            id=run_id,
            resume="allow",
            config=args.to_dict(),
            dir=os.environ.get("WANDB_DIR", str(output_dir)),
        )
        self.run = self._wandb.init(**{**options, **self.init_kwargs})
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def on_log(self, args, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if self.run is None:
            return
        # `step` (the trainer's log key) is already the train/global_step axis.
        logs = {key: value for key, value in (logs or {}).items() if key != "step"}
        self.run.log({**rewrite_logs(logs), "train/global_step": state.global_step})

    def on_train_end(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        if self.run is not None:
            self.run.finish()
            self.run = None
