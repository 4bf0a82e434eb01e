"""Train-state checkpoints on orbax: async saves, keep-N, resume into the target sharding.

Each step directory, `checkpoint-<step>` as in HF, holds the state pytree (`state/`) and a JSON
`metadata/` item (trainer state, data position, config). Orbax writes into a temporary directory and renames it on commit, so an
interrupted save never replaces the latest good checkpoint; half-written temporary directories
are never listed as steps. Also provides the SIGTERM flag a training loop polls so a preempted
job saves before it exits. HF-format model export lives with the models, not here.

A damaged newest checkpoint (a missing or truncated metadata or array file, e.g. a disk that
filled up, or a copy that was cut short) is named in a warning, moved aside to
`damaged-<step>-<time>` (nothing is deleted) and resume falls back to the newest intact step.
"""

import dataclasses
import errno
import logging
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

PyTree = Any
logger = logging.getLogger(__name__)


class CheckpointMismatchError(ValueError):
    """A checkpoint's tree structure or shapes differ from the state we are restoring into."""


class CheckpointCorruptError(ValueError):
    """A checkpoint's files are missing or unreadable (and no intact older step was usable)."""


class CheckpointDiskFullError(OSError):
    """The disk filled up while a checkpoint was written; the message names the directory, the
    space one checkpoint needs and the fix. Committed checkpoints are intact (orbax writes into
    a temporary directory, removed at the next start)."""


def _is_disk_full(err: BaseException | None) -> bool:
    """ENOSPC anywhere in `err`'s cause chain (tensorstore raises bare exceptions carrying the
    OS message, so the text counts too)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


class _DropDiskFullTracebacks(logging.Filter):
    """Orbax logs each failed background write of a save with its traceback (dozens of lines
    per disk-full save) before the error reaches us; `Checkpointer` raises one paragraph
    instead, so those records are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        return not (_is_disk_full(err) or "No space left on device" in record.getMessage())


_DISK_FULL_FILTER = _DropDiskFullTracebacks()


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _path_names(path: tuple) -> tuple[str, ...]:
    # Orbax stores attribute containers (flax structs, NamedTuples) as dicts, so compare key paths
    # by name only, not by container type.
    names = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)))
                break
        else:
            names.append(str(key))
    return tuple(names)


def _shapes_by_path(tree: PyTree) -> dict[tuple[str, ...], tuple[int, ...]]:
    # nnx Variables have a `.shape` but are containers (their array sits under `value`).
    def is_leaf(x):
        return hasattr(x, "shape") and not isinstance(x, nnx.Variable)

    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {_path_names(path): tuple(leaf.shape) for path, leaf in leaves}


def _check_compatible(saved: PyTree, target: PyTree, where: str) -> None:
    saved_shapes, target_shapes = _shapes_by_path(saved), _shapes_by_path(target)
    hint = (
        " The checkpoint was written by a different model or optimizer config; restore with the "
        "same config, or point `resume_from_checkpoint` / `output_dir` elsewhere."
    )
    for path, shape in target_shapes.items():
        name = "/".join(path)
        if path not in saved_shapes:
            raise CheckpointMismatchError(
                f"{where}: key {name!r} (shape {shape}) is missing from the checkpoint.{hint}"
            )
        if saved_shapes[path] != shape:
            raise CheckpointMismatchError(
                f"{where}: key {name!r} has shape {saved_shapes[path]} in the checkpoint but "
                f"{shape} in the target state.{hint}"
            )
    extra = [path for path in saved_shapes if path not in target_shapes]
    if extra:
        raise CheckpointMismatchError(
            f"{where}: key {'/'.join(extra[0])!r} (shape {saved_shapes[extra[0]]}) is in the "
            f"checkpoint but not in the target state.{hint}"
        )


# Orbax splits each replicated array into one slice per replica so the replicas write in
# parallel. Each slice is an eager device op, compiled once per shape and sharding (~30 ms apiece
# on CPU): for the biases, norms and small kernels of a state that costs seconds on the first save
# of every process and gains no I/O. Arrays whose per-replica slice would be smaller than this
# are written whole by their first replica; larger ones are still split.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def _state_handler() -> ocp.StandardCheckpointHandler:
    """Orbax's standard pytree handler with `MIN_REPLICA_SLICE_BYTES` for `jax.Array` leaves (the
    same on-disk format: only the type registry of the pytree handler it wraps is our own)."""
    from orbax.checkpoint._src.metadata import array_metadata_store

    handlers = [
        (ty, ocp.type_handlers.get_type_handler(ty))
        for ty in ocp.type_handlers.supported_types()
        if ty is not jax.Array
    ]
    # The default handler has this metadata store too: it records typed PRNG keys.
    array = ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(),
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
    )
    registry = ocp.type_handlers.create_type_handler_registry(*handlers, (jax.Array, array))
    handler = ocp.StandardCheckpointHandler()
    # It delegates every save, restore and metadata call to `_impl`, a `PyTreeCheckpointHandler`
    # built with the global registry and no way to pass another (orbax 0.12); the arguments
    # registry maps `StandardSave` to this exact class, so a subclass would not be used.
    handler._impl = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
    return handler


STEP_PREFIX = "checkpoint-"  # HF's step directory names: checkpoint-500
_STEP_NAME = re.compile(r"checkpoint-(0|[1-9][0-9]*)")


def step_dir_name(step: int) -> str:
    """The directory name of checkpoint `step` (`checkpoint-<step>`, as HF)."""
    return f"{STEP_PREFIX}{step}"


def step_of(name: str) -> int | None:
    """The step a directory name `checkpoint-<step>` holds, or None for any other name."""
    match = _STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


@dataclasses.dataclass(frozen=True)
class _HFStepNames(ocp.step.NameFormat):
    """Orbax step naming for `checkpoint-<step>`: orbax's own `step_prefix` always inserts an
    underscore (`checkpoint_500`), which HF tools and users do not expect."""

    def build_name(self, step: int) -> str:
        return step_dir_name(step)

    def _metadata(self, path: epath.Path) -> ocp.step.Metadata | None:
        step = step_of(path.name)
        # Uncommitted (temporary) directories of a save in flight are never steps.
        if step is None or not path.is_dir() or not ocp.step.is_path_finalized(path):
            return None
        return ocp.step.Metadata(step=step, path=path)

    def find_all(self, base_path: epath.PathLike):
        base = epath.Path(base_path)
        if not base.is_dir():
            return iter([])
        return ocp.step.build_step_metadatas(list(base.iterdir()), self._metadata)

    def find_step(self, base_path: epath.PathLike, step: int) -> ocp.step.Metadata:
        found = self._metadata(epath.Path(base_path) / self.build_name(step))
        if found is None:
            raise ValueError(f"No committed checkpoint {self.build_name(step)} in {base_path}.")
        return found


class Checkpointer:
    """Saves and restores `(state pytree, metadata dict)` pairs under `directory/checkpoint-N/`.

    Saves are asynchronous by default: `save` returns once device arrays are copied to host, and
    the write finishes in the background (call `wait_until_finished` before reading them back or
    exiting). `save_total_limit` keeps only the newest N steps, with HF's rotation rule: the
    newest step and `protected_step` (the best model's checkpoint) are never deleted.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        save_total_limit: int | None = None,
        async_save: bool = True,
    ):
        if save_total_limit is not None and save_total_limit < 1:
            raise ValueError(f"save_total_limit must be None or >= 1; got {save_total_limit}.")
        self.directory = Path(directory).absolute()
        self.save_total_limit = save_total_limit
        logging.getLogger("absl").addFilter(_DISK_FULL_FILTER)  # idempotent
        self.protected_step: int | None = None
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_names=("state", "metadata"),
            item_handlers={
                "state": _state_handler(),
                "metadata": ocp.JsonCheckpointHandler(),
            },
            options=ocp.CheckpointManagerOptions(
                # Rotation is ours (`_rotate`): orbax's max_to_keep cannot spare the best step.
                max_to_keep=None,
                step_name_format=_HFStepNames(),
                enable_async_checkpointing=async_save,
                create=True,
                # Temporary directories of saves killed mid-write are removed at start-up, so a
                # re-save of that step later cannot collide with them.
                cleanup_tmp_directories=True,
            ),
        )

    def save(self, step: int, state_pytree: PyTree, metadata: dict[str, Any]) -> None:
        """Start saving `state_pytree` and the JSON-serialisable `metadata` as checkpoint `step`.

        A step that is already committed is kept as is: it holds this same state (e.g. the final
        save of a run resumed at its last step).
        """
        if step in self._manager.all_steps():
            logger.info(
                "Checkpoint %d already exists in %s; not saving it again.", step, self.directory
            )
            return
        # Rotate once the previous save is committed, keeping `save_total_limit` steps while
        # this one is written: a crash mid-save still leaves that many intact steps.
        self.wait_until_finished()
        self._saving = (step, sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state_pytree)))
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state_pytree),
                    metadata=ocp.args.JsonSave(metadata),
                ),
                force=True,
            )
        except Exception as err:
            self._raise_if_disk_full(err)
            raise

    def _raise_if_disk_full(self, err: Exception) -> None:
        """Turn a save that ran out of disk into one CheckpointDiskFullError paragraph."""
        if not _is_disk_full(err):
            return
        step, needed = getattr(self, "_saving", (None, 0))
        # Orbax leaves the failed save's metadata writer running; joined here, it ends (its error
        # filtered) before the process exits instead of failing noisily during shutdown.
        for thread in threading.enumerate():
            if thread.name == "write_metadata_after_commits":
                thread.join(timeout=30)
        try:
            free = _human_bytes(shutil.disk_usage(self.directory).free)
        except OSError:
            free = "an unknown amount"
        newest = self._manager.latest_step()
        kept = (
            f"Earlier checkpoints are intact (newest: {self.step_dir(newest)})"
            if newest is not None
            else "No earlier checkpoint was saved"
        )
        full = CheckpointDiskFullError(
            f"The disk is full: saving checkpoint {step} to {self.directory} failed (No space "
            f"left on device). One checkpoint of this run needs about {_human_bytes(needed)} "
            f"(weights, optimizer state and metadata); {free} is free there now. {kept}; the "
            "partial one is removed at the next start. Free at least that much space (or point "
            "--output_dir at a larger disk, or save fewer with --save_total_limit), then "
            "continue with --resume_from_checkpoint true."
        )
        full.errno = errno.ENOSPC
        raise full from err

    def step_dir(self, step: int) -> Path:
        """The directory of checkpoint `step`."""
        return self.directory / step_dir_name(step)

    def _rotate(self) -> None:
        """HF's `rotate_checkpoints`: keep `save_total_limit` committed steps (more when the
        newest and the protected step both need keeping), deleting the oldest first."""
        if self.save_total_limit is None:
            return
        steps = self.all_steps()
        if not steps:
            return
        # The newest step (for resuming) and the best model's step are never deleted.
        protected = {steps[-1]} | ({self.protected_step} & set(steps))
        keep_n = max(self.save_total_limit, len(protected))
        remaining = len(steps)
        for step in steps:
            if remaining <= keep_n:
                break
            if step not in protected:
                self._manager.delete(step)
                remaining -= 1

    def keep_only(self, step: int) -> None:
        """Delete every committed step but `step` (HF's end of training with
        `save_total_limit=1` and a best model: only the best checkpoint stays)."""
        self.wait_until_finished()
        for other in self.all_steps():
            if other != step:
                self._manager.delete(other)

    def metadata(self, step: int) -> dict[str, Any]:
        """The JSON metadata item of checkpoint `step` alone (no arrays are read)."""
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore())
            )
        except Exception as err:  # a damaged step: restore() names it and falls back
            raise CheckpointCorruptError(
                f"Checkpoint {self.step_dir(step)} is damaged: its metadata is unreadable "
                f"({type(err).__name__})."
            ) from err
        if restored["metadata"] is None:
            raise CheckpointCorruptError(f"Checkpoint {self.step_dir(step)} holds no metadata.")
        return restored["metadata"]

    def latest_step(self) -> int | None:
        """Newest committed step, or None if there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """All committed steps, ascending."""
        return sorted(self._manager.all_steps())

    def restore(
        self, step: int | None = None, abstract_state: PyTree = None, *, fall_back: bool = False
    ) -> tuple[PyTree, dict[str, Any]]:
        """Restore `step` (default: latest) into `abstract_state`'s shapes, dtypes and shardings.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with `.sharding` set (e.g. from
        `jax.eval_shape` plus the param shardings); each array is read straight into its target
        sharding; a leaf without a sharding comes back as a host numpy array (e.g. callback
        buffers kept on the CPU). Raises CheckpointMismatchError naming the first key whose shape
        differs, CheckpointCorruptError when the step's files are damaged.

        With `step=None` or `fall_back=True`, a damaged step is named in a warning, moved aside
        and the next older step is tried; the metadata returned is that of the step restored.
        """
        if abstract_state is None:
            raise TypeError("restore() needs `abstract_state`, the pytree to restore into.")
        if step is None:
            step, fall_back = self.latest_step(), True
            if step is None:
                raise FileNotFoundError(
                    f"No checkpoint found in {self.directory}; train without "
                    "`resume_from_checkpoint` or point it at a directory with checkpoints."
                )
        elif step not in self.all_steps():
            raise FileNotFoundError(
                f"No checkpoint for step {step} in {self.directory}; available: {self.all_steps()}."
            )
        candidates = [s for s in reversed(self.all_steps()) if s <= step] if fall_back else [step]
        damaged: list[str] = []
        for candidate in candidates:
            try:
                return self._restore_step(candidate, abstract_state)
            except CheckpointCorruptError as err:
                if not fall_back:
                    raise
                damaged.append(str(err))
                logger.warning("%s Falling back to an older checkpoint.", err)
                self._move_aside(candidate)
        raise CheckpointCorruptError(
            f"No intact checkpoint in {self.directory}: every step is damaged "
            f"({' '.join(damaged)}). Start a new run (a new output_dir, or "
            "--overwrite_output_dir true) or restore the checkpoints from a backup."
        )

    def _restore_step(self, step: int, abstract_state: PyTree) -> tuple[PyTree, dict[str, Any]]:
        where = self.step_dir(step)
        try:
            saved = self._manager.item_metadata(step)["state"]
            if saved is None:
                raise FileNotFoundError(f"{where / 'state' / '_METADATA'} is missing")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointCorruptError(
                f"Checkpoint {where} is damaged: its state metadata is unreadable ({err})."
            ) from err
        _check_compatible(saved.tree, abstract_state, str(where))
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    metadata=ocp.args.JsonRestore(),
                ),
            )
        except CheckpointMismatchError:
            raise
        except Exception as err:  # tensorstore raises a bare Exception for truncated arrays
            first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CheckpointCorruptError(
                f"Checkpoint {where} is damaged: a file is missing, truncated or corrupt "
                f"({type(err).__name__}: {first_line})."
            ) from err
        if restored["metadata"] is None:
            raise CheckpointCorruptError(
                f"Checkpoint {where} is damaged: {where / 'metadata'} holds no metadata."
            )
        return restored["state"], restored["metadata"]

    def _move_aside(self, step: int) -> None:
        # Renamed, not deleted: the files may still be worth inspecting, and a resumed run must
        # be able to save this step number again. Only process 0 touches shared files.
        if jax.process_index() == 0:
            src = self.step_dir(step)
            dst = self.directory / f"damaged-{step}-{int(time.time())}"
            src.rename(dst)
            logger.warning("Moved damaged checkpoint %s to %s.", src, dst)
        self._manager.reload()

    def reached_preemption(self, step: int) -> bool:
        """Multi-host: True on every host at the same step once any host got SIGTERM (orbax's
        preemption sync point, needs `jax.distributed` initialised), so all save together."""
        return bool(self._manager.reached_preemption(step))

    def wait_until_finished(self) -> None:
        """Block until any in-flight asynchronous save is committed, then rotate old steps."""
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            self._raise_if_disk_full(err)
            raise
        self._rotate()

    def close(self) -> None:
        """Finish pending saves and release the manager's resources."""
        self._manager.close()


class SigtermFlag:
    """Set when SIGTERM arrives; the loop polls `.received`, saves, and exits cleanly."""

    def __init__(self) -> None:
        self.received = False
        self._previous = None

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True

    def uninstall(self) -> None:
        """Restore the SIGTERM handler that was active before `install_sigterm_handler`."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def install_sigterm_handler() -> SigtermFlag:
    """Install a SIGTERM handler that only sets a flag (preemption -> save -> exit).

    Must be called from the main thread (a Python signal rule). With several processes the
    handler is left to JAX: `jax.distributed.initialize` installs a preemption notifier on SIGTERM
    that tells every host, and `Checkpointer.reached_preemption` turns True on all of them at the
    same step; a Python handler here would replace that notifier and only one host would stop.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("install_sigterm_handler() must be called from the main thread.")
    flag = SigtermFlag()
    if jax.process_count() == 1:
        flag._previous = signal.signal(signal.SIGTERM, flag._handle)
    return flag
