"""Hugging Face Hub uploads (`push_to_hub`, `hub_strategy`) and the small accelerate stand-in that
TRL's scripts print through.

The training loop decides when to upload; this module only knows how: which folder goes to which
repo (`hub_model_id`, `hub_private_repo`, `hub_revision`, `hub_token`) and which saves upload under
each `hub_strategy`. It never touches arrays.
"""

from __future__ import annotations

from typing import Any


class ScriptAccelerator:
    """`trainer.accelerator` for TRL scripts: `print` on the main process only, as accelerate."""

    def __init__(self, is_main_process: bool):
        self.is_main_process = is_main_process

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main_process:
            print(*args, **kwargs)


def pushes_on_save(hub_strategy: str) -> bool:
    """Whether a checkpoint save also uploads (HF: every strategy but "end")."""
    return hub_strategy != "end"


def checkpoint_path_in_repo(hub_strategy: str, step: int) -> str | None:
    """Where a checkpoint goes in the repo under `hub_strategy` (HF layout): "checkpoint" keeps
    only the latest in `last-checkpoint/`, "all_checkpoints" keeps each as `checkpoint-STEP/`,
    and "every_save" uploads the model alone (None: no checkpoint folder)."""
    if hub_strategy == "checkpoint":
        return "last-checkpoint"
    if hub_strategy == "all_checkpoints":
        return f"checkpoint-{step}"
    return None


def push_folder(
    args: Any,
    folder: str,
    commit_message: str | None = "End of training",
    *,
    path_in_repo: str | None = None,
) -> str:
    """Create `args.hub_model_id` if needed and upload `folder` (its model card, README.md, is
    written by the trainer); returns the commit URL."""
    from huggingface_hub import HfApi

    if not args.hub_model_id:
        raise ValueError("push_to_hub needs `hub_model_id` (or `push_to_hub=True`, which sets it).")
    api = HfApi(token=args.hub_token)
    repo = api.create_repo(args.hub_model_id, private=args.hub_private_repo, exist_ok=True)
    info = api.upload_folder(
        repo_id=repo.repo_id,
        folder_path=folder,
        path_in_repo=path_in_repo,
        commit_message=commit_message or "End of training",
        revision=args.hub_revision,
        # Checkpoint internals and logs stay local; the model files and card go up.
        ignore_patterns=["checkpoints/*", "checkpoints/**", "*.jsonl"]
        if path_in_repo is None
        else None,
    )
    return str(getattr(info, "commit_url", info))
