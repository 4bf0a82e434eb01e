"""Trainer shell shared by every algorithm: model and data setup, the loop, eval, checkpoints.

Algorithms subclass `Trainer` and provide four things: how to tokenize a dataset
(`_prepare_dataset`), how to collate examples into fixed-shape numpy arrays (`_collate`), the pure
loss function the generic step differentiates (`_loss_fn`), and optional extra state
(`_init_extras`, `_ref_params`). Everything else (mesh, sharded params, jitted step with
donation, one-step-late metrics, NaN stop, callbacks, orbax checkpoints with data position,
SIGTERM save, HF export) lives here once. This file must not contain algorithm math.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from transformers import PretrainedConfig

from jaxrl import parallel
from jaxrl.callbacks.base import (
    CallbackHandler,
    DefaultFlowCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from jaxrl.callbacks.jsonl import JsonlMetricsCallback
from jaxrl.checkpoint import Checkpointer, install_sigterm_handler
from jaxrl.config import TrainingConfig
from jaxrl.core import optim
from jaxrl.core.state import TrainState
from jaxrl.core.step import make_eval_step, make_train_step
from jaxrl.data.batching import BatchIterator

logger = logging.getLogger("jaxrl")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class EvalPrediction(NamedTuple):
    """What `compute_metrics` receives, as in HF. `predictions` are argmax token ids [N, T]
    (never full logits: a [N, T, V] array on the host is the memory blow-up we avoid), and
    `label_ids` are the target ids with -100 where no loss is taken."""

    predictions: np.ndarray
    label_ids: np.ndarray


class TrainingInterrupted(RuntimeError):
    """Raised after a SIGTERM (e.g. TPU preemption) once the checkpoint is safely written."""


def _is_finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(v) for v in metrics.values())


class Trainer:
    """Generic jaxrl trainer; use an algorithm subclass (`SFTTrainer`, `DPOTrainer`, ...)."""

    config_class: type[TrainingConfig] = TrainingConfig
    model_task = "causal_lm"
    # Metrics that are the value at the logging step (not averaged over the window), as HF.
    _last_value_metrics = ("grad_norm", "learning_rate", "num_tokens")

    def __init__(
        self,
        model: Any,
        args: TrainingConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[optax.GradientTransformation | None, Callable | None] = (None, None),
        compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None = None,
        peft_config: Any = None,
        quantization_config: Any = None,
    ):
        self.args = args if args is not None else self.config_class(output_dir="trainer_output")
        if not isinstance(self.args, TrainingConfig):
            raise TypeError(f"args must be a {self.config_class.__name__}, got {type(args)}.")
        self._check_script_inputs(peft_config, quantization_config, eval_dataset)
        a = self.args
        if a.fp16 and jax.default_backend() == "cpu":
            # As HF's Trainer: fp16 mixed precision is a GPU feature (XLA:CPU has no f16 dot
            # with f32 accumulation).
            raise ValueError("fp16=True needs a GPU; on CPU use bf16=True or full precision.")
        self.mesh = self._make_mesh()
        self.rules = parallel.merge_rules(a.logical_axis_rules)
        self.compute_dtype = self._compute_dtype()
        self.model_path = model if isinstance(model, str) else None
        self.model = self._load_model(model, task=self.model_task)
        self.processing_class = self._load_tokenizer(processing_class)
        self.compute_metrics = compute_metrics
        self.user_tx, self.user_schedule = optimizers
        self.train_dataset = (
            self._prepare_dataset(train_dataset, "train") if train_dataset is not None else None
        )
        self.eval_dataset = (
            self._prepare_dataset(eval_dataset, "eval") if eval_dataset is not None else None
        )
        self.seq_len = self._choose_seq_len()
        self.dp = parallel.data_parallel_size(self.mesh)
        self.is_world_process_zero = jax.process_index() == 0
        self.control = TrainerControl()
        self.state = TrainerState(is_world_process_zero=self.is_world_process_zero)
        default_cbs: list[TrainerCallback] = [DefaultFlowCallback()]
        default_cbs.append(JsonlMetricsCallback(os.path.join(a.output_dir, "metrics.jsonl")))
        default_cbs += self._reporting_callbacks()
        self.callback_handler = CallbackHandler(default_cbs + list(callbacks or []))
        self.train_state: TrainState | None = None
        self._jit_train_step = None
        self._jit_eval_step = None
        self._event("on_init_end")

    def _event(self, name: str, **kwargs):
        """Dispatch a lifecycle event; callbacks get `trainer=self` besides HF's kwargs."""
        self.control = getattr(self.callback_handler, name)(
            self.args,
            self.state,
            self.control,
            trainer=self,
            processing_class=self.processing_class,
            **kwargs,
        )

    # ----------------------------------------------------------------- setup helpers
    def _make_mesh(self):
        a = self.args
        sizes = (a.mesh_data, a.mesh_fsdp, a.mesh_tensor)
        devices = jax.devices("cpu") if a.use_cpu else jax.devices()  # HF `use_cpu`
        if -1 not in sizes and math.prod(sizes) < len(devices):
            # Like CUDA_VISIBLE_DEVICES: an explicit smaller mesh uses the first devices.
            logger.warning("Mesh %s uses %d of %d devices.", sizes, math.prod(sizes), len(devices))
            devices = devices[: math.prod(sizes)]
        return parallel.make_mesh(*sizes, devices=devices)

    def _compute_dtype(self):
        a = self.args
        if a.fp16:
            return jnp.float16
        if a.bf16:
            return jnp.bfloat16
        return jnp.float32

    def _param_dtype(self):
        return _DTYPES[self.args.param_dtype]

    def _load_model(self, model: Any, task: str):
        from jaxrl import models

        a = self.args
        kw = dict(
            dtype=self.compute_dtype,
            param_dtype=self._param_dtype(),
            mesh=self.mesh,
            rules=self.rules,
            scan_layers=a.scan_layers,
            remat_policy=a.remat_policy or ("full" if a.gradient_checkpointing else "none"),
        )
        if isinstance(model, str):
            return models.from_pretrained(model, task=task, **kw)
        if isinstance(model, PretrainedConfig):  # random init from a config (from scratch)
            return models.from_config(model, seed=a.seed, task=task, **kw)
        if isinstance(model, nnx.Module):
            # Place a user-built model's params on this trainer's mesh by the sharding rules.
            params = nnx.state(model)
            shardings = parallel.param_shardings(params, self.mesh, self.rules)
            nnx.update(model, jax.device_put(params, shardings))
            return model
        raise TypeError(
            "model must be a path/hub id, a transformers config (random init) or a jaxrl nnx "
            f"model, got {type(model).__name__}."
        )

    def _load_tokenizer(self, processing_class):
        if processing_class is None:
            if self.model_path is None:
                raise ValueError(
                    "processing_class is required when model is an object; pass the tokenizer."
                )
            from transformers import AutoTokenizer

            processing_class = AutoTokenizer.from_pretrained(self.model_path)
        pad = getattr(self.args, "pad_token", None)
        if pad is not None:  # TRL: the config's pad_token overrides the tokenizer's
            if pad not in processing_class.get_vocab():
                raise ValueError(
                    f"pad_token={pad!r} is not in the tokenizer vocabulary; use an existing token."
                )
            processing_class.pad_token = pad
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        return processing_class

    def _reporting_callbacks(self) -> list[TrainerCallback]:
        cbs: list[TrainerCallback] = []
        report = self.args.report_to
        report = [report] if isinstance(report, str) else list(report or [])
        if "wandb" in report or "all" in report:
            from jaxrl.callbacks.wandb import WandbCallback

            cbs.append(WandbCallback())
        if "tensorboard" in report:
            from jaxrl.callbacks.tensorboard import TensorBoardCallback

            cbs.append(TensorBoardCallback())
        if not self.args.disable_tqdm:
            from jaxrl.callbacks.progress import RichProgressCallback

            cbs.append(RichProgressCallback())
        return cbs

    def _choose_seq_len(self) -> int:
        from jaxrl.data.collate import choose_seq_len

        lengths: list[int] = []
        for ds in (self.train_dataset, self.eval_dataset):
            if ds is not None:
                lengths.extend(self._example_lengths(ds))
        if not lengths:
            return self.args.max_length or 1024
        return choose_seq_len(
            lengths, self._max_length(), multiple_of=self.args.pad_to_multiple_of or 1
        )

    def _max_length(self) -> int:
        return getattr(self.args, "max_length", None) or 1024

    @staticmethod
    def _load_data(dataset: Any, split: str) -> Any:
        """A dataset object passes through; a path or hub id is loaded (a single file is the
        whole split)."""
        if not isinstance(dataset, str):
            return dataset
        from jaxrl.data.loading import load_dataset_any

        return load_dataset_any(dataset, split="train" if os.path.isfile(dataset) else split)

    # ----------------------------------------------------------------- subclass hooks
    def _prepare_dataset(self, dataset: Any, split: str) -> Any:
        raise NotImplementedError

    def _example_lengths(self, dataset: Any) -> list[int]:
        raise NotImplementedError

    def _collate(self, examples: list[dict]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _loss_fn(self) -> Callable:
        raise NotImplementedError

    def _init_extras(self) -> dict:
        return {}

    def _ref_params(self, params: Any) -> Any:
        return None

    def _predict_fn(self) -> Callable | None:
        """Optional jitted-able `(params, batch) -> (argmax_ids, label_ids)` for compute_metrics."""
        return None

    # ----------------------------------------------------------------- functional pieces
    def apply_model(self, params: Any):
        """The nnx model bound to `params` (inside jit: a pure function of params)."""
        return nnx.merge(self.graphdef, params)

    def _build_state(self) -> TrainState:
        a = self.args
        self.graphdef, params = nnx.split(self.model)
        # The model object shares arrays with the state; the state is donated each step, so the
        # trainer keeps only the graph definition from here on.
        self.model = None
        max_steps = self.max_steps
        warmup = a.get_warmup_steps(max_steps)
        if self.user_tx is not None:
            self.schedule = self.user_schedule
        else:
            self.schedule = optim.make_schedule(
                a.lr_scheduler_type, a.learning_rate, max_steps, warmup, a.lr_scheduler_kwargs
            )
        self.tx = optim.make_optimizer(
            optim=a.optax_optimizer,
            schedule=self.schedule,
            weight_decay=a.weight_decay,
            adam_beta1=a.adam_beta1,
            adam_beta2=a.adam_beta2,
            adam_epsilon=a.adam_epsilon,
            max_grad_norm=a.max_grad_norm,
            user_tx=self.user_tx,
        )
        ref = self._ref_params(params)
        extras = self._init_extras()
        create = jax.jit(
            lambda p, r, e: TrainState.create(
                p, self.tx, seed=a.seed, ref_params=r, extras=e, fp16=a.fp16
            )
        )
        state = create(params, ref, extras)
        return state

    def _state_shardings(self, state: TrainState):
        return jax.tree.map(lambda x: x.sharding, state)

    def _batch_sharding(self, ndim: int) -> NamedSharding:
        # Leading micro-batch axis A stays whole; the batch axis is split by the `batch` rule.
        (batch_axes,) = parallel.logical_to_spec(("batch",), self.rules)
        return NamedSharding(self.mesh, P(None, batch_axes, *([None] * (ndim - 2))))

    def _to_device(self, host_batch_A: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host-local [A, b_local, ...] numpy -> global [A, b_global, ...] arrays on the mesh."""
        out = {}
        for k, v in host_batch_A.items():
            sharding = self._batch_sharding(v.ndim)
            global_shape = (v.shape[0], v.shape[1] * jax.process_count(), *v.shape[2:])
            out[k] = jax.make_array_from_process_local_data(sharding, v, global_shape)
        return out

    def _collate_micro(self, examples: list[dict], accum: int) -> dict[str, np.ndarray]:
        """Collate each micro-batch separately and stack them on a leading axis A."""
        n = len(examples)
        if n % accum:
            raise ValueError(f"{n} examples do not split into {accum} micro-batches.")
        m = n // accum
        micro = [self._collate(examples[i * m : (i + 1) * m]) for i in range(accum)]
        return {k: np.stack([mb[k] for mb in micro]) for k in micro[0]}

    # ----------------------------------------------------------------- sizes
    @property
    def train_batch_size(self) -> int:
        """Examples per optimizer step over all hosts (TRL's effective batch size)."""
        return (
            self.args.per_device_train_batch_size * self.dp * self.args.gradient_accumulation_steps
        )

    @property
    def steps_per_epoch(self) -> int:
        n = len(self.train_dataset)
        steps = n // self.train_batch_size
        if steps == 0:
            raise ValueError(
                f"The training set has {n} examples, fewer than one batch of "
                f"{self.train_batch_size} (per_device_train_batch_size x data-parallel devices x "
                "gradient_accumulation_steps). Lower the batch size or add data."
            )
        return steps

    @property
    def max_steps(self) -> int:
        if self.args.max_steps and self.args.max_steps > 0:
            return int(self.args.max_steps)
        return math.ceil(self.args.num_train_epochs * self.steps_per_epoch)

    def _train_iterator(self) -> BatchIterator:
        return BatchIterator(
            self.train_dataset,
            global_batch_size=self.train_batch_size,
            seed=self.args.seed,
            shuffle=True,
            drop_last=True,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            collate_fn=list,
        )

    # ----------------------------------------------------------------- compile
    def _compile(self, state: TrainState):
        state_sh = self._state_shardings(state)
        repl = NamedSharding(self.mesh, P())
        loss_fn = self._loss_fn()
        step = make_train_step(loss_fn, self.tx, self.schedule)
        # State donated: params and optimizer moments are updated in place on device.
        self._jit_train_step = jax.jit(
            step,
            in_shardings=(state_sh, None),
            out_shardings=(state_sh, repl),
            donate_argnums=0,
        )
        self._jit_eval_step = jax.jit(make_eval_step(loss_fn), out_shardings=repl)

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
        meta = {
            "trainer_state": dataclasses.asdict(self.state),
            "log_window": self._log_window,
            "tokens_seen": self._tokens_seen,
            "config": self.args.to_dict(),
        }
        tree = {"train_state": self.train_state, "callbacks": self._callback_states()}
        self._checkpointer().save(self.state.global_step, tree, meta)
        self._event("on_save")

    def _callback_states(self) -> dict:
        out = {}
        for cb in self.callback_handler.callbacks:
            tree = cb.state_pytree() if hasattr(cb, "state_pytree") else None
            if tree is not None:
                out[type(cb).__name__] = tree
        return out

    def _resolve_resume(self, resume: Any) -> int | None:
        if resume in (None, False):
            return None
        ckpt = self._checkpointer()
        if resume is True or resume == "latest":
            step = ckpt.latest_step()
            if step is None:  # e.g. a babysitter relaunch before the first save
                logger.warning("No checkpoint in %s yet; starting from scratch.", ckpt.directory)
            return step
        path = os.path.abspath(str(resume))
        name = os.path.basename(path)
        if os.path.isdir(path) and name.isdigit():
            if os.path.dirname(path) != os.path.abspath(str(ckpt.directory)):
                # A step directory of another run: restore from that run's checkpoint folder.
                self._ckpt = Checkpointer(
                    os.path.dirname(path), save_total_limit=self.args.save_total_limit
                )
            return int(name)
        raise ValueError(
            f"resume_from_checkpoint={resume!r}: expected True/'latest' or a step directory "
            f"such as {os.path.join(self.args.output_dir, 'checkpoints', '500')}."
        )

    def _restore(self, step: int):
        for cb in self.callback_handler.callbacks:
            if hasattr(cb, "init_state"):  # stateful callbacks: shapes to restore into
                cb.init_state(self)
        abstract = {
            "train_state": jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                self.train_state,
            ),
            "callbacks": jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                self._callback_states(),
            ),
        }
        tree, meta = self._checkpointer().restore(step, abstract)
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
            and k not in ("output_dir", "resume_from_checkpoint", "disable_tqdm", "report_to")
        )
        if changed:  # the run continues, but it is no longer the run that was saved
            logger.warning("Resuming with changed config fields: %s", ", ".join(changed))
        ts = meta["trainer_state"]
        for k, v in ts.items():
            if hasattr(self.state, k):
                setattr(self.state, k, v)
        self._log_window = meta.get("log_window", [])
        self._tokens_seen = meta.get("tokens_seen", 0)
        logger.info("Resumed from step %d", step)

    # ----------------------------------------------------------------- metrics
    def _flush_pending(self):
        """Read the metrics of the last dispatched step (one step late) and check them."""
        if self._pending is None:
            return
        step, metrics = self._pending
        self._pending = None
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not _is_finite(values):
            bad = sorted(k for k, v in values.items() if not math.isfinite(v))
            raise FloatingPointError(
                f"Non-finite {', '.join(bad)} at step {step}; training stopped and nothing was "
                "saved after the last good checkpoint. Lower learning_rate, enable max_grad_norm, "
                "or use bf16 instead of fp16."
            )
        if "num_tokens" in values:  # per-step count -> running total, TRL's `num_tokens`
            self._tokens_seen += int(values["num_tokens"])
            values["num_tokens"] = float(self._tokens_seen)
        self._log_window.append(values)
        if step in self._log_due:
            self._log_due.discard(step)
            self._emit_log(step)

    def _emit_log(self, step: int):
        window = self._log_window
        if not window:
            return
        logs = {}
        for k in window[-1]:
            if k in self._last_value_metrics:
                logs[k] = window[-1][k]
            else:
                logs[k] = float(np.mean([w[k] for w in window if k in w]))
        self._log_window = []
        self.log(logs, step=step)

    def log(self, logs: dict[str, float], step: int | None = None):
        """Add `epoch`, record in `log_history` and dispatch `on_log` (HF semantics)."""
        step = self.state.global_step if step is None else step
        logs = dict(logs)
        logs["epoch"] = round(step / max(1, self.steps_per_epoch), 4) if self.train_dataset else 0
        logs["step"] = step
        self.state.log_history.append(logs)
        self._event("on_log", logs=logs)

    # ----------------------------------------------------------------- train
    def train(self, resume_from_checkpoint: Any = None) -> TrainerState:
        a = self.args
        if self.train_dataset is None:
            raise ValueError("train() needs a train_dataset.")
        os.makedirs(a.output_dir, exist_ok=True)
        if self.train_state is None:
            self.train_state = self._build_state()
            self._compile(self.train_state)
        self._pending = None
        self._log_due: set[int] = set()
        self._log_window: list[dict] = []
        self._tokens_seen = 0
        max_steps = self.max_steps
        spe = self.steps_per_epoch
        s = self.state
        s.compute_steps(a, max_steps)
        if a.eval_steps is None:
            s.eval_steps = s.logging_steps  # HF: eval_steps defaults to logging_steps
        s.num_train_epochs = math.ceil(max_steps / spe)
        s.train_batch_size = self.train_batch_size
        resume = (
            resume_from_checkpoint
            if resume_from_checkpoint is not None
            else (a.resume_from_checkpoint)
        )
        step0 = self._resolve_resume(resume)
        if step0 is not None:
            self._restore(step0)
        start = int(self.state.global_step)
        it = self._train_iterator()
        it.skip(start)
        sigterm = install_sigterm_handler()
        self._event("on_train_begin")
        if a.eval_on_start and start == 0 and self.eval_dataset is not None:
            self.evaluate()
        accum = a.gradient_accumulation_steps
        t0, tokens0 = time.time(), self._tokens_seen
        try:
            for step in range(start, max_steps):
                if step % spe == 0:
                    self._event("on_epoch_begin")
                self._event("on_step_begin")
                host = self._collate_micro(next(it), accum)
                batch = self._to_device(host)
                self.train_state, metrics = self._jit_train_step(self.train_state, batch)
                self._flush_pending()  # metrics of the previous step, read while this one runs
                self.state.global_step = step + 1
                self.state.epoch = (step + 1) / spe
                self._pending = (step + 1, metrics)
                self._event("on_step_end")
                self._after_step()
                if (step + 1) % spe == 0:
                    self._event("on_epoch_end")
                self._maybe_log_save_evaluate()
                if self._preempted(sigterm):
                    self._save_checkpoint()
                    self._checkpointer().wait_until_finished()
                    raise TrainingInterrupted(
                        f"SIGTERM received: saved step {self.state.global_step} to "
                        f"{a.output_dir}/checkpoints; rerun with --resume_from_checkpoint true."
                    )
                if self.control.should_training_stop:
                    break
            self._flush_pending()
            if self._log_window:
                self._emit_log(self.state.global_step)
        finally:
            sigterm.uninstall()
            if getattr(self, "_ckpt", None) is not None:
                self._ckpt.wait_until_finished()
        runtime = time.time() - t0
        self.log(
            {
                "train_runtime": runtime,
                "train_steps_per_second": (self.state.global_step - start) / max(runtime, 1e-9),
                "train_tokens_per_second": (self._tokens_seen - tokens0) / max(runtime, 1e-9),
            }
        )
        self._event("on_train_end")
        return self.state

    def _preempted(self, sigterm) -> bool:
        """SIGTERM seen: on one host directly; across hosts at a step all of them agree on."""
        if jax.process_count() == 1:
            return sigterm.received
        return self._checkpointer().reached_preemption(self.state.global_step)

    def _after_step(self):
        """Hook for per-step host work (e.g. reference-model sync schedule)."""

    def _maybe_log_save_evaluate(self):
        c = self.control
        if c.should_log:
            c.should_log = False
            self._log_due.add(self.state.global_step)
        if c.should_evaluate:
            c.should_evaluate = False
            self._flush_pending()
            self.evaluate()
        if c.should_save:
            c.should_save = False
            self._save_checkpoint()

    # ----------------------------------------------------------------- eval
    def _eval_batches(self, dataset):
        """Fixed-order eval batches; the last one is padded with weight-0 copies."""
        bs = self.args.per_device_eval_batch_size * self.dp
        n = len(dataset)
        per_host = bs // jax.process_count()
        for start in range(0, n, bs):
            idx = [min(start + i, n - 1) for i in range(bs)]
            real = [start + i < n for i in range(bs)]
            lo = jax.process_index() * per_host
            rows = [dataset[i] for i in idx[lo : lo + per_host]]
            batch = self._collate(rows)
            batch["example_mask"] = np.asarray(real[lo : lo + per_host], np.float32)
            yield {k: v[None] for k, v in batch.items()}

    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> dict:
        if self.train_state is None:
            self.train_state = self._build_state()
            self._compile(self.train_state)
        ds = (
            self.eval_dataset
            if eval_dataset is None
            else self._prepare_dataset(eval_dataset, "eval")
        )
        if ds is None:
            raise ValueError("evaluate() needs an eval_dataset.")
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        mins: dict[str, float] = {}
        maxs: dict[str, float] = {}
        preds, labels = [], []
        predict = self._predict_fn() if self.compute_metrics is not None else None
        if predict is not None and getattr(self, "_jit_predict", None) is None:
            self._jit_predict = jax.jit(predict)
        for host in self._eval_batches(ds):
            batch = self._to_device(host)
            aux = jax.device_get(self._jit_eval_step(self.train_state, batch))
            for k, v in aux.get("sum", {}).items():
                sums[k] = sums.get(k, 0.0) + float(np.sum(v))
                counts[k] = counts.get(k, 0.0) + float(np.sum(aux["count"][k]))
            for k, v in aux.get("min", {}).items():
                mins[k] = min(mins.get(k, np.inf), float(np.min(v)))
            for k, v in aux.get("max", {}).items():
                maxs[k] = max(maxs.get(k, -np.inf), float(np.max(v)))
            if predict is not None:
                p, lab = jax.device_get(self._jit_predict(self.train_state.params, batch))
                keep = host["example_mask"][0] > 0
                preds.append(np.asarray(p)[keep])
                labels.append(np.asarray(lab)[keep])
        metrics = {k: sums[k] / max(counts[k], 1.0) for k in sums}
        metrics.update(mins)
        metrics.update(maxs)
        if predict is not None:
            metrics.update(
                self.compute_metrics(EvalPrediction(np.concatenate(preds), np.concatenate(labels)))
            )
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        self.log(metrics)
        self._event("on_evaluate", metrics=metrics)
        return metrics

    # ----------------------------------------------------------------- export
    def current_model(self):
        """The policy as an nnx model bound to the current params."""
        if self.train_state is None:
            return self.model
        return nnx.merge(self.graphdef, self.train_state.params)

    def save_model(self, output_dir: str | None = None):
        """Write an HF directory (config, safetensors, tokenizer), from process 0 only."""
        from jaxrl import models

        out = output_dir or os.path.join(self.args.output_dir, "final")
        models.save_pretrained(self.current_model(), out)
        if self.is_world_process_zero:
            self.processing_class.save_pretrained(out)
            with open(os.path.join(out, "jaxrl_config.json"), "w") as f:
                json.dump(self.args.to_dict(), f, indent=2, default=str)
        return out

    # ----------------------------------------------------------------- TRL script surface
    # What TRL's example scripts call on a trainer besides train()/save_model() (jaxrl.scripting).
    def _check_script_inputs(self, peft_config, quantization_config, eval_dataset):
        from jaxrl.config import ConfigError

        if peft_config is not None or quantization_config is not None:
            name = "peft_config" if peft_config is not None else "quantization_config"
            raise ConfigError(
                f"`{name}` is not supported yet: LoRA/QLoRA lands with issue 13; until then jaxrl "
                "trains all parameters. Pass None."
            )
        # TRL's scripts set model_init_kwargs after the config is built: validate and map it now.
        self.args.resolve_model_init_kwargs()
        self.args.check_datasets(has_eval=eval_dataset is not None)

    @property
    def accelerator(self) -> Any:
        """The bits of accelerate's `Accelerator` TRL scripts use (`print` on process 0)."""
        from jaxrl.hub import ScriptAccelerator

        return ScriptAccelerator(self.is_world_process_zero)

    @property
    def hub_model_id(self) -> str | None:
        return self.args.hub_model_id

    def push_to_hub(self, commit_message: str | None = "End of training", **kwargs) -> str | None:
        """Save the final model to `output_dir` and upload it to `args.hub_model_id` (process 0).

        TRL's model-card keywords (`dataset_name`, `tags`, ...) go into the README's metadata."""
        from jaxrl.hub import push_folder

        self.save_model(self.args.output_dir)
        if not self.is_world_process_zero:
            return None
        return push_folder(self.args, self.args.output_dir, commit_message, card=kwargs)

    def end(self) -> None:
        """Finish at the end of a script (HF `Trainer.end`): wait for checkpoint writes."""
        if getattr(self, "_ckpt", None) is not None:
            self._ckpt.wait_until_finished()
