"""Trainer shell shared by every algorithm: model and data setup, the loop, eval, checkpoints.

Algorithms subclass `Trainer` and provide four things: how to tokenize a dataset
(`_prepare_dataset`), how to collate examples into fixed-shape numpy arrays (`_collate`), the pure
loss function the generic step differentiates (`_loss_fn`), and optional extra state
(`_init_extras`, `_frozen_params`). Model loading, sharded params, the jitted step with donation,
eval and HF export live here once; the loop (one-step-late metrics, NaN stop, callbacks, orbax
checkpoints with data position, SIGTERM save) is `jaxrl.trainers.loop.TrainLoop`. This file must
not contain algorithm math.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl import parallel, run_dir
from jaxrl.algos import model_dropout, neftune, router_aux
from jaxrl.callbacks.base import (
    TrainerCallback,
)
from jaxrl.config import TrainingConfig
from jaxrl.core import frozen as frozen_weights
from jaxrl.core import optim
from jaxrl.core.state import TrainState
from jaxrl.core.step import make_eval_step, make_train_step
from jaxrl.data.batching import BatchIterator
from jaxrl.data.formats import is_template_file_path, read_chat_template
from jaxrl.trainers.evaluation import (
    EvalPrediction,
    PredictionGatherer,
    PredictionOutput,
    batch_losses_per_example,
    beyond_widths,
    hf_eval_loss,
    prefixed,
    speed_metrics,
    trim_sequences,
)
from jaxrl.trainers.loop import TrainLoop

logger = logging.getLogger("jaxrl")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class Trainer(TrainLoop):
    """Generic jaxrl language-model trainer; use an algorithm subclass (`SFTTrainer`,
    `DPOTrainer`, ...). The loop itself is `TrainLoop`'s; this class adds the model, tokenizer,
    datasets and the offline iteration."""

    config_class: type[TrainingConfig] = TrainingConfig
    model_task = "causal_lm"
    # Whether the trainer runs datasets with images (an `image` / `images` column); the others
    # refuse them rather than train on their text alone.
    supports_images = False
    # Positions per row the LM head runs on, from each row's first scored target (None: all);
    # SFT and DPO set it from their data (`_score_span`, `jaxrl.core.logprobs.scored_logprobs`).
    score_span: int | None = None

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
        preprocess_logits_for_metrics: Callable[[jax.Array, jax.Array], Any] | None = None,
    ):
        self.args = args if args is not None else self.config_class(output_dir="trainer_output")
        if not isinstance(self.args, TrainingConfig):
            raise TypeError(f"args must be a {self.config_class.__name__}, got {type(args)}.")
        self._check_script_inputs(eval_dataset)
        a = self.args
        if a.batch_eval_metrics and compute_metrics is not None:
            # As HF's Trainer: the last batch's call must be told to return the totals.
            if "compute_result" not in inspect.signature(compute_metrics).parameters:
                raise ValueError(
                    "With `batch_eval_metrics=True`, `compute_metrics` must take a "
                    "`compute_result` argument: it is called on each eval batch with "
                    "compute_result=False and on the last one with compute_result=True, and the "
                    "metrics of that last call are the evaluation's."
                )
        run_dir.check_output_dir(a.output_dir)  # [run_dir] before loading anything
        # A metrics.jsonl that appears after this point is this trainer's (an evaluate() before
        # train()), which train() then continues, as HF's log_history does.
        self._metrics_file_preexisted = "metrics.jsonl" in run_dir.previous_run(a.output_dir)
        if a.fp16 and jax.default_backend() == "cpu":
            # As HF's Trainer: fp16 mixed precision is a GPU feature (XLA:CPU has no f16 dot
            # with f32 accumulation).
            raise ValueError("fp16=True needs a GPU; on CPU use bf16=True or full precision.")
        self.mesh = self._make_mesh()
        # The backend's faster layer layout when unset (config.py says why); args stay as given.
        self.scan_layers = (
            a.scan_layers if a.scan_layers is not None else jax.default_backend() != "gpu"
        )
        self.rules = parallel.merge_rules(a.logical_axis_rules)
        self.compute_dtype = self._compute_dtype()
        self.model_path = model if isinstance(model, str) else None
        self.model = self._load_model(model, task=self.model_task)
        self._setup_peft(peft_config, quantization_config)
        # TRL's MoE load-balancing loss (trainers whose config has `router_aux_loss_coef`).
        self.router_aux_loss_coef = (
            router_aux.resolve_coef(a.router_aux_loss_coef, self.model)
            if hasattr(a, "router_aux_loss_coef")
            else 0.0
        )
        self.processing_class = self._load_tokenizer(processing_class)
        self._mirror_pad_token()
        self.compute_metrics = compute_metrics
        # HF's hook, traced into the jitted predict step: it reduces each batch's logits on
        # device (e.g. to argmax ids), so a full [N, T, V] array never reaches the host.
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self._jit_predict = None
        self.user_tx, self.user_schedule = optimizers
        raw_train = self._load_data(train_dataset, "train") if train_dataset is not None else None
        if not self.supports_images:
            for raw in (raw_train, eval_dataset):
                _refuse_images(raw, type(self).__name__)
        self.train_dataset = (
            self._prepare_dataset(raw_train, "train") if raw_train is not None else None
        )
        self._sampling_lengths = self._group_lengths(raw_train)
        # The untokenized eval rows (their `prompt` column feeds the completion callbacks).
        self.raw_eval_dataset = (
            self._load_data(eval_dataset, "eval") if eval_dataset is not None else None
        )
        self.eval_dataset = (
            self._prepare_dataset(self.raw_eval_dataset, "eval")
            if eval_dataset is not None
            else None
        )
        # Per-example row lengths of the datasets seen (`_lengths_of`), newest last.
        self._lengths_cache: list[tuple[Any, np.ndarray]] = []
        self.seq_len = self._choose_seq_len()
        if self.length_buckets != (self.seq_len,):
            logger.info("Row length buckets: %s", list(self.length_buckets))
        self.dp = parallel.data_parallel_size(self.mesh)
        self._init_loop(callbacks)
        self._jit_train_step = None
        self._jit_eval_step = None
        self._event("on_init_end")

    # ----------------------------------------------------------------- setup helpers
    def _make_mesh(self):
        a = self.args
        devices = jax.devices("cpu") if a.use_cpu else jax.devices()  # HF `use_cpu`
        return parallel.config_mesh(a.mesh_data, a.mesh_fsdp, a.mesh_tensor, devices=devices)

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
            residual_dtype=a.residual_dtype,
            mesh=self.mesh,
            rules=self.rules,
            scan_layers=self.scan_layers,
            remat_policy=a.remat_policy or ("full" if a.gradient_checkpointing else "none"),
            activation_offloading=getattr(a, "activation_offloading", False),
        )
        kw.update(self._model_load_kwargs())
        if isinstance(model, str):
            return models.from_pretrained(model, task=task, **kw)
        from transformers import PretrainedConfig

        if isinstance(model, PretrainedConfig):  # random init from a config (from scratch)
            return models.from_config(model, seed=a.seed, task=task, **kw)
        if isinstance(model, nnx.Module):
            self._check_model(model)
            offload = kw["activation_offloading"]
            if offload != getattr(getattr(model, "config", None), "activation_offloading", offload):
                raise ValueError(
                    f"activation_offloading={offload} but the given model was built with "
                    f"activation_offloading={not offload}; build it with the same setting "
                    "(`from_pretrained(..., activation_offloading=...)`) or pass its path."
                )
            # Place a user-built model's params on this trainer's mesh by the sharding rules.
            params = nnx.state(model)
            shardings = parallel.param_shardings(params, self.mesh, self.rules)
            nnx.update(model, jax.device_put(params, shardings))
            return model
        raise TypeError(
            "model must be a path/hub id, a transformers config (random init) or a jaxrl nnx "
            f"model, got {type(model).__name__}."
        )

    def _model_load_kwargs(self) -> dict[str, Any]:
        """Extra `from_pretrained` / `from_config` arguments (SFT on images: `vision=True`)."""
        return {}

    def _check_model(self, model: Any) -> None:
        """Checks a user-built model must pass (none here)."""

    # ----------------------------------------------------------------- LoRA / QLoRA
    def _default_peft_task(self) -> str:
        return "CAUSAL_LM"

    def _setup_peft(self, peft_config: Any, quantization_config: Any) -> None:
        """Wrap the policy in LoRA adapters (TRL's `peft_config`), optionally over a quantized
        base (TRL's `quantization_config`: a `BitsAndBytesConfig`, or "int8" / "nf4"). A model
        that already carries adapters (`lora.load_peft_adapter`) trains them as is."""
        from jaxrl import lora

        scheme = _quantization_scheme(quantization_config)
        if peft_config is not None:
            if getattr(self.model, "lora_config", None) is not None:
                raise ValueError(
                    "The model already has LoRA adapters and peft_config was given too; merge the "
                    "adapters first (lora.merge_lora) or drop peft_config."
                )
            config = peft_config
            if not isinstance(config, lora.LoraConfig):
                config = lora.LoraConfig.from_peft(peft_config)
            if config.task_type is None:
                config = dataclasses.replace(config, task_type=self._default_peft_task())
            if config.task_type != self._default_peft_task():
                raise ValueError(
                    f"peft_config.task_type={config.task_type!r} does not fit "
                    f"{type(self).__name__}; use {self._default_peft_task()!r}."
                )
            lora.apply_lora(self.model, config, nnx.Rngs(self.args.seed))
        self.lora_config = getattr(self.model, "lora_config", None)
        self.is_peft = self.lora_config is not None
        if scheme is not None:
            if not self.is_peft:
                raise ValueError(
                    "quantization_config needs peft_config: a quantized base cannot be trained in "
                    "full, only LoRA adapters on top of it (QLoRA)."
                )
            lora.quantize_base(self.model, scheme)
        if self.is_peft:
            trainable, total = lora.trainable_parameters(self.model)
            logger.info(
                "LoRA: trainable params %d || all params %d || trainable%% %.4f",
                trainable,
                total,
                100 * trainable / total,
            )

    def _default_processing_class(self) -> Any:
        """The processing class loaded from the model directory when none is given."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of `processing_class` (itself, or a processor's `tokenizer`)."""
        return _tokenizer_of(self.processing_class)

    def _load_tokenizer(self, processing_class):
        if processing_class is None:
            if self.model_path is None:
                raise ValueError(
                    "processing_class is required when model is an object; pass the tokenizer."
                )
            processing_class = self._default_processing_class()
        tokenizer = _tokenizer_of(processing_class)  # a processor's options apply to its tokenizer
        # TRL's order: `eos_token` first (so a tokenizer without a pad token pads with the new
        # EOS), then `chat_template_path`, then the pad token.
        if getattr(self.args, "eos_token", None) is not None:
            self._apply_eos_token(tokenizer)
        template_path = getattr(self.args, "chat_template_path", None)
        if template_path is not None and is_template_file_path(template_path):
            processing_class.chat_template = read_chat_template(template_path)
        elif template_path is not None:
            self._clone_chat_template(processing_class, template_path)
        pad = getattr(self.args, "pad_token", None)
        if pad is not None:  # TRL: the config's pad_token overrides the tokenizer's
            if pad not in tokenizer.get_vocab():
                raise ValueError(
                    f"pad_token={pad!r} is not in the tokenizer vocabulary; use an existing token."
                )
            tokenizer.pad_token = pad
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return processing_class

    def _apply_eos_token(self, tokenizer: Any) -> None:
        """TRL's `eos_token` (SFT and reward configs): it becomes the tokenizer's EOS (chat
        templates render it, the EOS appended to standard examples is it, the saved tokenizer
        carries it) and the model config's `eos_token_id`."""
        eos = self.args.eos_token
        if eos not in tokenizer.get_vocab():
            raise ValueError(
                f"eos_token={eos!r} is not in the tokenizer vocabulary; use an existing token "
                f"(the tokenizer's is {tokenizer.eos_token!r})."
            )
        tokenizer.eos_token = eos
        hf_config = getattr(getattr(self.model, "config", None), "hf_config", None)
        if hf_config is not None:
            hf_config.get_text_config().eos_token_id = int(tokenizer.eos_token_id)

    def _clone_chat_template(self, processing_class: Any, path: str) -> None:
        """TRL's `chat_template_path` naming a tokenizer: `clone_chat_template` (its template,
        its added tokens, its EOS; the model's token tables resized to the new vocabulary,
        rounded up to a multiple of 64)."""
        from transformers import ProcessorMixin

        from jaxrl.models.resize import clone_chat_template

        if isinstance(processing_class, ProcessorMixin):
            raise ValueError(
                f"chat_template_path={path!r} names a tokenizer to clone the template of, but the "
                "processing class is a processor (image-text training); give the template as a "
                ".jinja file instead."
            )
        if self.is_peft:
            raise ValueError(
                f"chat_template_path={path!r} clones a tokenizer's template and adds its tokens; "
                "with a LoRA adapter TRL trains the new tokens' embedding rows through PEFT's "
                "`trainable_token_indices`, which jaxrl does not implement. Train in full, or "
                "save that tokenizer's `chat_template` to a .jinja file and pass its path."
            )
        if getattr(getattr(self.model, "config", None), "hf_config", None) is None:
            raise ValueError(
                f"chat_template_path={path!r}: cloning a template resizes the model's "
                "embeddings and sets its config's EOS, which needs a model loaded from a "
                "checkpoint or a transformers config."
            )
        _, _, added = clone_chat_template(self.model, processing_class, path, seed=self.args.seed)
        logger.info(
            "Cloned the chat template of %s: %d tokens added, vocabulary %d.",
            path,
            len(added),
            self.model.config.vocab_size,
        )

    def _mirror_pad_token(self) -> None:
        """TRL: the model agrees with the tokenizer on the pad token from construction, so the
        model config's `pad_token_id` becomes the tokenizer's (saved in config.json; a reward
        model's score position reads it) and, for a model that generates, so does its
        generation config's (`generation_config()`, the exported generation_config.json)."""
        hf_config = getattr(getattr(self.model, "config", None), "hf_config", None)
        if hf_config is not None:
            hf_config.get_text_config().pad_token_id = self.tokenizer.pad_token_id

    def _choose_seq_len(self) -> int:
        from jaxrl.data.collate import choose_seq_len

        lengths: list[int] = []
        for ds in (self.train_dataset, self.eval_dataset):
            if ds is not None:
                lengths.extend(self._lengths_of(ds).tolist())
        if not lengths:
            return self.args.max_length or 1024
        return choose_seq_len(
            lengths, self._max_length(), multiple_of=self.args.pad_to_multiple_of or 1
        )

    @property
    def length_buckets(self) -> tuple[int, ...]:
        """The row lengths a batch may be padded to, ascending, the last being the run's static
        `seq_len` (config `length_buckets`; just `seq_len` for trainers without that field)."""
        from jaxrl.data.collate import length_buckets

        spec = getattr(self.args, "length_buckets", None)
        return length_buckets(self.seq_len, spec, self.args.pad_to_multiple_of)

    def _lengths_of(self, dataset: Any) -> np.ndarray:
        """`_example_lengths(dataset)` as an array, computed once per dataset object (the few
        most recent are kept: the train and eval sets, and one passed to evaluate/predict)."""
        for ds, lengths in self._lengths_cache:
            if ds is dataset:
                return lengths
        lengths = np.asarray(self._example_lengths(dataset), np.int64)
        self._lengths_cache = [*self._lengths_cache[-3:], (dataset, lengths)]
        return lengths

    def _batch_seq_len(self, dataset: Any, indices: Any, split: str) -> int:
        """The row length of a batch of `dataset[indices]` (all of a step's micro-batches, on
        every host): the smallest of `length_buckets` holding its longest example, or the static
        length for rows made to fill it (`_fills_static_length`)."""
        from jaxrl.data.collate import bucket_length

        buckets = self.length_buckets
        if len(buckets) == 1 or self._fills_static_length(split) or len(indices) == 0:
            return self.seq_len
        longest = int(self._lengths_of(dataset)[np.asarray(indices)].max())
        return bucket_length(longest, buckets)

    def _fills_static_length(self, split: str) -> bool:
        """Whether the rows of a `split` ("train" or "eval") dataset are built to the static
        length (SFT packing), so bucketing them would only add compiled shapes."""
        return False

    def _max_length(self) -> int | None:
        """The cap on the run's static row length: `max_length`, where None means no cap (TRL
        then truncates nothing, so the longest example sets the length)."""
        return getattr(self.args, "max_length", None)

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

    def _collate(self, examples: list[dict], seq_len: int | None = None) -> dict[str, np.ndarray]:
        """Numpy arrays of `examples` padded to `seq_len` (default: the static `self.seq_len`)."""
        raise NotImplementedError

    def _loss_units(self) -> Callable[[dict], jax.Array]:
        """`batch_A -> ` the number of loss units (`aux["count"]["loss"]` summed over the
        micro-batches) of a train batch, known before its forward (see `make_loss_and_grads`)."""
        raise NotImplementedError

    def _loss_fn(self) -> Callable:
        raise NotImplementedError

    def _init_extras(self) -> dict:
        return {}

    def _frozen_params(self, params: Any) -> dict[str, Any]:
        """Named frozen models for the train state (e.g. {"ref": ...}); none by default."""
        return {}

    def _frozen_copy(self, params: Any) -> Any:
        """A frozen copy of the whole model state `params` (a reference model as the policy
        starts). Under mixed precision, the weights its forward only reads in the compute dtype
        (the matmul kernels and biases) are stored in that dtype: the same forward bit for bit,
        without casting them every step, in less memory (`jaxrl.core.frozen`). The others (norm
        scales, an embedding table also read into an f32 residual stream) keep their dtype."""
        from jaxrl.callbacks.sync_ref import SyncRefModelCallback

        syncs = any(isinstance(cb, SyncRefModelCallback) for cb in self.callback_handler.callbacks)
        narrower = jnp.dtype(self.compute_dtype).itemsize < jnp.dtype(self._param_dtype()).itemsize
        if syncs or not narrower:
            # TRL's reference sync mixes the policy into the reference in the params' dtype.
            return jax.tree.map(jnp.copy, params)
        probe = frozen_weights.lm_probe(self.graphdef)
        return frozen_weights.in_compute_dtype(probe, params, self.compute_dtype)

    def _prediction_fn(self) -> Callable | None:
        """`(model, micro_batch) -> (logits, label_ids)` of one eval batch in HF's layout (see
        `jaxrl.trainers.evaluation`); traced inside the jitted predict step. None: no
        predictions."""
        return None

    # Rows of predictions per example: DPO predicts a chosen and a rejected row per pair.
    _prediction_groups = 1
    # Whether predictions and labels are per position `[rows, T, ...]` (SFT, DPO), so that
    # they take HF's per-batch widths; reward predictions are per pair.
    _predictions_per_position = True

    def _prediction_input_ids(self, mb: dict) -> jax.Array:
        """The input ids of an eval micro-batch's prediction rows, as `_prediction_fn` lays its
        rows out (`EvalPrediction.inputs` with `include_for_metrics=["inputs"]`): by default the
        batch's `input_ids` (SFT `[B, T]`, reward `[B, 2, T]` pairs). Traced in the predict step."""
        return mb["input_ids"]

    # ----------------------------------------------------------------- functional pieces
    def apply_model(self, params: Any, state: TrainState | None = None):
        """The nnx model bound to `params` (inside jit: a pure function of params). With LoRA,
        `params` is the adapter and `state.frozen["base"]` the frozen base; without `state`,
        `params` must be the whole model state (`current_params()`)."""
        if self.is_peft and state is not None:
            model = nnx.merge(self.graphdef, params, state.frozen["base"])
        else:
            model = nnx.merge(self.graphdef, params)
        # In a training step: the trained params' forwards drop (the model's dropout rates) and
        # get NEFTune noise (`neftune_noise_alpha`).
        model = model_dropout.dropping_policy(model, params)
        return neftune.noisy_policy(model, params)

    def _build_state(self) -> TrainState:
        a = self.args
        if self.is_peft:
            from jaxrl import lora
            from jaxrl.callbacks.bema import BEMACallback

            if any(isinstance(cb, BEMACallback) for cb in self.callback_handler.callbacks):
                raise ValueError(
                    "BEMACallback is not supported with LoRA (peft_config): it averages and "
                    "exports full weights; train without peft_config or drop the callback."
                )
            # Only the adapter is trained (and seen by the optimizer); the base is frozen.
            self.graphdef, params, base = lora.split_lora(self.model)
        else:
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
        frozen = self._frozen_params(params)
        if self.is_peft:
            frozen["base"] = base
        extras = self._init_extras()
        create = jax.jit(
            lambda p, f, e: TrainState.create(
                p, self.tx, seed=a.seed, frozen=f, extras=e, fp16=a.fp16
            )
        )
        return create(params, frozen, extras)

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

    def _collate_micro(
        self,
        examples: list[dict],
        accum: int,
        real: int | None = None,
        seq_len: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Collate each micro-batch separately, all to `seq_len` (default: the static length),
        and stack them on a leading axis A. With `real`, also `example_mask` `[A, B]`: 1 for the
        first `real` examples, 0 for the fill after."""
        n = len(examples)
        if n % accum:
            raise ValueError(f"{n} examples do not split into {accum} micro-batches.")
        m = n // accum
        micro = [self._collate(examples[i * m : (i + 1) * m], seq_len) for i in range(accum)]
        batch_A = {k: np.stack([mb[k] for mb in micro]) for k in micro[0]}
        if real is not None:
            batch_A["example_mask"] = (np.arange(n) < real).astype(np.float32).reshape(accum, m)
        return batch_A

    # ----------------------------------------------------------------- sizes
    @property
    def train_batch_size(self) -> int:
        """Examples per optimizer step over all hosts (TRL's effective batch size)."""
        return (
            self.args.per_device_train_batch_size * self.dp * self.args.gradient_accumulation_steps
        )

    @property
    def steps_per_epoch(self) -> int:
        """HF's optimizer steps per epoch with `dataloader_drop_last=False`: the last batch of an
        epoch holds the examples left over (`ceil(N / batch)`; `_train_iteration` pads it)."""
        n = len(self.train_dataset)
        if n == 0:
            raise ValueError("The training set is empty; pass a dataset with examples.")
        return -(-n // self.train_batch_size)

    def _train_iterator(self) -> BatchIterator:
        a = self.args
        return BatchIterator(
            self.train_dataset,
            global_batch_size=self.train_batch_size,
            seed=a.data_seed if a.data_seed is not None else a.seed,  # HF's data_seed
            shuffle=a.train_sampling_strategy != "sequential",
            drop_last=False,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            collate_fn=list,
            lengths=self._sampling_lengths,
            # HF groups by `train_batch_size * gradient_accumulation_steps`: one process's
            # examples per optimizer step (its devices' under torch DDP, one device each).
            group_batch_size=a.per_device_train_batch_size * a.gradient_accumulation_steps,
            # Every host pads the step's batch to the length its global indices call for.
            with_global_indices=True,
        )

    def _group_lengths(self, raw: Any) -> list[int] | None:
        """Per training row, the lengths `train_sampling_strategy="group_by_length"` sorts by
        (None for the other strategies), as HF's Trainer finds them: the dataset's
        `length_column_name` column, else the length of each row's `input_ids`. The column is
        read from the dataset as given, so it is used while the prepared rows are its examples one
        to one (SFT packing makes new rows; dropped examples leave no way to match them)."""
        a = self.args
        if a.train_sampling_strategy != "group_by_length" or self.train_dataset is None:
            return None
        column = a.length_column_name
        prepared = self.train_dataset
        unusable = None  # why the dataset's length column cannot be used
        if column in (getattr(raw, "column_names", None) or []):
            if getattr(a, "packing", False):
                unusable = "packing makes new rows"
            elif len(raw) != len(prepared):
                unusable = f"{len(raw) - len(prepared)} examples were dropped in preparation"
            else:
                return [int(n) for n in raw[column]]
        if "input_ids" in prepared.column_names:
            if unusable is not None:
                logger.warning(
                    "train_sampling_strategy='group_by_length': the %r column does not describe "
                    "the training rows (%s), so their input_ids lengths are used instead.",
                    column,
                    unusable,
                )
            return [len(ids) for ids in prepared["input_ids"]]
        if unusable is not None:
            raise ValueError(
                f"train_sampling_strategy='group_by_length': the train dataset's {column!r} column "
                f"does not describe the training rows ({unusable}); remove those examples from "
                "the dataset first, or use train_sampling_strategy='random'."
            )
        raise ValueError(
            "train_sampling_strategy='group_by_length' needs each training example's length: HF "
            f"reads the dataset's {column!r} column (`length_column_name`) or infers it from an "
            f"'input_ids' column, and {type(self).__name__}'s rows have neither. Add a "
            f"{column!r} column to the train dataset, or use train_sampling_strategy='random'."
        )

    # ----------------------------------------------------------------- the offline iteration
    def _has_train_data(self) -> bool:
        return self.train_dataset is not None

    def _has_eval_data(self) -> bool:
        return self.eval_dataset is not None

    def _ensure_state(self) -> None:
        if self.train_state is None:
            self.train_state = self._build_state()
            self._compile(self.train_state)

    def _prepare_for_evaluation(self) -> None:
        """`_ensure_state` for `evaluate()` / `predict()`. HF: when they run before any training,
        they prepare the model themselves, and that time (here: building the sharded state and
        compiling the steps) is `{prefix}_model_preparation_time` (s, 4 decimals) in their
        metrics from then on, left out of `{prefix}_runtime`."""
        if self.train_state is None:
            start = time.time()
            self._ensure_state()
            if not self._models_prepared_at_init():
                self.model_preparation_time = round(time.time() - start, 4)

    def _models_prepared_at_init(self) -> bool:
        """Whether TRL's trainer hands a model (a reference, a reward model) to accelerate in its
        constructor: then HF's evaluation finds accelerate already holding models and reports no
        `model_preparation_time`."""
        return False

    def _state_updates_changed(self) -> None:
        if self.train_state is not None:  # else the first `_ensure_state` compiles them
            self._compile(self.train_state)

    def _train_iteration(self, item: tuple[list[dict], np.ndarray]) -> dict:
        """Offline: collate the next batch into micro-batches and run one train step.

        `item` is this host's examples and the global batch's dataset indices, from which
        every host derives the same row length (`_batch_seq_len`): all micro-batches and
        processes of a step share it. Every batch carries `example_mask` (one compiled step
        per row length): 1 for real examples, 0 for the copies that fill an epoch's last,
        partial batch to the full batch shape. The losses and metrics weight by it, so that
        step trains on the real examples only, as HF's shorter last batch does
        (`dataloader_drop_last=False`, TRL's default).
        """
        examples, global_idx = item
        per_host = self.train_batch_size // jax.process_count()
        real = len(examples)
        if len(global_idx) < jax.process_count():
            # Some host holds no example and fills its rows with copies of example 0.
            global_idx = np.append(global_idx, 0)
        if real < per_host:
            fill = examples or [self.train_dataset[0]]
            examples = list(examples) + [fill[i % len(fill)] for i in range(per_host - real)]
        seq_len = self._batch_seq_len(self.train_dataset, global_idx, "train")
        host = self._collate_micro(
            examples, self.args.gradient_accumulation_steps, real=real, seq_len=seq_len
        )
        batch = self._to_device(host)
        self.train_state, metrics = self._jit_train_step(self.train_state, batch)
        if self.args.include_num_input_tokens_seen != "no":
            metrics = {**metrics, "num_input_tokens_seen": self._input_tokens(host)}
        return metrics

    def _trl_device_rows(self) -> int:
        """How many consecutive rows of a train micro-batch TRL's collator gets as one device's
        share: `per_device_train_batch_size` (SFT's padding-free rows: 1, each row a device's)."""
        return self.args.per_device_train_batch_size

    def _input_tokens(self, host_A: dict[str, np.ndarray]) -> Any:
        """HF's `num_input_tokens_seen` increment of one step, counted on the host's collated
        micro-batches as TRL collates them (`collate.trl_input_tokens`), summed over hosts."""
        from jaxrl.data.collate import trl_input_tokens

        a = self.args
        count = sum(
            trl_input_tokens(
                {k: v[i] for k, v in host_A.items()},
                host_A["example_mask"][i],
                mode=a.include_num_input_tokens_seen,
                pad_token_id=self.tokenizer.pad_token_id,
                per_device=self._trl_device_rows(),
                multiple_of=a.pad_to_multiple_of,
            )
            for i in range(host_A["example_mask"].shape[0])
        )
        if jax.process_count() == 1:
            return count
        # Each host counted its own rows: a sum over a global array, read one step late.
        per_row = np.zeros(host_A["example_mask"].shape[:2], np.int32)
        per_row[0, 0] = count
        return jnp.sum(self._to_device({"n": per_row})["n"])

    # ----------------------------------------------------------------- compile
    def _compile(self, state: TrainState):
        state_sh = self._state_shardings(state)
        repl = NamedSharding(self.mesh, P())
        loss_fn = self._loss_fn()
        step = make_train_step(
            self._with_neftune(self._with_model_dropout(self._with_lora_dropout(loss_fn))),
            self.tx,
            self.schedule,
            self._state_updates(),
            loss_units=self._loss_units() if self.router_aux_loss_coef else None,
        )
        # State donated: params and optimizer moments are updated in place on device.
        self._jit_train_step = jax.jit(
            step,
            in_shardings=(state_sh, None),
            out_shardings=(state_sh, repl),
            donate_argnums=0,
        )
        self._jit_eval_step = jax.jit(make_eval_step(loss_fn), out_shardings=repl)

    def _with_lora_dropout(self, loss_fn: Callable) -> Callable:
        """The training loss with `lora_dropout` drawn from the step's key (eval has none).

        `disable_dropout=True` (DPO, reward, GRPO, RLOO) zeroes it, as TRL's
        `disable_dropout_in_model` does to the PEFT model's dropout modules.
        """
        if getattr(self.args, "disable_dropout", False):
            return loss_fn
        if not self.is_peft or not self.lora_config.lora_dropout:
            return loss_fn
        from jaxrl import lora

        def train_loss(params, state, mb, rng, extras):
            with lora.dropout_rng(jax.random.fold_in(rng, 0x10A)):
                return loss_fn(params, state, mb, rng, extras)

        return train_loss

    def _model_dropout_active(self) -> bool:
        """Whether the policy's training forwards apply the model's dropout: a nonzero rate in
        its config and no `disable_dropout=True` (SFT has no such option: always)."""
        if getattr(self.args, "disable_dropout", False):
            return False
        return model_dropout.has_dropout(getattr(self.model, "config", None))

    def _with_model_dropout(self, loss_fn: Callable) -> Callable:
        """The training loss with the model's own dropout (attention / residual / embedding
        rates of its config) in the policy's forwards, drawn from the micro-batch's key (eval,
        references and generation have none); see `algos.model_dropout`."""
        if not self._model_dropout_active():
            return loss_fn

        def train_loss(params, state, mb, rng, extras):
            key = jax.random.fold_in(rng, model_dropout.DROPOUT_STREAM)
            with model_dropout.training_dropout(params, key):
                return loss_fn(params, state, mb, rng, extras)

        return train_loss

    def _with_neftune(self, loss_fn: Callable) -> Callable:
        """The training loss with NEFTune noise (`neftune_noise_alpha`) on the policy's token
        embeddings, drawn from the micro-batch's key (eval has none); see `algos.neftune`."""
        a = self.args
        if a.neftune_noise_alpha is None:
            return loss_fn

        def train_loss(params, state, mb, rng, extras):
            with neftune.training_noise(
                params,
                jax.random.fold_in(rng, neftune.NOISE_STREAM),
                a.neftune_noise_alpha,
                mb["example_mask"],
                self._trl_device_rows(),
                a.pad_to_multiple_of,
            ):
                return loss_fn(params, state, mb, rng, extras)

        return train_loss

    # ----------------------------------------------------------------- checkpoints
    def _save_checkpoint(self):
        # The frozen base is not saved: it is reloaded from the model path on resume, so a
        # LoRA checkpoint holds the adapter and its optimizer state only.
        with self._without_base():
            super()._save_checkpoint()
        if self.args.push_to_hub:
            self._push_from_checkpoint(self.state.global_step)

    def _restore(self, step: int):
        with self._without_base():
            super()._restore(step)

    def _restore_params(self, step: int):
        with self._without_base():
            return super()._restore_params(step)

    @contextlib.contextmanager
    def _without_base(self):
        if not self.is_peft or self.train_state is None:
            yield
            return
        frozen = dict(self.train_state.frozen)
        base = frozen.pop("base")
        self.train_state = self.train_state.replace(frozen=frozen)
        try:
            yield
        finally:
            self.train_state = self.train_state.replace_frozen(base=base)

    # ----------------------------------------------------------------- eval
    def _eval_batches(self, dataset):
        """Fixed-order eval batches, each padded to its own bucket (`_batch_seq_len`); the last
        one is filled with weight-0 copies."""
        bs = self.args.per_device_eval_batch_size * self.dp
        n = len(dataset)
        per_host = bs // jax.process_count()
        for start in range(0, n, bs):
            idx = [min(start + i, n - 1) for i in range(bs)]
            real = [start + i < n for i in range(bs)]
            lo = jax.process_index() * per_host
            rows = [dataset[i] for i in idx[lo : lo + per_host]]
            batch = self._collate(rows, self._batch_seq_len(dataset, idx, "eval"))
            batch["example_mask"] = np.asarray(real[lo : lo + per_host], np.float32)
            yield {k: v[None] for k, v in batch.items()}

    def _before_evaluation(self, dataset: Any) -> None:
        """Host-side work an algorithm does at each evaluation before the metric pass (DPO's
        `generate_during_eval`); none by default."""

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict:
        """Eval loss and metrics over `eval_dataset` (default: the trainer's), logged and
        returned with keys `{metric_key_prefix}_*` (HF). With `compute_metrics`, it also gets
        the gathered predictions (HF's layout; `preprocess_logits_for_metrics` runs on device),
        or each batch's with `batch_eval_metrics` (see `_evaluation_loop`)."""
        self._prepare_for_evaluation()
        ds = (
            self.eval_dataset
            if eval_dataset is None
            else self._admit(self._prepare_dataset(eval_dataset, "eval"))
        )
        if ds is None:
            raise ValueError("evaluate() needs an eval_dataset.")
        self._before_evaluation(ds)
        want = self.compute_metrics is not None and not self.args.prediction_loss_only
        metrics, _ = self._evaluation_loop(ds, metric_key_prefix, ignore_keys, want)
        self.log(metrics)
        self._event("on_evaluate", metrics=metrics)
        return metrics

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> PredictionOutput:
        """HF's `predict`: predictions and labels over `test_dataset` (raw rows, a path or hub id,
        or already tokenized), with the eval metrics (and `compute_metrics`') under
        `{metric_key_prefix}_*`. Predictions per trainer: SFT, the logits `[N, T, V]` (or the
        output of `preprocess_logits_for_metrics`); DPO, those of the `prompt + chosen` rows then
        the `prompt + rejected` rows `[2N, ...]`; reward, the `[N, 2]` (chosen, rejected) scores
        with label 0 (the chosen column). `T` and the -100 padding are HF's: each eval batch as
        wide as TRL pads its devices' rows, the narrower batches padded to the widest with -100
        (`jaxrl.trainers.evaluation`), whatever `length_buckets`. Not logged; callbacks get
        `on_predict`."""
        self._prepare_for_evaluation()
        ds = self._admit(self._prepare_dataset(test_dataset, "test"))
        want = not self.args.prediction_loss_only  # HF: then no predictions, no labels
        metrics, (preds, labels) = self._evaluation_loop(
            ds, metric_key_prefix, ignore_keys, want, predicting=True
        )
        self._event("on_predict", metrics=metrics)
        return PredictionOutput(preds, labels, metrics)

    def _admit(self, ds: Any) -> Any:
        """A dataset given to `evaluate`/`predict` after the steps were compiled: where the LM
        head runs on a `score_span` (SFT, DPO) too short for it, the span widens and the steps
        are compiled again."""
        if self.score_span is not None and ds is not None:
            needed = self._score_span([ds])
            if needed is None or needed > self.score_span:
                self.score_span = needed
                self._compile(self.train_state)
        return ds

    def _score_span(self, sources: list) -> int | None:
        """The `score_span` the datasets in `sources` need (None: the whole row)."""
        return None

    def _evaluation_loop(
        self,
        ds: Any,
        prefix: str,
        ignore_keys: list[str] | None,
        want_predictions: bool,
        predicting: bool = False,
    ) -> tuple[dict, tuple[Any, Any]]:
        """Eval metrics (prefixed) and, when asked for and the trainer has them, the predictions
        and labels of every example in order (gathered across processes on every host).

        Averaged as HF and TRL do: each metric's value is taken per eval batch
        (`per_device_eval_batch_size` x data-parallel devices; the last one holds the remaining
        examples), then the loss is averaged over the batches weighted by their example counts,
        non-finite ones left out (HF's `eval_loss`, `hf_eval_loss`) and every other metric, a
        batch's min and max included, is the plain mean of the batch values (TRL's `log()`).
        `num_tokens` is the training tokens seen so far, as TRL logs it at evaluation. HF's
        `{prefix}_runtime`, `_samples_per_second` and `_steps_per_second` are added.

        `compute_metrics` as HF's `evaluation_loop` calls it: once on everything gathered, or,
        with `batch_eval_metrics`, on each batch's rows with `compute_result=False` and on the
        last batch's with `compute_result=True`, the last call's return value being the
        metrics (evaluate() then keeps no predictions; predict() still returns them).
        `include_for_metrics` adds `inputs` and/or `losses` to its `EvalPrediction`. Each
        batch's outputs reach the host as soon as it is done (HF's `eval_accumulation_steps=1`),
        so nothing accumulates on the accelerator."""
        start = time.time()
        a = self.args
        batch_values: dict[str, list[float]] = {}
        batch_losses: list[float] = []
        seen_totals: set[str] = set()
        # HF drops model outputs named in ignore_keys; the only output here is `logits`.
        want_predictions = want_predictions and "logits" not in (ignore_keys or [])
        predict = self._jitted_predict() if want_predictions else None
        per_batch = a.batch_eval_metrics and self.compute_metrics is not None
        keep_all = not per_batch or predicting  # HF: batch_eval_metrics keeps them for predict()
        want_inputs = "inputs" in a.include_for_metrics
        want_losses = "loss" in a.include_for_metrics
        groups = self._prediction_groups
        concat = a.eval_do_concat_batches
        preds, labels, inputs = (PredictionGatherer(groups, concat) for _ in range(3))
        example_losses: list[np.ndarray] = []
        bs = a.per_device_eval_batch_size * self.dp
        n_batches = -(-len(ds) // bs)
        batch_metrics = None
        for step, host in enumerate(self._eval_batches(ds)):
            batch = self._to_device(host)
            aux = jax.device_get(self._jit_eval_step(self.train_state, batch))
            values = {
                k: float(np.sum(v)) / max(float(np.sum(aux["count"][k])), 1.0)
                for k, v in aux.get("sum", {}).items()
            }
            values.update({k: float(np.nanmin(v)) for k, v in aux.get("min", {}).items()})
            values.update({k: float(np.nanmax(v)) for k, v in aux.get("max", {}).items()})
            seen_totals.update(aux.get("total", {}))
            for k, v in values.items():
                if k == self._loss_metric:
                    batch_losses.append(v)
                else:
                    batch_values.setdefault(k, []).append(v)
            if predict is None:
                continue
            p, lab, ids, widths = predict(self.current_params(), batch)
            p, lab, widths = parallel.to_host((p, lab, widths))
            ids = parallel.to_host(ids) if want_inputs else None
            keep = parallel.to_host(batch["example_mask"])[0] > 0
            if widths is not None:  # HF's batch width: its widest device's rows
                t, width = host["input_ids"].shape[-1], int(widths[keep].max())
                if self._predictions_per_position:
                    p, lab = trim_sequences((p, lab), t, width)
                ids = None if ids is None else trim_sequences(ids, t, width, axis=-1)
            losses = None
            if want_losses and self._loss_metric in values:
                losses = batch_losses_per_example(values[self._loss_metric], int(keep.sum()))
            if keep_all:
                preds.add(p, keep)
                labels.add(lab, keep)
            if per_batch:
                one = PredictionGatherer(groups)
                batch_metrics = self.compute_metrics(
                    EvalPrediction(
                        one.batch_rows(p, keep),
                        one.batch_rows(lab, keep),
                        inputs=None if ids is None else one.batch_rows(ids, keep),
                        losses=losses,
                    ),
                    compute_result=step == n_batches - 1,
                )
                continue
            if ids is not None:  # for the one compute_metrics call after the loop
                inputs.add(ids, keep)
            if losses is not None:
                example_losses.append(losses)
        metrics = {}
        if batch_losses:
            metrics[self._loss_metric] = hf_eval_loss(batch_losses, len(ds), bs)
        metrics.update({k: float(np.mean(v)) for k, v in batch_values.items()})
        if "num_tokens" in seen_totals:
            metrics["num_tokens"] = float(getattr(self, "_tokens_seen", 0))
        all_preds, all_labels = preds.result(), labels.result()
        if per_batch:
            metrics.update(batch_metrics or {})
        elif self.compute_metrics is not None and all_preds is not None:
            pred = EvalPrediction(
                all_preds,
                all_labels,
                inputs=inputs.result() if want_inputs else None,
                losses=(np.concatenate(example_losses) if concat else example_losses)
                if example_losses
                else None,
            )
            metrics.update(self.compute_metrics(pred))
        metrics = prefixed(metrics, prefix)
        prep = getattr(self, "model_preparation_time", None)
        metrics.update(speed_metrics(prefix, start, len(ds), bs, prep))
        return metrics, (all_preds, all_labels)

    def _hf_widths(self, mb: dict) -> jax.Array | None:
        """Per example of an eval micro-batch `[B]`: the width HF's evaluation gives its rows
        (its device's longest row, rounded up to `pad_to_multiple_of`); None for best-fit packed
        rows, which keep the static length."""
        from jaxrl.data.collate import trl_example_widths

        if "segment_ids" in mb:
            return None
        a = self.args
        return trl_example_widths(
            mb, mb["example_mask"], a.per_device_eval_batch_size, a.pad_to_multiple_of
        )

    def _jitted_predict(self) -> Callable | None:
        """The jitted `(params, batch) -> (predictions, label_ids, input_ids, widths)` (built
        once), or None; `input_ids` are in the predictions' row layout (`_prediction_input_ids`),
        `widths` HF's per example (`_hf_widths`), past which the rest are -100."""
        if self._jit_predict is None:
            fn = self._prediction_fn()
            if fn is None:
                return None
            input_ids = self._prediction_input_ids
            preprocess = self.preprocess_logits_for_metrics
            if preprocess is None and self.model_task == "causal_lm":
                logger.warning(
                    "%s hands compute_metrics/predict the full logits [N, T, vocab] on the host, "
                    "as HF does; pass preprocess_logits_for_metrics (e.g. an argmax) to reduce "
                    "them on device.",
                    type(self).__name__,
                )

            def predict(params, batch_A):
                mb = {k: v[0] for k, v in batch_A.items()}
                logits, label_ids = fn(self.apply_model(params), mb)
                ids = input_ids(mb)
                widths_B = self._hf_widths(mb)
                if widths_B is not None:  # -100 past each device's rows, as HF pads them
                    if self._predictions_per_position:
                        logits = beyond_widths(logits, widths_B, 1)
                        label_ids = beyond_widths(label_ids, widths_B, 1)
                    ids = beyond_widths(ids, widths_B, ids.ndim - 1)
                if preprocess is not None:
                    logits = preprocess(logits, label_ids)
                return logits, label_ids, ids, widths_B

            self._jit_predict = jax.jit(predict)
        return self._jit_predict

    # ----------------------------------------------------------------- generation
    def generation_config(self, generation_config: Any = None, **overrides: Any):
        """A `jaxrl.generation.GenerationConfig` from a transformers `GenerationConfig` (or ours,
        or None: the model directory's `generation_config.json` if any, else transformers'
        defaults), with the tokenizer's EOS and pad ids where the config gives none (the model's
        own config always pads with the tokenizer's pad, which TRL mirrors onto it)."""
        from jaxrl.generation import GenerationConfig

        tok = self.tokenizer
        ids = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
        if isinstance(generation_config, GenerationConfig):
            return dataclasses.replace(generation_config, **overrides)
        if generation_config is None:
            from transformers import GenerationConfig as HFGenerationConfig

            # The model's own generation config pads with the tokenizer's pad (TRL mirrors it).
            overrides.setdefault("pad_token_id", tok.pad_token_id)
            generation_config = HFGenerationConfig()
            if self.model_path is not None and os.path.isfile(
                os.path.join(self.model_path, "generation_config.json")
            ):
                generation_config = HFGenerationConfig.from_pretrained(self.model_path)
        for name, value in ids.items():
            if getattr(generation_config, name, None) is None:
                overrides.setdefault(name, value)
        if getattr(generation_config, "max_new_tokens", None) is None:
            # transformers' default budget is max_length=20 tokens in total; per prompt that
            # depends on its length, so we give 20 new tokens (GenerationConfig's default).
            overrides.setdefault("max_new_tokens", 20)
        return GenerationConfig.from_transformers(generation_config, **overrides)

    def sampler(self):
        """The KV-cache sampler over this trainer's model graph and mesh (built once)."""
        if getattr(self, "_sampler", None) is None:
            from jaxrl.generation import Sampler

            graphdef = self.graphdef if self.train_state is not None else nnx.graphdef(self._model)
            self._sampler = Sampler(graphdef, mesh=self.mesh, rules=self.rules)
        return self._sampler

    def current_params(self) -> Any:
        """The policy params: the train state's (no copy) or, before training, the model's. With
        LoRA: adapter and frozen base together (the whole model's state, for `nnx.merge`)."""
        if self.train_state is not None:
            if self.is_peft:
                return nnx.merge_state(self.train_state.params, self.train_state.frozen["base"])
            return self.train_state.params
        return nnx.state(self._model)

    def generate_completions(
        self,
        prompts: list[str],
        generation_config: Any = None,
        batch_size: int | None = None,
        params: Any = None,
    ) -> list[str]:
        """Decoded completions of text prompts from the current policy (or `params`), batched by
        `per_device_eval_batch_size` x data-parallel devices, special tokens skipped (TRL's
        `_generate_completions`)."""
        tok = self.tokenizer
        ids = [tok(p)["input_ids"] for p in prompts]
        config = self.generation_config(generation_config)
        return self.sample_texts(ids, config, params=params, batch_size=batch_size)

    def sample_texts(
        self,
        prompt_ids: list[list[int]],
        config: Any,
        *,
        params: Any = None,
        sampler: Any = None,
        batch_size: int | None = None,
        seed: int | None = None,
    ) -> list[str]:
        """Decoded completions (special tokens skipped) of tokenized prompts, sampled with a
        `jaxrl.generation.GenerationConfig` by `sampler` (default: the policy's) from `params`
        (default: the current policy). Chunk i of `batch_size` prompts uses seed `seed + i *
        batch_size` (default seed: `args.seed`)."""
        tok = self.processing_class
        batch_size = batch_size or self.args.per_device_eval_batch_size * self.dp
        params = self.current_params() if params is None else params
        sampler = sampler or self.sampler()
        seed = self.args.seed if seed is None else seed
        out: list[str] = []
        for start in range(0, len(prompt_ids), batch_size):
            ids = list(prompt_ids[start : start + batch_size])
            n_real = len(ids)
            # A short final chunk is filled with copies so every call has the same batch shape.
            ids += [ids[-1]] * (batch_size - n_real)
            sample = sampler(params, ids, config, seed=seed + start)
            tokens, mask = jax.device_get((sample.completion_ids_BN, sample.completion_mask_BN))
            for row in range(n_real):
                kept = [int(t) for t, m in zip(tokens[row], mask[row], strict=True) if m]
                out.append(tok.decode(kept, skip_special_tokens=True))
        return out

    # ----------------------------------------------------------------- export
    @property
    def model(self):
        """HF's `trainer.model`: the loaded model before training, afterwards the policy bound to
        the current params (a view of the train state: read it between steps, as after
        `train()`; the next step donates those arrays)."""
        if getattr(self, "train_state", None) is None:
            return self._model
        return self.current_model()

    @model.setter
    def model(self, value):
        self._model = value

    def current_model(self):
        """The policy as an nnx model bound to the current params."""
        if self.train_state is None:
            return self._model
        return nnx.merge(self.graphdef, self.current_params())

    def save_model(self, output_dir: str | None = None, merged: bool = False):
        """Write an HF directory (config, safetensors, tokenizer), from process 0 only. With LoRA,
        as TRL with PEFT: the adapter alone (`adapter_config.json` + `adapter_model.safetensors`,
        `base_model_name_or_path` = the model path), or with `merged=True` the full model with
        the adapters folded in (PEFT's `merge_and_unload`)."""
        from jaxrl import lora, models

        out = output_dir or os.path.join(self.args.output_dir, "final")
        if merged and not self.is_peft:
            raise ValueError("save_model(merged=True) merges LoRA adapters; this model has none.")
        if self.is_peft and not merged:
            lora.save_peft_adapter(self.current_model(), out, self.model_path)
        elif self.is_peft:
            models.save_pretrained(lora.merge_lora(self.current_model()), out)
        else:
            models.save_pretrained(self.current_model(), out)
        if self.is_world_process_zero():
            self.processing_class.save_pretrained(out)
            with open(os.path.join(out, "jaxrl_config.json"), "w") as f:
                json.dump(self.args.to_dict(), f, indent=2, default=str)
            adapter_only = self.is_peft and not merged
            if self.model_task == "causal_lm" and not adapter_only:
                # As transformers' save_pretrained for a model that can generate. Our own edits
                # (pad/EOS ids) must not make transformers validate a source config strictly: it
                # refuses to save a modified config that only warns (e.g. top_k without
                # do_sample), and saves an unmodified one back as it was published.
                generation_config = self._export_generation_config(out)
                generation_config._original_object_hash = hash(generation_config)
                generation_config.save_pretrained(out)
            self._write_model_card(out, library_name="peft" if adapter_only else "transformers")
        return out

    def _export_generation_config(self, out: str) -> Any:
        """The source model's `generation_config.json` if it has one (local or cached), else
        derived from the exported config.json as transformers does when it loads a model; its
        `pad_token_id` is the tokenizer's (TRL mirrors it)."""
        from transformers import AutoConfig, GenerationConfig

        config = None
        if self.model_path is not None:
            try:
                config = GenerationConfig.from_pretrained(self.model_path, local_files_only=True)
            except OSError:
                pass  # the source has none: derive it below
        if config is None:
            config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(out))
        config.pad_token_id = self.tokenizer.pad_token_id  # TRL mirrors the tokenizer's
        return config

    # What the model card says about the trainer (TRL's class attributes of the same names).
    _name = "Trainer"
    _tag_names: tuple[str, ...] = ("trl",)
    _paper: dict[str, str] = {}

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
    ) -> None:
        """TRL's `create_model_card`: write `README.md` into `output_dir` (process 0)."""
        if jax.process_index() == 0:
            self._write_model_card(
                self.args.output_dir, model_name=model_name, dataset_name=dataset_name, tags=tags
            )

    def _write_model_card(
        self,
        folder: str,
        library_name: str = "transformers",
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
    ) -> None:
        from jaxrl.model_card import card_fields, model_card

        fields = card_fields(self)
        fields["model_name"] = model_name or fields["model_name"]
        fields["tags"] += [tags] if isinstance(tags, str) else list(tags or [])
        pipeline = "text-generation" if self.model_task == "causal_lm" else "text-classification"
        card = model_card(
            **fields, dataset_name=dataset_name, library_name=library_name, pipeline_tag=pipeline
        )
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "README.md"), "w") as f:
            f.write(card)

    # ----------------------------------------------------------------- TRL script surface
    # What TRL's example scripts call on a trainer besides train()/save_model() (jaxrl.scripting).
    def _check_script_inputs(self, eval_dataset):
        # TRL's scripts set model_init_kwargs after the config is built: validate and map it now.
        self.args.resolve_model_init_kwargs()
        self.args.check_datasets(has_eval=eval_dataset is not None)

    @property
    def accelerator(self) -> Any:
        """The bits of accelerate's `Accelerator` TRL scripts use (`print` on process 0)."""
        from jaxrl.hub import ScriptAccelerator

        return ScriptAccelerator(self.is_world_process_zero())

    @property
    def hub_model_id(self) -> str | None:
        return self.args.hub_model_id

    def push_to_hub(self, commit_message: str | None = "End of training", **kwargs) -> str | None:
        """Save the final model to `output_dir` and upload it to `args.hub_model_id` (process 0).

        TRL's model-card keywords (`dataset_name`, `tags`, ...) go into the README's metadata."""
        from jaxrl.hub import push_folder

        self.save_model(self.args.output_dir)
        card_keys = ("model_name", "dataset_name", "tags")
        self.create_model_card(**{k: kwargs[k] for k in card_keys if k in kwargs})
        if not self.is_world_process_zero():
            return None
        return push_folder(self.args, self.args.output_dir, commit_message)

    def _push_from_checkpoint(self, step: int) -> None:
        """HF's `hub_strategy` at a save: "every_save" uploads the model (saved to `output_dir`),
        "checkpoint" also the checkpoint as `last-checkpoint/`, "all_checkpoints" each one as
        `checkpoint-STEP/`; "end" uploads nothing until `push_to_hub()`. Synchronous (HF pushes
        in the background), after the checkpoint's async write has finished."""
        from jaxrl import hub

        a = self.args
        if not hub.pushes_on_save(a.hub_strategy):
            return
        self.save_model(a.output_dir)  # a collective on multi-host: every process joins
        target = hub.checkpoint_path_in_repo(a.hub_strategy, step)
        if target is not None:
            self._checkpointer().wait_until_finished()
        if not self.is_world_process_zero():
            return
        message = f"Training in progress, step {step}"
        hub.push_folder(a, a.output_dir, message)
        if target is not None:
            folder = str(self._checkpointer().step_dir(step))
            hub.push_folder(a, folder, message, path_in_repo=target)

    def end(self) -> None:
        """Finish at the end of a script (HF `Trainer.end`): wait for checkpoint writes."""
        if getattr(self, "_ckpt", None) is not None:
            self._ckpt.wait_until_finished()


def _tokenizer_of(processing_class: Any) -> Any:
    """A processor's (`transformers.ProcessorMixin`) tokenizer, or the tokenizer itself."""
    from transformers import ProcessorMixin

    if isinstance(processing_class, ProcessorMixin):
        return processing_class.tokenizer
    return processing_class


def _refuse_images(dataset: Any, trainer: str) -> None:
    """Datasets with images are an error for trainers that would train on their text alone."""
    columns = getattr(dataset, "column_names", None) or []
    if isinstance(columns, dict):  # a DatasetDict
        columns = [c for names in columns.values() for c in names]
    found = sorted({"image", "images"} & set(columns))
    if found:
        raise ValueError(
            f"The dataset has {found[0]!r} column but {trainer} trains on text only in jaxrl "
            "(images would be ignored). Drop the column, or use SFTTrainer, DPOTrainer, "
            "GRPOTrainer or RLOOTrainer, which train image-text models (Gemma 3) on images."
        )


def _quantization_scheme(quantization_config: Any) -> str | None:
    """`lora.quantize_base`'s scheme for TRL's `quantization_config`: None, "int8", "nf4", or a
    transformers `BitsAndBytesConfig` (`load_in_8bit`, or `load_in_4bit` with NF4)."""
    from types import SimpleNamespace

    from jaxrl import lora

    if quantization_config is None or quantization_config in ("int8", "nf4"):
        return quantization_config
    if isinstance(quantization_config, str):
        raise ValueError(
            f"quantization_config={quantization_config!r}: use 'int8', 'nf4' or a "
            "transformers BitsAndBytesConfig."
        )
    q = quantization_config
    return lora.base_quantization(
        SimpleNamespace(
            load_in_8bit=getattr(q, "load_in_8bit", False),
            load_in_4bit=getattr(q, "load_in_4bit", False),
            bnb_4bit_quant_type=getattr(q, "bnb_4bit_quant_type", "nf4"),
            use_bnb_nested_quant=getattr(q, "bnb_4bit_use_double_quant", False),
        )
    )
