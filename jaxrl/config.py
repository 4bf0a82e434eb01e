"""The shared base of jaxrl's training configs: `TrainingConfig` (HF `TrainingArguments` / TRL
field names) and `with_foreign`, the base-class builder of each trainer's config.

Every field here is honoured by the trainers; a TRL field we cannot honour is absent, or accepts
only the value we implement and rejects others with a clear message. Defaults
and semantics follow the installed `transformers` (v5) and `trl` versions unless a comment says
otherwise. The configs of each algorithm live beside its trainer (`jaxrl/trainers/*_config.py`),
the value sets and shared checks in `config_checks.py`, the YAML + CLI loader in `config_cli.py`.
This module only describes and validates a run: it never touches arrays or devices, and imports
nothing from models/, core/ or trainers/.
"""

import dataclasses
import importlib.util
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jaxrl import config_fields
from jaxrl.config_checks import (
    ATTN_IMPLEMENTATIONS,
    DTYPES,
    HUB_STRATEGIES,
    INPUT_TOKEN_COUNTS,
    LR_SCHEDULER_KWARGS,
    LR_SCHEDULERS,
    OPTIMIZERS,
    REMAT_POLICIES,
    REPORT_TO,
    SAVE_STRATEGIES,
    STRATEGIES,
    TRAIN_SAMPLING_STRATEGIES,
    WSD_SHAPES,
    check,
    check_choice,
    check_mesh_fields,
    check_steps,
)
from jaxrl.config_cli import ConfigError, coerce
from jaxrl.config_fields import Foreign
from jaxrl.loop_options import parse_resume_from_checkpoint

# HF/TRL fields with no JAX meaning: present with TRL's default, rejected when set (see
# config_fields.py). They form base classes so every TRL script and recipe parses.
_ForeignTrainingFields = dataclasses.make_dataclass(
    "_ForeignTrainingFields", config_fields.dataclass_fields(config_fields.TRAINING_ARGUMENTS)
)


@dataclass
class TrainingConfig(_ForeignTrainingFields):
    """Fields shared by all trainers; names and defaults follow HF TrainingArguments / TRL."""

    FOREIGN_FIELDS: typing.ClassVar[tuple[Foreign, ...]] = config_fields.TRAINING_ARGUMENTS

    output_dir: str = "trainer_output"
    # HF (v4) semantics: start afresh in an output_dir holding an earlier run, deleting its
    # checkpoints, metrics.jsonl and final/; without it (or resume_from_checkpoint) that is refused.
    overwrite_output_dir: bool = False
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    lr_scheduler_type: str = "linear"
    # Only `cosine_with_min_lr` takes kwargs: exactly one of {"min_lr", "min_lr_rate"} (HF).
    lr_scheduler_kwargs: dict | None = None
    # HF v5: an int is a step count, a float in [0, 1) is a ratio of the total training steps.
    warmup_steps: int | float = 0
    # Removed in HF v5; kept because many recipes still set it. Mutually exclusive with warmup_steps.
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch"
    num_train_epochs: float = 3.0
    max_steps: int = -1
    logging_steps: int | float = 10  # TRL default (HF: 500)
    logging_first_step: bool = False
    logging_strategy: str = "steps"  # "steps" | "epoch" | "no"
    eval_strategy: str = "no"
    eval_steps: int | float | None = None  # None -> logging_steps, as HF
    eval_on_start: bool = False  # HF: one evaluation before the first step (a baseline)
    # HF: no periodic evaluation before this many steps (eval_strategy "steps") or epochs
    # ("epoch"); eval_on_start is not delayed.
    eval_delay: float = 0.0
    save_strategy: str = "steps"
    save_steps: int | float = 500
    save_total_limit: int | None = None
    # Checkpoints without optimizer state and data position (not resumable), as HF.
    save_only_model: bool = False
    # HF: evaluate() and predict() compute the loss (and the trainer's metrics) only: no
    # predictions are gathered, `compute_metrics` is not called, predict() returns None for them.
    prediction_loss_only: bool = False
    # HF: what else `compute_metrics` gets besides predictions and labels: "inputs" (the rows'
    # input ids, `EvalPrediction.inputs`) and/or "loss" (each eval batch's loss once per example,
    # `EvalPrediction.losses`). SFT, reward and DPO.
    include_for_metrics: list[str] = field(default_factory=list)
    # HF: call `compute_metrics(EvalPrediction, compute_result=...)` on each eval batch (True on
    # the last one, whose return value is the metrics) instead of once on all predictions,
    # which evaluate() then does not keep.
    batch_eval_metrics: bool = False
    # HF: False hands `compute_metrics` and `predict()` one array per eval batch (a list, each
    # batch as wide as its own rows) instead of the batches concatenated (narrower ones padded
    # with -100 to the widest).
    eval_do_concat_batches: bool = True
    # HF moves the eval predictions gathered on the accelerator to the CPU every N batches (None:
    # at the end); the results never depend on it. jaxrl moves each batch's predictions to the
    # host as soon as it is evaluated, so nothing accumulates on the accelerator for any N.
    eval_accumulation_steps: int | None = None
    # HF: on resume, rebuild the `ExportableState` callbacks (e.g. `EarlyStoppingCallback`'s
    # patience counter) from the checkpoint's `stateful_callbacks`.
    restore_callback_states_from_checkpoint: bool = False
    # Keep the checkpoint with the best `metric_for_best_model` and load it when training ends.
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None  # None -> "loss" when needed (HF)
    greater_is_better: bool | None = None  # None -> not metric.endswith("loss") (HF)
    # HF: drop dataset columns the model does not read. The SFT/reward/DPO trainers tokenize each
    # example into the model's inputs and take no custom collator, so nothing could read another
    # column: they always drop them, and False (which would change nothing) is refused.
    remove_unused_columns: bool = True
    # Run on the CPU backend even when an accelerator is present.
    use_cpu: bool = False
    push_to_hub: bool = False
    hub_model_id: str | None = None  # None -> the name of output_dir
    hub_strategy: str = "every_save"
    hub_token: str | None = None
    hub_private_repo: bool | None = None
    hub_revision: str | None = None
    # Script flags HF's Trainer does not read either (kept so TRL/HF scripts parse).
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    seed: int = 42
    # HF: the seed of the training data order (None -> `seed`); model init and the step rngs
    # (NEFTune noise, LoRA dropout) keep following `seed`.
    data_seed: int | None = None
    # HF's training samplers: "random" (a seeded permutation per epoch), "sequential" (dataset
    # order) or "group_by_length" (HF's LengthGroupedSampler: each epoch's permutation cut into
    # megabatches of min(50, N // (4 * b)) * b examples, b = per_device_train_batch_size *
    # gradient_accumulation_steps, each sorted longest first, the longest example first of all).
    # Eval batches keep dataset order (HF 5.x also length-groups them, in an order drawn from
    # torch's RNG). "batch_rebalance" is rejected.
    train_sampling_strategy: str = "random"
    # HF: the train dataset column holding each example's length for "group_by_length" (used
    # while the prepared rows are the dataset's examples one to one); without it, the length of
    # each prepared row's `input_ids` (SFT), as HF computes it.
    length_column_name: str = "length"
    # NEFTune (https://arxiv.org/abs/2310.05914): in training forwards of the policy only, add
    # U(-m, m) noise with m = alpha / sqrt(T * hidden_size) to the token embeddings, T the length
    # TRL's collator pads the forward's per-device batch to (see jaxrl.algos.neftune). The
    # paper uses 5-15; None: off. SFT, reward and DPO trainers.
    neftune_noise_alpha: float | None = None
    # HF: also log `num_input_tokens_seen`, the training input tokens so far: "all" (every
    # position of TRL's padded batches) or "non_padding" (real tokens); True/False = "all"/"no".
    include_num_input_tokens_seen: str | bool = "no"
    bf16: bool | None = None  # TRL: None -> True unless fp16
    fp16: bool = False
    gradient_checkpointing: bool = True  # TRL default
    # HF v5's name for gradient_checkpointing; when set it wins, as in HF.
    activation_checkpointing: bool | None = None
    # Only {"use_reentrant": bool}: both torch variants compute the same gradients as
    # jax.checkpoint, so the key is accepted with no effect; anything else is rejected.
    gradient_checkpointing_kwargs: dict | str | None = None
    activation_checkpointing_kwargs: dict | str | None = None  # HF v5's name; wins when set
    # jaxrl averages the loss over all tokens of the global batch (every device): always True.
    average_tokens_across_devices: bool = True
    # Integrations besides the always-written metrics.jsonl; normalised to a list like HF.
    report_to: str | list[str] | None = "none"
    run_name: str | None = None
    # A checkpoint directory, or True / "latest" for the newest checkpoint under output_dir.
    resume_from_checkpoint: bool | str | None = None
    # TRL: kwargs for `from_pretrained`. "dtype" (or "torch_dtype") sets `param_dtype`;
    # "attn_implementation" maps onto jaxrl's XLA attention; "revision" may only be "main" and
    # "trust_remote_code" only false (jaxrl runs its own model code, never a checkpoint's).
    model_init_kwargs: dict | str | None = None
    # TRL: allow a checkpoint's own modelling code; jaxrl never runs it, so only False.
    trust_remote_code: bool = False
    disable_tqdm: bool = False
    # jaxrl: device mesh sizes; -1 takes the remaining devices (at most one axis may be -1).
    mesh_data: int = 1
    mesh_fsdp: int = -1
    mesh_tensor: int = 1
    # jaxrl: [[logical_name, mesh_axis | [mesh_axes] | null], ...]; None -> the model's defaults.
    logical_axis_rules: list | None = None
    # None -> False on GPU (unrolled layers: ~20% faster, ~25% less memory on an H100, see
    # BENCHMARKS.md), True elsewhere (lax.scan: a program whose size does not grow with depth).
    scan_layers: bool | None = None
    remat_policy: str | None = None  # None -> "full" if gradient_checkpointing else "none"
    # jaxrl: positions per log-prob chunk (the LM head runs `[B, chunk, V]` at a time). None =
    # per backend: 128 on CPU; on GPU/TPU the whole sequence while its logits fit 4 GiB (2**31
    # bf16 logits on GPU), else as many positions as fit (`jaxrl.core.logprobs.resolve_chunk_size`).
    logprob_chunk_size: int | None = None
    # TRL's `pad_to_multiple_of`: the run's static row length (the longest example) and the
    # `length_buckets` below it are rounded up to a multiple of this (e.g. 128 on TPU); None =
    # the longest example exactly.
    # TRL's default "auto" (128 on AWS Neuron, which jaxrl does not run on, else None) and its
    # CLI strings ("none", "null", "128") resolve as in TRL.
    pad_to_multiple_of: int | str | None = "auto"
    param_dtype: str = "float32"
    # jaxrl: dtype of the embeddings, residual stream and norms. None = torch autocast's (the
    # wider of param_dtype and the bf16/fp16 compute dtype: f32 under bf16=True, which is what
    # reproduces TRL's losses); "bfloat16" with bf16=True runs every activation in bf16 (less
    # activation memory and bandwidth on accelerators, not TRL's numbers).
    residual_dtype: str | None = None

    def __post_init__(self) -> None:
        check(bool(self.output_dir), "`output_dir` must be a non-empty path.")
        for name in (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
        ):
            check(getattr(self, name) >= 1, f"`{name}` must be >= 1; got {getattr(self, name)}.")
        check(
            self.logprob_chunk_size is None or self.logprob_chunk_size >= 1,
            f"`logprob_chunk_size` must be None or >= 1; got {self.logprob_chunk_size}.",
        )
        self._resolve_pad_to_multiple_of()
        check(
            self.pad_to_multiple_of is None or self.pad_to_multiple_of >= 1,
            f"`pad_to_multiple_of` must be None or >= 1; got {self.pad_to_multiple_of}.",
        )
        check(
            math.isfinite(self.learning_rate) and self.learning_rate >= 0,
            f"`learning_rate` must be a finite number >= 0; got {self.learning_rate}.",
        )
        violations = config_fields.unset_violations(self, self._all_foreign_fields())
        check(not violations, " ".join(violations))
        self._validate_eval_metrics()
        self._validate_schedule()
        check(self.weight_decay >= 0, f"`weight_decay` must be >= 0; got {self.weight_decay}.")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            check(0.0 <= value < 1.0, f"`{name}` must be in [0, 1); got {value}.")
        check(self.adam_epsilon >= 0, f"`adam_epsilon` must be >= 0; got {self.adam_epsilon}.")
        check(
            self.max_grad_norm >= 0,
            f"`max_grad_norm` must be >= 0 (0 disables clipping); got {self.max_grad_norm}.",
        )
        check(
            not any(tag in self.optim for tag in ("8bit", "paged", "bnb", "4bit")),
            f"`optim={self.optim!r}` keeps quantized (bitsandbytes) optimizer state, which optax "
            "does not have; use 'adamw_torch' (32-bit state) or pass your own optax chain via "
            "`optimizers=(tx, None)`.",
        )
        check_choice("optim", self.optim, OPTIMIZERS)
        check(
            self.num_train_epochs > 0,
            f"`num_train_epochs` must be > 0; got {self.num_train_epochs}.",
        )
        check(
            self.max_steps == -1 or self.max_steps > 0,
            f"`max_steps` must be -1 (use num_train_epochs) or > 0; got {self.max_steps}.",
        )
        self._validate_intervals()
        self._validate_sampling()
        check(
            self.save_total_limit is None or self.save_total_limit >= 1,
            f"`save_total_limit` must be None (keep all) or >= 1; got {self.save_total_limit}.",
        )
        self._validate_best_model()
        self._validate_hub()
        check(
            self.remove_unused_columns or self._keeps_unused_columns,
            "`remove_unused_columns=False` would change nothing here: this trainer tokenizes each "
            "example into the model's inputs and takes no custom data collator, so no step can "
            "read the other columns (they are always dropped, HF's default True). Remove the "
            "setting; to score with extra columns use GRPO/RLOO, whose reward functions get them.",
        )
        self._validate_checkpointing()
        check(
            self.average_tokens_across_devices,
            "`average_tokens_across_devices=False` is not supported: jaxrl always averages the loss "
            "over every token of the global batch, so the loss does not change with the device "
            "count; remove the setting.",
        )
        if self.bf16 is None:
            self.bf16 = not self.fp16
        check(not (self.bf16 and self.fp16), "Set at most one of `bf16` and `fp16` to true.")
        self.report_to = self._normalise_report_to(self.report_to)
        self.resume_from_checkpoint = parse_resume_from_checkpoint(self.resume_from_checkpoint)
        self.resolve_model_init_kwargs()
        self._validate_mesh()
        if self.remat_policy is None:
            self.remat_policy = "full" if self.gradient_checkpointing else "none"
        check_choice("remat_policy", self.remat_policy, REMAT_POLICIES)

    def _validate_eval_metrics(self) -> None:
        value = self.include_for_metrics
        if isinstance(value, str):  # one name (HF's `"loss" in value` test reads it so too)
            value = [value]
        check(
            isinstance(value, list | tuple) and all(v in ("inputs", "loss") for v in value),
            f"`include_for_metrics={value!r}` must be a list of 'inputs' and/or 'loss' (HF's "
            "options; HF ignores any other name).",
        )
        self.include_for_metrics = list(value)
        steps = self.eval_accumulation_steps
        check(
            steps is None
            or (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1),
            f"`eval_accumulation_steps={steps!r}` must be None or an integer >= 1.",
        )

    def _resolve_pad_to_multiple_of(self) -> None:
        """TRL's spellings: "auto" (None off AWS Neuron, which jaxrl never runs on), "none" /
        "null" (None) and an integer string (the CLI's)."""
        value = self.pad_to_multiple_of
        if not isinstance(value, str):
            return
        if value == "auto" or value.lower() in ("none", "null"):
            self.pad_to_multiple_of = None
            return
        try:
            self.pad_to_multiple_of = int(value)
        except ValueError:
            raise ConfigError(
                f"`pad_to_multiple_of` must be an integer >= 1, None or 'auto'; got {value!r}."
            ) from None

    def _validate_schedule(self) -> None:
        check_choice("lr_scheduler_type", self.lr_scheduler_type, LR_SCHEDULERS)
        name = self.lr_scheduler_type
        if isinstance(self.lr_scheduler_kwargs, str):  # HF: a JSON string from the command line
            self.lr_scheduler_kwargs = coerce(
                "lr_scheduler_kwargs", self.lr_scheduler_kwargs, dict
            )
        kwargs = self.lr_scheduler_kwargs or {}
        unknown = sorted(set(kwargs) - set(LR_SCHEDULER_KWARGS[name]))
        check(
            not unknown,
            f"`lr_scheduler_kwargs` keys {unknown} do not apply to `lr_scheduler_type={name!r}`; it "
            f"takes {list(LR_SCHEDULER_KWARGS[name]) or 'none'}.",
        )
        for key, value in kwargs.items():
            if key not in ("warmup_type", "decay_type"):
                check(
                    isinstance(value, int | float) and not isinstance(value, bool) and value >= 0,
                    f"`lr_scheduler_kwargs[{key!r}]` must be a number >= 0; got {value!r}.",
                )
            else:
                check_choice(f"lr_scheduler_kwargs[{key!r}]", value, WSD_SHAPES)
        if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
            check(
                len({"min_lr", "min_lr_rate"} & set(kwargs)) == 1,
                f"`lr_scheduler_type={name!r}` needs `lr_scheduler_kwargs` with exactly one of "
                f"'min_lr' or 'min_lr_rate'; got {kwargs}.",
            )
        if name == "warmup_stable_decay":
            check(
                "num_decay_steps" in kwargs,
                "`lr_scheduler_type='warmup_stable_decay'` needs `lr_scheduler_kwargs` with "
                "'num_decay_steps' (and optionally 'num_stable_steps'; by default the rest of the "
                "run after warmup and decay).",
            )
        if name == "polynomial":
            check(
                kwargs.get("lr_end", 1e-7) < self.learning_rate,
                f"`lr_scheduler_kwargs['lr_end']` ({kwargs.get('lr_end', 1e-7)}) must be smaller "
                f"than `learning_rate` ({self.learning_rate}) for 'polynomial'.",
            )
        check(self.warmup_steps >= 0, f"`warmup_steps` must be >= 0; got {self.warmup_steps}.")
        if self.warmup_steps >= 1:
            check(
                float(self.warmup_steps).is_integer(),
                f"`warmup_steps` must be an integer when >= 1 (or a ratio in [0, 1)); got "
                f"{self.warmup_steps}.",
            )
            self.warmup_steps = int(self.warmup_steps)
        check(
            0.0 <= self.warmup_ratio < 1.0,
            f"`warmup_ratio` must be in [0, 1); got {self.warmup_ratio}.",
        )
        check(
            not (self.warmup_ratio > 0 and self.warmup_steps > 0),
            "Set only one of `warmup_steps` and `warmup_ratio` (HF v5 prefers warmup_steps, "
            "where a float < 1 is a ratio).",
        )

    @classmethod
    def _all_foreign_fields(cls) -> tuple[Foreign, ...]:
        """Foreign fields of this class and its bases (each class lists only its own), less
        those a subclass implements (its `IMPLEMENTED_FIELDS`)."""
        seen: dict[str, Foreign] = {}
        for klass in reversed(cls.__mro__):
            for f in klass.__dict__.get("FOREIGN_FIELDS", ()):
                seen[f.name] = f
            for name in klass.__dict__.get("IMPLEMENTED_FIELDS", ()):
                seen.pop(name, None)
        return tuple(seen.values())

    def _validate_best_model(self) -> None:
        # HF TrainingArguments.__post_init__ rules, same order and defaults.
        if (self.load_best_model_at_end or self.save_strategy == "best") and (
            self.metric_for_best_model is None
        ):
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.save_strategy == "best" or self.load_best_model_at_end:
            check(
                self.eval_strategy != "no",
                f"`{'save_strategy=best' if self.save_strategy == 'best' else 'load_best_model_at_end'}`"
                " compares evaluation metrics, so it needs `eval_strategy` 'steps' or 'epoch' (and "
                "an eval_dataset).",
            )
        if not self.load_best_model_at_end or self.save_strategy == "best":
            return
        check(
            self.eval_strategy == self.save_strategy,
            "`load_best_model_at_end=True` needs `save_strategy` equal to `eval_strategy` (or "
            f"`save_strategy='best'`); got eval_strategy={self.eval_strategy!r}, "
            f"save_strategy={self.save_strategy!r}.",
        )
        if self.eval_strategy == "steps":
            ratio = isinstance(self.eval_steps, float) or isinstance(self.save_steps, float)
            check(
                not ratio and self.save_steps % self.eval_steps == 0,
                "`load_best_model_at_end=True` needs `save_steps` to be a multiple of `eval_steps` "
                f"(every saved step is also evaluated); got save_steps={self.save_steps}, "
                f"eval_steps={self.eval_steps}.",
            )

    # Whether this config's trainer reads dataset columns besides those it tokenizes (the
    # on-policy trainers pass them to reward functions), so `remove_unused_columns` matters.
    _keeps_unused_columns: typing.ClassVar[bool] = False

    def _validate_hub(self) -> None:
        check_choice("hub_strategy", self.hub_strategy, HUB_STRATEGIES)
        if self.push_to_hub and self.hub_model_id is None:
            self.hub_model_id = Path(self.output_dir).name  # HF: the output_dir's name

    def _validate_checkpointing(self) -> None:
        if self.activation_checkpointing is not None:
            self.gradient_checkpointing = self.activation_checkpointing
        self.activation_checkpointing = self.gradient_checkpointing
        if self.activation_checkpointing_kwargs is not None:
            self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs
        kwargs = self.gradient_checkpointing_kwargs
        if isinstance(kwargs, str):
            kwargs = coerce("gradient_checkpointing_kwargs", kwargs, dict)
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - {"use_reentrant"})
        check(
            not unknown,
            f"`gradient_checkpointing_kwargs` keys {unknown} have no JAX meaning; only "
            "'use_reentrant' is accepted (it does not change the gradients). Choose what is "
            "saved with `remat_policy` instead.",
        )
        self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs = kwargs or None

    def check_datasets(self, *, has_eval: bool) -> None:
        """Trainer-construction checks that need to know which datasets were given."""
        # As HF's Trainer: a periodic eval needs a dataset (eval_on_start alone is skipped).
        check(
            has_eval or self.eval_strategy == "no",
            f"`eval_strategy={self.eval_strategy!r}` needs an `eval_dataset`, but "
            "none was given (for `python -m jaxrl.train`: `--dataset_test_split` names a split "
            "the dataset lacks). Pass an eval dataset or set `eval_strategy='no'`.",
        )

    def _validate_intervals(self) -> None:
        check_choice("eval_strategy", self.eval_strategy, STRATEGIES)
        check_choice("save_strategy", self.save_strategy, SAVE_STRATEGIES)
        check_choice("logging_strategy", self.logging_strategy, STRATEGIES)
        self.logging_steps = check_steps("logging_steps", self.logging_steps)
        if self.eval_steps is None:
            self.eval_steps = self.logging_steps
        self.eval_steps = check_steps("eval_steps", self.eval_steps)
        self.save_steps = check_steps("save_steps", self.save_steps)

    def _validate_sampling(self) -> None:
        """HF's data-order, NEFTune and token-count fields."""
        check(
            math.isfinite(self.eval_delay) and self.eval_delay >= 0,
            f"`eval_delay` must be a number >= 0 (steps or epochs); got {self.eval_delay}.",
        )
        check(
            self.train_sampling_strategy != "batch_rebalance",
            "`train_sampling_strategy='batch_rebalance'` is not supported: HF's "
            "BatchRebalanceSampler gives micro-batches of different sizes, but a jaxrl step "
            "compiles one batch shape (all its micro-batches and devices padded to one row "
            "length, so there is no per-device padding cost to rebalance); use 'random' or "
            "'group_by_length' (whose similar lengths per step pick shorter `length_buckets`).",
        )
        check_choice(
            "train_sampling_strategy", self.train_sampling_strategy, TRAIN_SAMPLING_STRATEGIES
        )
        check(bool(self.length_column_name), "`length_column_name` must be a column name.")
        check(
            self.neftune_noise_alpha is None
            or (math.isfinite(self.neftune_noise_alpha) and self.neftune_noise_alpha >= 0),
            f"`neftune_noise_alpha` must be None or a number >= 0 (the paper uses 5-15); got "
            f"{self.neftune_noise_alpha}.",
        )
        seen = self.include_num_input_tokens_seen
        if isinstance(seen, str) and seen.lower() in ("true", "false"):  # a CLI boolean
            seen = seen.lower() == "true"
        if isinstance(seen, bool):  # HF: True -> "all", False -> "no"
            seen = "all" if seen else "no"
        check_choice("include_num_input_tokens_seen", seen, INPUT_TOKEN_COUNTS)
        self.include_num_input_tokens_seen = seen

    @staticmethod
    def _normalise_report_to(report_to: str | list[str] | None) -> list[str]:
        if report_to is None:
            return []
        names = report_to.split(",") if isinstance(report_to, str) else list(report_to)
        names = [name.strip() for name in names if name.strip()]
        for name in names:
            check_choice("report_to", name, REPORT_TO)
        if "all" in names:
            # HF: "all" means every installed integration we support.
            modules = {"wandb": "wandb", "tensorboard": "tensorboardX"}
            return [n for n, m in modules.items() if importlib.util.find_spec(m) is not None]
        return [name for name in names if name != "none"]

    def resolve_model_init_kwargs(self) -> None:
        """Validate `model_init_kwargs` and map it onto jaxrl fields (idempotent).

        TRL's scripts fill `model_init_kwargs` after the config is built, so trainers call this
        again at construction."""
        check_choice("param_dtype", self.param_dtype, DTYPES)
        if self.residual_dtype is not None:
            check_choice("residual_dtype", self.residual_dtype, DTYPES)
        check(
            not self.trust_remote_code,
            "`trust_remote_code=True` is not supported: jaxrl runs its own JAX implementation of "
            "each model family and never a checkpoint's Python code; remove the setting.",
        )
        kwargs = self.model_init_kwargs
        if isinstance(kwargs, str):
            kwargs = coerce("model_init_kwargs", kwargs, dict)
        kwargs = {k: v for k, v in dict(kwargs or {}).items() if v is not None}
        if "torch_dtype" in kwargs:
            check(
                "dtype" not in kwargs, "`model_init_kwargs` sets both 'dtype' and 'torch_dtype'."
            )
            kwargs["dtype"] = kwargs.pop("torch_dtype")
        check(
            kwargs.get("revision", "main") == "main",
            f"`model_init_kwargs['revision']={kwargs.get('revision')!r}` (`--model_revision`) is "
            "not supported: jaxrl loads a local directory or the hub's main revision; download "
            "the revision yourself and pass its path.",
        )
        check(
            not kwargs.get("trust_remote_code", False),
            "`trust_remote_code=True` is not supported: jaxrl runs its own JAX implementation of "
            "each model family and never a checkpoint's Python code; remove the setting.",
        )
        attn = kwargs.get("attn_implementation")
        check(
            attn is None or attn in ATTN_IMPLEMENTATIONS,
            f"`attn_implementation={attn!r}` has no JAX counterpart; jaxrl's XLA attention "
            f"computes exact softmax attention, which {list(ATTN_IMPLEMENTATIONS)} all map to.",
        )
        unknown = sorted(
            set(kwargs) - {"dtype", "revision", "trust_remote_code", "attn_implementation"}
        )
        check(
            not unknown,
            f"`model_init_kwargs` keys {unknown} are not supported; jaxrl honours 'dtype' (or "
            "'torch_dtype'), 'attn_implementation', 'revision' ('main') and 'trust_remote_code' "
            "(false).",
        )
        check(
            kwargs.get("dtype") != "auto",
            "`dtype='auto'` is not supported: give the parameter dtype explicitly "
            "(`--dtype bfloat16` or `--param_dtype bfloat16`).",
        )
        if "dtype" in kwargs:
            dtype = str(kwargs["dtype"]).removeprefix("torch.")
            check_choice("model_init_kwargs['dtype']", dtype, DTYPES)
            check(
                self.param_dtype in ("float32", dtype),
                f"`model_init_kwargs['dtype']={dtype!r}` conflicts with "
                f"`param_dtype={self.param_dtype!r}`; set only one.",
            )
            self.param_dtype = dtype
            kwargs["dtype"] = dtype
        self.model_init_kwargs = kwargs or None

    def _validate_mesh(self) -> None:
        check_mesh_fields(self)

    @property
    def optax_optimizer(self) -> str:
        """The optax optimizer `optim` maps to: "adamw", "sgd", "adafactor" or "lion"."""
        return OPTIMIZERS[self.optim]

    @property
    def compute_dtype(self) -> str:
        """Matmul dtype implied by bf16/fp16 (autocast: params stay in `param_dtype`, the residual
        stream in the wider of the two)."""
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warmup steps for a run of `num_training_steps` (HF v5 rule; warmup_ratio as fallback)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        ratio = self.warmup_steps or self.warmup_ratio
        return math.ceil(num_training_steps * ratio)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of all fields (JSON/YAML-serialisable)."""
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | Path | None = None) -> str:
        """YAML text of `to_dict()`; also written to `path` when given (e.g. output_dir/config.yaml)."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        return text


def with_foreign(name: str, fields: tuple[Foreign, ...]) -> type:
    """A `TrainingConfig` subclass holding a trainer config's foreign `fields` (TRL fields with
    no JAX meaning, see config_fields.py): the base class of `SFTConfig`, `DPOConfig`, ..."""
    return dataclasses.make_dataclass(
        name, config_fields.dataclass_fields(fields), bases=(TrainingConfig,)
    )

