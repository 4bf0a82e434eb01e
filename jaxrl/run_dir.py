"""Guard a run's `output_dir`: never lose or mix saved results, never let two runs share it.

`check_output_dir` rejects an `output_dir` that is a file (call it before loading anything).
`prepare` runs at the start of training: it refuses to start a fresh run in a directory that
holds an earlier run's checkpoints or `metrics.jsonl` unless the user chose
`--resume_from_checkpoint` (continue it) or `--overwrite_output_dir` (discard it; HF's rule), and
takes a lock file naming the holder's pid and host so a second run on the same directory refuses
instead of interleaving metrics and checkpoints. A lock is stale (and taken over) when its holder
process is gone (same host) or its heartbeat stopped (any host, e.g. a preempted TPU VM). This
file only inspects and guards the directory; it writes nothing but the lock.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LOCK_NAME = "jaxrl.lock"
# The holder refreshes the lock's mtime this often; a lock older than STALE_AFTER_S is stale.
HEARTBEAT_S = 30.0
STALE_AFTER_S = 4 * HEARTBEAT_S
# What a previous run leaves in output_dir (see jaxrl.train's output contract).
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "final")


class OutputDirError(ValueError):
    """`output_dir` cannot be used as given; the message names the fix."""


def check_output_dir(
    output_dir: str | os.PathLike,
    resume_from_checkpoint: Any = None,
    overwrite_output_dir: bool | None = None,
    own_metrics: bool = False,
) -> None:
    """Raise OutputDirError if `output_dir` exists but is not a directory; with
    `overwrite_output_dir` given, also if it holds a previous run that would be neither resumed
    nor overwritten (so a command line fails before any model or data is loaded).
    `own_metrics`: its metrics.jsonl is the caller's own (a trainer's `evaluate()` before its
    `train()`, as HF allows), not a previous run's."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise OutputDirError(
            f"output_dir {str(path)!r} is an existing file, not a directory; pass a directory "
            "path (it is created if missing), e.g. --output_dir outputs/my_run."
        )
    blocker = next((p for p in path.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise OutputDirError(
            f"output_dir {str(path)!r} cannot be created: {str(blocker)!r} is an existing file, "
            "not a directory. Pass a --output_dir outside it, e.g. --output_dir outputs/my_run."
        )
    _check_resume_path(resume_from_checkpoint, path)
    if overwrite_output_dir is None or overwrite_output_dir:
        return
    found = [f for f in previous_run(path) if not (own_metrics and f == "metrics.jsonl")]
    if found and not _wants_resume(resume_from_checkpoint):
        raise OutputDirError(
            f"output_dir {str(path)!r} already holds a previous run ({', '.join(found)}). "
            "Continue it with --resume_from_checkpoint true, start over with "
            "--overwrite_output_dir true (deletes its checkpoints, metrics.jsonl and final/), "
            "or choose a new --output_dir."
        )


def previous_run(output_dir: str | os.PathLike) -> list[str]:
    """Names of the earlier run's results found in `output_dir` (empty if there are none)."""
    path = Path(output_dir)
    found = []
    checkpoints = path / "checkpoints"
    # `checkpoint-N` step directories (and the bare `N` of jaxrl's layout before HF's names).
    if checkpoints.is_dir() and any(
        p.name.startswith("checkpoint-") or p.name[:1].isdigit() for p in checkpoints.iterdir()
    ):
        found.append("checkpoints/")
    metrics = path / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    return found


def _wants_resume(resume: Any) -> bool:
    return resume not in (None, False, "", "false", "False")


# `resume_from_checkpoint` values that mean "this run's newest checkpoint", not a path.
_RESUME_LATEST = ("true", "latest")


def _check_resume_path(resume: Any, output_dir: Path) -> None:
    """A `resume_from_checkpoint` path that does not exist is named as given (before anything
    is loaded), with the two values that do resume."""
    if not _wants_resume(resume) or resume is True or str(resume).lower() in _RESUME_LATEST:
        return
    path = Path(str(resume)).expanduser()
    if path.exists():
        return
    missing = next((p for p in [path, *path.parents] if p.parent.exists()), path)
    raise OutputDirError(
        f"resume_from_checkpoint {str(resume)!r} does not exist ({str(missing.absolute())!r} is "
        "missing). Pass true to continue this run from its newest checkpoint (in "
        f"{str(output_dir / 'checkpoints')!r}), or an existing checkpoint-N directory, a "
        "checkpoints directory or a run's output_dir."
    )


class RunLock:
    """An acquired `output_dir/jaxrl.lock`; `release()` removes it (idempotent)."""

    _held: dict[Path, RunLock] = {}  # locks this process holds, by path

    def __init__(self, path: Path):
        self.path = path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="jaxrl-lock")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # removed under us (e.g. --overwrite_output_dir by hand): keep going
                pass

    def release(self) -> None:
        self._stop.set()
        if RunLock._held.get(self.path) is self:
            del RunLock._held[self.path]
            self.path.unlink(missing_ok=True)


class _NoLock(RunLock):
    """What processes other than 0 hold: process 0 owns the shared directory's lock."""

    def __init__(self) -> None:
        pass

    def release(self) -> None:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _stale_reason(path: Path, holder: dict[str, Any] | None) -> str | None:
    """Why the lock at `path` no longer protects a live run (None: it does)."""
    age = time.time() - path.stat().st_mtime
    if age > STALE_AFTER_S:
        return f"its heartbeat stopped {age:.0f} s ago"
    if holder is None:
        # Unreadable: a holder killed while writing it, or one writing it right now.
        return "it is unreadable" if age > 5.0 else None
    if holder.get("host") == socket.gethostname():
        pid = int(holder.get("pid", -1))
        if pid == os.getpid() and path not in RunLock._held:
            return "this process holds no run there any more"
        if pid != os.getpid() and not _pid_alive(pid):
            return f"process {pid} has exited"
    return None


def acquire_lock(output_dir: str | os.PathLike) -> RunLock:
    """Create `output_dir/jaxrl.lock` or raise OutputDirError naming the live holder."""
    path = Path(output_dir).absolute() / LOCK_NAME
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
            except (OSError, ValueError):
                holder = None
            try:
                reason = _stale_reason(path, holder)
            except FileNotFoundError:  # released between our two looks
                continue
            if reason is None:
                who = (
                    f"pid {holder.get('pid')} on host {holder.get('host')}"
                    if holder
                    else "another process"
                )
                raise OutputDirError(
                    f"output_dir {str(path.parent)!r} is in use by another run ({who}, lock "
                    f"{path}). Wait for it to finish or use another --output_dir; if that run "
                    "is gone, delete the lock file."
                ) from None
            logger.warning("Taking over stale lock %s (%s).", path, reason)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        lock = RunLock(path)
        RunLock._held[path] = lock
        lock._thread.start()
        return lock
    raise OutputDirError(f"Could not take the lock {path}; another run keeps re-creating it.")


def prepare(
    output_dir: str | os.PathLike,
    *,
    resume_from_checkpoint: Any = None,
    overwrite_output_dir: bool = False,
    process_index: int = 0,
    own_metrics: bool = False,
) -> RunLock:
    """Check, lock and (with `overwrite_output_dir`) clear `output_dir` before a run starts.

    Returns the lock; the caller releases it when training ends. Only process 0 locks and deletes
    (every host sees the same shared directory); every process runs the read-only checks so all
    of them fail alike.
    """
    check_output_dir(output_dir, resume_from_checkpoint, overwrite_output_dir, own_metrics)
    path = Path(output_dir)
    path.mkdir(parents=True, exist_ok=True)
    found = previous_run(path)
    resume = _wants_resume(resume_from_checkpoint)
    if process_index != 0:
        return _NoLock()
    lock = acquire_lock(path)
    if found and not resume and overwrite_output_dir:
        logger.warning("overwrite_output_dir: deleting the previous run in %s.", path)
        for name in RUN_OUTPUTS:
            target = path / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    return lock
