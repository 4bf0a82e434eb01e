"""What the online trainers (GRPO, RLOO) log about their completions: the completion-length
metrics of a sampled batch, TRL's `_logs` (prompts, completions, rewards, advantages and the
reward functions' extra columns of the latest `generation_batch_size` completions) and HF's
`log` followed by TRL's `log_completions` (table, parquet file, wandb).

`CompletionLogsMixin` is one of the pieces `jaxrl.trainers.onpolicy.OnPolicyTrainer` is
composed of. Host-side records and files only: no sampling, no scoring, no traced code; it does
not import `jaxrl.trainers.onpolicy`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxrl.callbacks.completions import write_completions_log
from jaxrl.data import vision_prompts


class CompletionLogsMixin:
    """`OnPolicyTrainer`'s completion metrics and logs (`completion_logs`,
    `completion_extras`, `_completion_logs_at`, set by its `__init__`)."""

    @staticmethod
    def _completion_metrics(lengths_N: np.ndarray, truncated_N: np.ndarray) -> dict[str, float]:
        lengths_N = lengths_N.astype(np.float64)
        term = lengths_N[~truncated_N]
        term = term if term.size else np.zeros(1)
        return {
            "completions/mean_length": float(lengths_N.mean()),
            "completions/min_length": float(lengths_N.min()),
            "completions/max_length": float(lengths_N.max()),
            "completions/clipped_ratio": float(truncated_N.mean()),
            "completions/mean_terminated_length": float(term.mean()),
            "completions/min_terminated_length": float(term.min()),
            "completions/max_terminated_length": float(term.max()),
        }

    # ----------------------------------------------------------------- completion logs
    def _record_completions(self, s: dict, advantages_N: Any) -> None:
        """Add one scored `_sample` call to `completion_logs` (TRL's `_logs`)."""
        logs = self.completion_logs
        # TRL's tables hold the prompts without their images (`strip_images_from_messages`).
        logs["prompt"].extend(vision_prompts.strip_images(p) for p in s["prompts"])
        logs["completion"].extend(s["completions"])
        rewards_NK = np.asarray(s["rewards_NK"], np.float64)
        for k, name in enumerate(self.reward_func_names):
            logs["rewards"][name].extend(rewards_NK[:, k].tolist())
        logs["advantages"].extend(np.asarray(advantages_N, np.float64).tolist())

    def _completion_logs_copy(self) -> dict[str, Any]:
        logs = self.completion_logs
        return {
            "prompt": list(logs["prompt"]),
            "completion": list(logs["completion"]),
            "rewards": {name: list(v) for name, v in logs["rewards"].items()},
            "advantages": list(logs["advantages"]),
            "extra": {name: list(v) for name, v in self.completion_extras.items()},
        }

    def log(self, logs: dict[str, float], step: int | None = None):
        """HF's `log`, then TRL's `log_completions` on process 0: the completions behind this
        log (the latest `generation_batch_size`) printed as a rich table
        (`num_completions_to_print` random ones; all when None), written to
        `output_dir/completions/completions_<step>.parquet` and, when wandb runs, logged as the
        wandb Table `completions` (one row per prompt with `log_unique_prompts`)."""
        super().log(logs, step)
        a = self.args
        if not (a.log_completions and self.is_world_process_zero()):
            return
        step = self.state.global_step if step is None else step
        at = self._completion_logs_at
        # An evaluation logs the completions it just made (TRL's live `_logs`); a training log
        # those of its step.
        is_eval = any(k.startswith("eval_") for k in logs)
        snapshot = None if is_eval else at.pop(step, None)
        for old in [k for k in at if k <= step and not is_eval]:
            del at[old]
        if snapshot is None:
            snapshot = self._completion_logs_copy()
        if snapshot["prompt"]:
            write_completions_log(
                snapshot,
                step,
                out_dir=os.path.join(a.output_dir, "completions"),
                num_to_print=a.num_completions_to_print,
                unique_prompts=a.log_unique_prompts,
                to_wandb="wandb" in a.report_to,
            )
