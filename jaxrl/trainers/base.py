"""Trainer shell shared by every algorithm: model and data setup, the loop, eval, checkpoints.

Algorithms subclass `Trainer` and provide four things: how to tokenize a dataset
(`_prepare_dataset`), how to collate examples into fixed-shape numpy arrays (`_collate`), the pure
loss function the generic step differentiates (`_loss_fn`), and optional extra state
(`_init_extras`, `_frozen_params`). `Trainer` is composed of one piece per concern, each a mixin
in its own module: the model, mesh and LoRA (`jaxrl.trainers.model_setup`), the tokenizer and
chat template (`tokenizer_setup`), row lengths and token counts (`lengths`), `evaluate` /
`predict` (`evaluation`), and `save_model`, the model card and the Hub (`export`). This file
holds what ties them together: the constructor, the train state, the jitted step with donation,
the offline iteration, checkpoints of LoRA runs and sampling from the policy. The loop
(one-step-late metrics, NaN stop, callbacks, orbax checkpoints with data position, SIGTERM save)
is `jaxrl.trainers.loop.TrainLoop`. This file must not contain algorithm math.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl import lora, parallel, run_dir
from jaxrl.algos import model_dropout, neftune, router_aux
from jaxrl.callbacks.base import TrainerCallback
from jaxrl.callbacks.bema import BEMACallback
from jaxrl.callbacks.sync_ref import SyncRefModelCallback
from jaxrl.config import TrainingConfig
from jaxrl.core import frozen as frozen_weights
from jaxrl.core import optim
from jaxrl.core.state import TrainState
from jaxrl.core.step import make_eval_step, make_train_step
from jaxrl.data.batching import BatchIterator
from jaxrl.data.loading import load_dataset_any
from jaxrl.generation import GenerationConfig, Sampler
from jaxrl.trainers.evaluation import EvalPrediction, EvaluationMixin
from jaxrl.trainers.export import ExportMixin
from jaxrl.trainers.lengths import LengthsMixin
from jaxrl.trainers.loop import TrainLoop
from jaxrl.trainers.model_setup import ModelSetupMixin, source_path
from jaxrl.trainers.tokenizer_setup import TokenizerSetupMixin
from jaxrl.trainers.unsupported import refuse as refuse_unsupported

logger = logging.getLogger("jaxrl")


class Trainer(
    ModelSetupMixin,
    TokenizerSetupMixin,
    LengthsMixin,
    EvaluationMixin,
    ExportMixin,
    TrainLoop,
):
    """Generic jaxrl language-model trainer; use an algorithm subclass (`SFTTrainer`,
    `DPOTrainer`, ...). The loop itself is `TrainLoop`'s; this class adds the model, tokenizer,
    datasets and the offline iteration (each concern's methods come from its mixin, see the
    module docstring)."""

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
        **unsupported: Any,
    ):
        refuse_unsupported(type(self).__name__, unsupported)
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
        self.model_path = source_path(model)
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

    # ----------------------------------------------------------------- data
    @staticmethod
    def _load_data(dataset: Any, split: str) -> Any:
        """A dataset object passes through; a path or hub id is loaded (a single file is the
        whole split)."""
        if not isinstance(dataset, str):
            return dataset
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
        syncs = any(isinstance(cb, SyncRefModelCallback) for cb in self.callback_handler.callbacks)
        narrower = jnp.dtype(self.compute_dtype).itemsize < jnp.dtype(self._param_dtype()).itemsize
        if syncs or not narrower:
            # TRL's reference sync mixes the policy into the reference in the params' dtype.
            return jax.tree.map(jnp.copy, params)
        probe = frozen_weights.lm_probe(self.graphdef)
        return frozen_weights.in_compute_dtype(probe, params, self.compute_dtype)

    def _score_span(self, sources: list) -> int | None:
        """The `score_span` the datasets in `sources` need (None: the whole row)."""
        return None

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

    # ----------------------------------------------------------------- the offline iteration
    def _has_train_data(self) -> bool:
        return self.train_dataset is not None

    def _has_eval_data(self) -> bool:
        return self.eval_dataset is not None

    def _ensure_state(self) -> None:
        if self.train_state is None:
            self.train_state = self._build_state()
            self._compile(self.train_state)

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

    # ----------------------------------------------------------------- generation
    def generation_config(self, generation_config: Any = None, **overrides: Any):
        """A `jaxrl.generation.GenerationConfig` from a transformers `GenerationConfig` (or ours,
        or None: the model directory's `generation_config.json` if any, else transformers'
        defaults), with the tokenizer's EOS and pad ids where the config gives none (the model's
        own config always pads with the tokenizer's pad, which TRL mirrors onto it)."""
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
            sample = sampler(params, ids, config, seed=seed + start, tokenizer=self.tokenizer)
            tokens, mask = jax.device_get((sample.completion_ids_BN, sample.completion_mask_BN))
            for row in range(n_real):
                kept = [int(t) for t, m in zip(tokens[row], mask[row], strict=True) if m]
                out.append(tok.decode(kept, skip_special_tokens=True))
        return out

    # ----------------------------------------------------------------- the model
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

    # ----------------------------------------------------------------- TRL script surface
    # What TRL's example scripts call on a trainer besides train()/save_model() (jaxrl.scripting).
    def _check_script_inputs(self, eval_dataset):
        # TRL's scripts set model_init_kwargs after the config is built: validate and map it now.
        self.args.resolve_model_init_kwargs()
        self.args.check_datasets(has_eval=eval_dataset is not None)

    def end(self) -> None:
        """Finish at the end of a script (HF `Trainer.end`): wait for checkpoint writes."""
        if getattr(self, "_ckpt", None) is not None:
            self._ckpt.wait_until_finished()


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
