"""Train-state checkpoints on orbax: async saves, keep-N, resume into the target sharding.

Each step directory holds the state pytree (`state/`) and a JSON `metadata/` item (trainer state,
data position, config). Orbax writes into a temporary directory and renames it on commit, so an
interrupted save never replaces the latest good checkpoint; half-written temporary directories
are never listed as steps. Also provides the SIGTERM flag a training loop polls so a preempted
job saves before it exits. HF-format model export lives with the models, not here.
"""

import logging
import signal
import threading
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

PyTree = Any
logger = logging.getLogger(__name__)


class CheckpointMismatchError(ValueError):
    """A checkpoint's tree structure or shapes differ from the state we are restoring into."""


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


class Checkpointer:
    """Saves and restores `(state pytree, metadata dict)` pairs under `directory/<step>/`.

    Saves are asynchronous by default: `save` returns once device arrays are copied to host, and
    the write finishes in the background (call `wait_until_finished` before reading them back or
    exiting). `save_total_limit` keeps only the newest N steps, like HF.
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
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_names=("state", "metadata"),
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "metadata": ocp.JsonCheckpointHandler(),
            },
            options=ocp.CheckpointManagerOptions(
                max_to_keep=save_total_limit,
                enable_async_checkpointing=async_save,
                create=True,
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
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state_pytree),
                metadata=ocp.args.JsonSave(metadata),
            ),
            force=True,
        )

    def latest_step(self) -> int | None:
        """Newest committed step, or None if there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """All committed steps, ascending."""
        return sorted(self._manager.all_steps())

    def restore(
        self, step: int | None = None, abstract_state: PyTree = None
    ) -> tuple[PyTree, dict[str, Any]]:
        """Restore `step` (default: latest) into `abstract_state`'s shapes, dtypes and shardings.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with `.sharding` set (e.g. from
        `jax.eval_shape` plus the param shardings); each array is read straight into its target
        sharding; a leaf without a sharding comes back as a host numpy array (e.g. callback
        buffers kept on the CPU). Raises CheckpointMismatchError naming the first key whose shape
        differs.
        """
        if abstract_state is None:
            raise TypeError("restore() needs `abstract_state`, the pytree to restore into.")
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(
                    f"No checkpoint found in {self.directory}; train without "
                    "`resume_from_checkpoint` or point it at a directory with checkpoints."
                )
        elif step not in self.all_steps():
            raise FileNotFoundError(
                f"No checkpoint for step {step} in {self.directory}; available: {self.all_steps()}."
            )
        saved = self._manager.item_metadata(step)["state"]
        _check_compatible(saved.tree, abstract_state, f"{self.directory / str(step)}")
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                metadata=ocp.args.JsonRestore(),
            ),
        )
        return restored["state"], restored["metadata"]

    def reached_preemption(self, step: int) -> bool:
        """Multi-host: True on every host at the same step once any host got SIGTERM (orbax's
        preemption sync point, needs `jax.distributed` initialised), so all save together."""
        return bool(self._manager.reached_preemption(step))

    def wait_until_finished(self) -> None:
        """Block until any in-flight asynchronous save is committed."""
        self._manager.wait_until_finished()

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

    Must be called from the main thread (a Python signal rule). On multi-host runs the loop should
    agree on the flag across hosts before saving, since only some hosts may get the signal.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("install_sigterm_handler() must be called from the main thread.")
    flag = SigtermFlag()
    flag._previous = signal.signal(signal.SIGTERM, flag._handle)
    return flag
