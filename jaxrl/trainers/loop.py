"""The one training loop, shared by every trainer: iterations, logging, eval, checkpoints,
callbacks, SIGTERM.

`TrainLoop.train()` owns *when* things happen (log, evaluate, save, stop, resume with the same
data order); a subclass owns *what one iteration does* through a few hooks:

- `_ensure_state()`: build the train state and compile the jitted functions (once);
- `_train_iterator()`: an iterator over per-iteration inputs with `.skip(n)` for resume
  (offline: batches of examples; on-policy: batches of prompts);
- `_train_iteration(item) -> metrics`: offline, collate and run the train step; on-policy,
  generate, score and run the jitted update. Metrics may be device arrays: they are read one
  iteration late so the host never waits on the device;
- `steps_per_epoch`, `max_steps`, `train_batch_size`, `evaluate()`, `_has_train_data()`,
  `_has_eval_data()`.

Callback dispatch and management (`add_callback`, reporting callbacks, in-step
`state_update`s) are `jaxrl.trainers.loop_callbacks.LoopCallbacksMixin`'s. This file holds no
model, data or algorithm code.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxrl import loop_options, run_dir, seeding
from jaxrl.callbacks.base import (
    CallbackHandler,
    DefaultFlowCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    is_exportable,
)
from jaxrl.callbacks.collapse import CollapseWarningCallback
from jaxrl.callbacks.jsonl import JsonlMetricsCallback
from jaxrl.checkpoint import (
    CheckpointCorruptError,
    Checkpointer,
    install_sigterm_handler,
    step_dir_name,
    step_of,
)
from jaxrl.trainers.loop_callbacks import LoopCallbacksMixin

logger = logging.getLogger("jaxrl")


class TrainingInterrupted(RuntimeError):
    """Raised after a SIGTERM (e.g. TPU preemption) once the checkpoint is safely written."""


class TrainOutput(NamedTuple):
    """What `train()` returns (HF's layout): the last step, the mean training loss over the whole
    run (a resumed run's included: the running sum is checkpointed), and the run's summary metrics
    (`train_runtime`, `train_loss`, ...)."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


def _abstract(tree: Any) -> Any:
    """Shapes, dtypes and shardings to restore `tree` into (host leaves: no sharding)."""
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
            if not isinstance(x, jax.Array)
            else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        ),
        tree,
    )


class TrainLoop(LoopCallbacksMixin):
    """Loop, logging, checkpoints and callbacks; subclasses supply the iteration (see module doc).

    Subclasses set `self.args` (a config with HF's TrainingArguments loop fields) and call
    `_init_loop(callbacks)` from their constructor.
    """

    # Metrics that are the value at the logging step (not averaged over the window), as HF.
    _last_value_metrics = ("grad_norm", "learning_rate", "num_tokens")
    # The per-step metric `TrainOutput.training_loss` averages (HF: the training loss).
    _loss_metric = "loss"
    # Metrics a trainer allows to be NaN (see `_metric_may_be_nan`); none by default.
    _nan_allowed_metrics: tuple[str, ...] = ()
    processing_class: Any = None

    def _init_loop(self, callbacks: list[TrainerCallback] | None) -> None:
        a = self.args
        self.control = TrainerControl()
        self.state = TrainerState(
            is_world_process_zero=self.is_world_process_zero(),
            is_local_process_zero=self.is_local_process_zero(),
        )
        default_cbs: list[TrainerCallback] = [DefaultFlowCallback(), CollapseWarningCallback()]
        default_cbs.append(JsonlMetricsCallback(os.path.join(a.output_dir, "metrics.jsonl")))
        default_cbs += self._reporting_callbacks()
        self.callback_handler = CallbackHandler(default_cbs + list(callbacks or []))
        self.train_state = None

    def is_world_process_zero(self) -> bool:
        """Whether this is the one process (of all hosts) that writes logs and exports (HF)."""
        return jax.process_index() == 0

    def is_local_process_zero(self) -> bool:
        """Whether this is the first process on its host (HF). JAX runs one process per host, so
        every process is, unless a launcher started several per host and says which this is
        (`LOCAL_RANK`, as torchrun and accelerate set)."""
        return int(os.environ.get("LOCAL_RANK", "0")) == 0

    # ----------------------------------------------------------------- subclass hooks
    def _ensure_state(self) -> None:
        raise NotImplementedError

    def _check_can_train(self) -> None:
        if not self._has_train_data():
            raise ValueError("train() needs a train_dataset.")

    def _has_train_data(self) -> bool:
        raise NotImplementedError

    def _has_eval_data(self) -> bool:
        return False

    def _train_iterator(self):
        raise NotImplementedError

    def _train_iteration(self, item: Any) -> dict:
        raise NotImplementedError

    @property
    def train_batch_size(self) -> int:
        raise NotImplementedError

    @property
    def steps_per_epoch(self) -> int:
        raise NotImplementedError

    @property
    def max_steps(self) -> int:
        if self.args.max_steps and self.args.max_steps > 0:
            return int(self.args.max_steps)
        return math.ceil(self.args.num_train_epochs * self.steps_per_epoch)

    def evaluate(self, *args, **kwargs) -> dict:
        raise NotImplementedError

    # ----------------------------------------------------------------- checkpoints
    def _checkpointer(self) -> Checkpointer:
        if getattr(self, "_ckpt", None) is None:
            self._ckpt = Checkpointer(
                os.path.join(self.args.output_dir, "checkpoints"),
                save_total_limit=self.args.save_total_limit,
            )
        return self._ckpt

    def _save_checkpoint(self):
        self._flush_pending()  # never save a state whose metrics we have not checked for NaN
        ckpt, step = self._checkpointer(), self.state.global_step
        best = self.state.best_global_step
        if best is not None and (best == step or best in ckpt.all_steps()):
            # HF: the best step's checkpoint, spared by save_total_limit's rotation.
            self.state.best_model_checkpoint = str(ckpt.step_dir(best))
            ckpt.protected_step = best
        model_only = getattr(self.args, "save_only_model", False)
        self.state.stateful_callbacks = self._exportable_states()
        meta = {
            "trainer_state": dataclasses.asdict(self.state),
            "log_window": self._log_window,
            "tokens_seen": self._tokens_seen,
            "config": self.args.to_dict(),
            "save_only_model": model_only,
            "host_state": self._host_state(),
            "loop_state": self._loop_state(),
        }
        if model_only:  # HF: the weights alone; no optimizer state, RNG or callback buffers
            tree = {"params": self.train_state.params}
        else:
            tree = {"train_state": self.train_state, "callbacks": self._callback_states()}
        ckpt.save(step, tree, meta)
        self._event("on_save")

    def _loop_state(self) -> dict:
        """The loop's own host state: the running loss sum behind the summary's `train_loss`
        (HF's `tr_loss`, kept here so a resumed run averages the whole run) and the host's global
        generators (Python's and NumPy's, HF's `rng_state.pth`: e.g. a DDPO prompt function or a
        completions sample drawing from them)."""
        return {
            "train_loss_sum": self._loss_sum,
            "train_loss_from": self._loss_from,
            "rng": seeding.host_rng_state(),
        }

    def _load_loop_state(self, state: dict | None) -> None:
        if state is None:  # a checkpoint written before the loop saved its state
            self._loss_sum, self._loss_from = 0.0, int(self.state.global_step)
            return
        self._loss_sum = float(state["train_loss_sum"])
        self._loss_from = int(state["train_loss_from"])
        seeding.set_host_rng_state(state["rng"])

    def _host_state(self) -> dict:
        """JSON-serialisable host-side state the next iterations depend on (e.g. DDPO's
        per-prompt reward buffers), saved in the checkpoint's metadata; {} by default."""
        return {}

    def _load_host_state(self, state: dict) -> None:
        """Restore what `_host_state` saved (called on resume, after the train state)."""

    def _exportable_states(self) -> dict:
        """HF's `stateful_callbacks`: each `ExportableState` callback's `state()` by class name
        (a list when there are several of a class)."""
        states: dict[str, list[dict]] = {}
        for cb in self.callback_handler.callbacks:
            if is_exportable(cb):
                states.setdefault(type(cb).__name__, []).append(cb.state())
        return {name: s[0] if len(s) == 1 else s for name, s in states.items()}

    def _restore_exportable_states(self) -> None:
        """HF's `_load_callback_state` (with `restore_callback_states_from_checkpoint`): each
        saved state replaces the callbacks of its class, in order, by instances rebuilt from it;
        saved states without such a callback are ignored with a warning."""
        if not getattr(self.args, "restore_callback_states_from_checkpoint", False):
            return
        missing = []
        for name, saved in self.state.stateful_callbacks.items():
            same = [cb for cb in self.callback_handler.callbacks if type(cb).__name__ == name]
            if not same:
                missing.append(name)
                continue
            for cb, data in zip(same, saved if isinstance(saved, list) else [saved], strict=False):
                self.callback_handler.remove_callback(cb)
                self.callback_handler.add_callback(type(cb).from_state(data))
        if missing:
            logger.warning(
                "The checkpoint holds states of callbacks this run does not have (%s); ignored.",
                ", ".join(missing),
            )

    def _callback_states(self) -> dict:
        out = {}
        for cb in self.callback_handler.callbacks:
            tree = cb.state_pytree() if hasattr(cb, "state_pytree") else None
            if tree is not None:
                out[type(cb).__name__] = tree
        return out

    def _resolve_resume(self, resume: Any) -> int | None:
        """The step to resume from (HF semantics): True for the newest checkpoint of this run, or
        a path: a `checkpoint-N` directory, a checkpoints directory (its newest step) or a run's
        output_dir. A path outside this run switches the checkpointer to that directory."""
        resume = loop_options.parse_resume_from_checkpoint(resume)
        if resume is None:
            return None
        ckpt = self._checkpointer()
        if resume is True:
            step = ckpt.latest_step()
            if step is None:  # e.g. a babysitter relaunch before the first save
                logger.warning("No checkpoint in %s yet; starting from scratch.", ckpt.directory)
            return step
        path = Path(str(resume)).absolute()
        step = step_of(path.name)
        if step is not None and path.is_dir():
            directory = path.parent
        elif path.is_dir() and path.name.isdigit():
            raise ValueError(
                f"resume_from_checkpoint={resume!r} is a step directory of jaxrl's old layout; "
                "checkpoints are now named like HF's: rename it to "
                f"{step_dir_name(int(path.name))}."
            )
        elif path.is_dir():
            directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        else:
            directory = None
        if directory is not None and directory != ckpt.directory:
            ckpt = self._ckpt = Checkpointer(directory, save_total_limit=self.args.save_total_limit)
        if step is None and directory is not None:
            step = ckpt.latest_step()
        if step is None:
            raise ValueError(
                f"resume_from_checkpoint={resume!r}: no checkpoint there. Pass True (the newest "
                "checkpoint of this run), a checkpoint directory such as "
                f"{ckpt.directory / step_dir_name(500)}, or a directory holding checkpoint-N "
                "directories."
            )
        return step

    def _restore(self, step: int):
        ckpt = self._checkpointer()
        try:
            model_only = ckpt.metadata(step).get("save_only_model", False)
        except CheckpointCorruptError:
            model_only = False  # restore() below names the damage and falls back
        if model_only:
            raise ValueError(
                f"{ckpt.step_dir(step)} was saved with save_only_model=True: it holds the model "
                "weights but no optimizer state, RNG or data position, so training cannot resume "
                "from it (HF semantics). Resume from a checkpoint saved without save_only_model, "
                "or start a new run from these weights."
            )
        for cb in self.callback_handler.callbacks:
            if hasattr(cb, "init_state"):  # stateful callbacks: shapes to restore into
                cb.init_state(self)
        abstract = {
            "train_state": _abstract(self.train_state),
            "callbacks": _abstract(self._callback_states()),
        }
        # Asked for the newest step: a damaged one falls back to an older intact one.
        latest = step == ckpt.latest_step()
        tree, meta = ckpt.restore(step, abstract, fall_back=latest)
        self.train_state = tree["train_state"]
        for cb in self.callback_handler.callbacks:
            name = type(cb).__name__
            if name in tree["callbacks"]:
                cb.load_state_pytree(tree["callbacks"][name])
        saved_cfg, now_cfg = meta.get("config", {}), self.args.to_dict()
        changed = sorted(
            k
            for k in now_cfg
            if k in saved_cfg
            and saved_cfg[k] != now_cfg[k]
            and k
            not in (
                "output_dir",
                "logdir",  # DDPO's output_dir
                "resume_from_checkpoint",
                "resume_from",  # DDPO's resume_from_checkpoint
                "overwrite_output_dir",
                "disable_tqdm",
                "report_to",
            )
        )
        if changed:  # the run continues, but it is no longer the run that was saved
            logger.warning("Resuming with changed config fields: %s", ", ".join(changed))
        # Progress (step, epoch, log history, best metric) comes from the checkpoint; the run's
        # plan (max_steps, logging/eval/save cadence, batch size) from the current config, so a
        # resume with a larger max_steps trains on (HF semantics).
        planned = ("max_steps", "logging_steps", "eval_steps", "save_steps", "train_batch_size")
        # Which process this is belongs to this process, not to the one that wrote the file.
        local = ("is_world_process_zero", "is_local_process_zero")
        ts = meta["trainer_state"]
        for k, v in ts.items():
            if hasattr(self.state, k) and k not in planned + local + ("num_train_epochs",):
                setattr(self.state, k, v)
        self._log_window = meta.get("log_window", [])
        self._tokens_seen = meta.get("tokens_seen", 0)
        self._load_host_state(meta.get("host_state", {}))
        self._load_loop_state(meta.get("loop_state"))
        self._restore_exportable_states()
        logger.info("Resumed from step %d", self.state.global_step)

    def _restore_params(self, step: int) -> Any:
        """The trainable params of checkpoint `step` (a full or a save_only_model one)."""
        ckpt = self._checkpointer()
        if ckpt.metadata(step).get("save_only_model"):
            tree, _ = ckpt.restore(step, {"params": _abstract(self.train_state.params)})
            return tree["params"]
        abstract = {
            "train_state": _abstract(self.train_state),
            "callbacks": _abstract(self._callback_states()),
        }
        tree, _ = ckpt.restore(step, abstract)
        return tree["train_state"].params

    def _load_best_model(self) -> None:
        """HF's end of training with `load_best_model_at_end`: the best checkpoint's params become
        the current ones (so `save_model` exports the best model)."""
        step = self.state.best_global_step
        logger.info(
            "Loading best model from %s (score: %s).",
            self.state.best_model_checkpoint,
            self.state.best_metric,
        )
        self.train_state = self.train_state.replace(params=self._restore_params(step))

    def _track_best(self, metrics: dict[str, float]) -> bool:
        """HF's `_determine_best_metric`: update `best_metric` (and, when saving, the best step)
        from an evaluation; True when it improved."""
        if getattr(self.args, "metric_for_best_model", None) is None:
            return False
        if not loop_options.is_improvement(self.args, metrics, self.state.best_metric):
            return False
        self.state.best_metric = float(metrics[loop_options.best_metric_name(self.args)])
        if self.args.save_strategy != "no":
            self.state.best_global_step = self.state.global_step
        return True

    # ----------------------------------------------------------------- metrics
    def _metric_may_be_nan(self, key: str) -> bool:
        """Whether metric `key` may legitimately be NaN, as TRL leaves some metrics (e.g. the mean
        reward of a function that returned None for a whole batch). Such a value is dropped from
        its logging window's mean, as TRL's `log()` drops it (None when nothing is left). The
        loss and grad_norm never qualify: a NaN there stops the run whatever this says. Default:
        the keys in `_nan_allowed_metrics`; trainers override for keys only known at run time."""
        return key in self._nan_allowed_metrics

    def _non_finite(self, values: dict[str, float]) -> list[str]:
        """The metrics whose non-finite value must stop the run (see `_metric_may_be_nan`)."""
        health = (self._loss_metric, "grad_norm")
        return sorted(
            k
            for k, v in values.items()
            if not math.isfinite(v)
            and not (math.isnan(v) and k not in health and self._metric_may_be_nan(k))
        )

    def _flush_pending(self):
        """Read the metrics of the last dispatched step (one step late) and check them."""
        if self._pending is None:
            return
        step, metrics = self._pending
        self._pending = None
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if "num_input_tokens_seen" in values:  # the step's count -> HF's running total
            self.state.num_input_tokens_seen += int(values.pop("num_input_tokens_seen"))
        bad = self._non_finite(values)
        if bad:
            raise FloatingPointError(
                f"Non-finite {', '.join(bad)} at step {step}; training stopped and nothing was "
                "saved after the last good checkpoint. Lower learning_rate, enable max_grad_norm, "
                "or use bf16 instead of fp16."
            )
        if "num_tokens" in values:  # per-step count -> running total, TRL's `num_tokens`
            self._tokens_seen += int(values["num_tokens"])
            values["num_tokens"] = float(self._tokens_seen)
        self._loss_sum += values.get(self._loss_metric, 0.0)
        if self._logging_strategy() == "no":
            return  # nothing is logged per step (the summary at the end still is)
        self._log_window.append(values)
        if step in self._log_due:
            self._log_due.discard(step)
            self._emit_log(step)

    def _logging_strategy(self) -> str:
        return getattr(self.args, "logging_strategy", "steps")

    def _emit_log(self, step: int):
        window = self._log_window
        if not window:
            return
        logs = {}
        for k in window[-1]:
            # Only metrics allowed to be NaN (`_metric_may_be_nan`) get here with NaN: TRL's
            # `log()` averages the non-NaN values and logs None when there are none.
            if k in self._last_value_metrics:
                values = [window[-1][k]]
            else:
                values = [w[k] for w in window if k in w]
            values = [v for v in values if not math.isnan(v)]
            logs[k] = float(np.mean(values)) if values else None
        self._log_window = []
        if self._counts_input_tokens():
            # HF's training logs then carry the input-token throughput of this train() call.
            runtime = time.time() - self._train_start
            tokens = self.state.num_input_tokens_seen - self._input_tokens_at_start
            logs["train_runtime"] = round(runtime, 4)
            logs["train_tokens_per_second"] = round(tokens / max(runtime, 1e-9), 3)
        self.log(logs, step=step)

    def _counts_input_tokens(self) -> bool:
        """HF's `include_num_input_tokens_seen` is on ("all" or "non_padding")."""
        return getattr(self.args, "include_num_input_tokens_seen", "no") != "no"

    def log(self, logs: dict[str, float], step: int | None = None):
        """Add `epoch`, record in `log_history` and dispatch `on_log` (HF semantics)."""
        step = self.state.global_step if step is None else step
        logs = dict(logs)
        logs["epoch"] = (
            round(step / max(1, self.steps_per_epoch), 4) if self._has_train_data() else 0
        )
        if self._counts_input_tokens():  # HF adds it to every log: training, eval, summary
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        logs["step"] = step
        self.state.log_history.append(logs)
        self._event("on_log", logs=logs)

    # ----------------------------------------------------------------- train
    def train(self, resume_from_checkpoint: Any = None) -> TrainOutput:
        self._check_can_train()
        # The argument, else the config's field (an explicit False: no resume, as HF).
        resume = loop_options.parse_resume_from_checkpoint(
            self.args.resume_from_checkpoint
            if resume_from_checkpoint is None
            else resume_from_checkpoint
        )
        # Refuse a used output_dir or a concurrent run; the lock is held while training.
        lock = run_dir.prepare(
            self.args.output_dir,
            resume_from_checkpoint=resume,
            overwrite_output_dir=getattr(self.args, "overwrite_output_dir", False),
            process_index=jax.process_index(),
            own_metrics=not getattr(self, "_metrics_file_preexisted", True),
        )
        try:
            return self._train(resume)
        finally:
            lock.release()

    def _train(self, resume: bool | str | None) -> TrainOutput:
        a = self.args
        os.makedirs(a.output_dir, exist_ok=True)
        self._ensure_state()
        self._pending = None
        self._log_due: set[int] = set()
        self._log_window: list[dict] = []
        self._tokens_seen = 0
        if self.state.global_step == 0 or not hasattr(self, "_loss_sum"):
            # A fresh run (a second train() call on this trainer continues the run's sum).
            self._loss_sum, self._loss_from = 0.0, int(self.state.global_step)
        max_steps = self.max_steps
        spe = self.steps_per_epoch
        s = self.state
        s.compute_steps(a, max_steps)
        if a.eval_steps is None:
            s.eval_steps = s.logging_steps  # HF: eval_steps defaults to logging_steps
        s.num_train_epochs = math.ceil(max_steps / spe)
        s.train_batch_size = self.train_batch_size
        step0 = self._resolve_resume(resume)
        if step0 is not None:
            self._restore(step0)
        start = int(self.state.global_step)
        if self.state.best_model_checkpoint is not None:  # resumed: keep sparing the best step
            self._checkpointer().protected_step = self.state.best_global_step
        it = self._train_iterator()
        it.skip(start)
        # Installed until the last save is committed: a SIGTERM while it is written lets it
        # finish (no half-written directory) and stops the run as one between steps does.
        sigterm = install_sigterm_handler()
        try:
            self._event("on_train_begin")
            if a.eval_on_start and start == 0 and self._has_eval_data():
                self.evaluate()
            t0, tokens0 = time.time(), self._tokens_seen
            self._train_start, self._input_tokens_at_start = t0, self.state.num_input_tokens_seen
            for step in range(start, max_steps):
                if step % spe == 0:
                    self._event("on_epoch_begin")
                self._event("on_step_begin")
                metrics = self._train_iteration(next(it))
                self._flush_pending()  # metrics of the previous step, read while this one runs
                self.state.global_step = step + 1
                self.state.epoch = (step + 1) / spe
                self._pending = (step + 1, metrics)
                self._event("on_step_end")
                if (step + 1) % spe == 0:
                    self._event("on_epoch_end")
                self._maybe_log_save_evaluate()
                if self._preempted(sigterm):
                    self._stop_preempted()
                if self.control.should_training_stop:
                    break
            self._flush_pending()
            # A partial logging window at the end is logged under "steps" (HF drops it).
            if self._log_window and self._logging_strategy() == "steps":
                self._emit_log(self.state.global_step)
            if getattr(self, "_ckpt", None) is not None:
                self._ckpt.wait_until_finished()
            if jax.process_count() == 1 and sigterm.received:  # during the last save
                self._stop_preempted()
        finally:
            try:
                if getattr(self, "_ckpt", None) is not None:
                    self._ckpt.wait_until_finished()
            finally:
                sigterm.uninstall()
        runtime = max(time.time() - t0, 1e-9)
        steps_run = self.state.global_step - start
        # HF: the summed per-step losses over the run's steps (a resumed run's sum is restored;
        # only a checkpoint older than that sum starts counting at its step).
        train_loss = self._loss_sum / max(self.state.global_step - self._loss_from, 0.001)
        metrics = {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(steps_run * self.train_batch_size / runtime, 3),
            "train_steps_per_second": round(steps_run / runtime, 3),
            "train_tokens_per_second": round((self._tokens_seen - tokens0) / runtime, 3),
            "train_loss": train_loss,
        }
        self.log(metrics)
        # HF's log() adds these in place, so they are in train()'s metrics too.
        for key in ("epoch", "num_input_tokens_seen"):
            if key in self.state.log_history[-1]:
                metrics[key] = self.state.log_history[-1][key]
        if getattr(self.args, "load_best_model_at_end", False) and (
            self.state.best_model_checkpoint is not None
        ):
            self._load_best_model()
        if self.state.best_model_checkpoint is not None and self.args.save_total_limit == 1:
            # HF: with one checkpoint allowed, only the best one stays once training is done.
            self._checkpointer().keep_only(self.state.best_global_step)
        self._event("on_train_end")
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def _stop_preempted(self) -> None:
        """After a SIGTERM: the current step saved (unless its checkpoint is already committed),
        every save awaited, then `TrainingInterrupted` (the CLI exits 143)."""
        ckpt = self._checkpointer()
        ckpt.wait_until_finished()
        if self.state.global_step not in ckpt.all_steps():
            self._save_checkpoint()
            ckpt.wait_until_finished()
        raise TrainingInterrupted(
            f"SIGTERM received: saved step {self.state.global_step} to "
            f"{ckpt.step_dir(self.state.global_step)}; rerun with --resume_from_checkpoint true."
        )

    def _preempted(self, sigterm) -> bool:
        """SIGTERM seen: on one host directly; across hosts at a step all of them agree on."""
        if jax.process_count() == 1:
            return sigterm.received
        return self._checkpointer().reached_preemption(self.state.global_step)

    def _maybe_log_save_evaluate(self):
        c = self.control
        if c.should_log:
            c.should_log = False
            self._log_due.add(self.state.global_step)
        if c.should_evaluate:
            c.should_evaluate = False
            self._flush_pending()
            improved = self._track_best(self.evaluate())
            if self.args.save_strategy == "best":  # HF: save exactly when the metric improved
                c.should_save = improved
        if c.should_save:
            c.should_save = False
            self._save_checkpoint()
