"""Training configs with HF `TrainingArguments` / TRL field names, plus the YAML + CLI loader.

Every field here is honoured by the trainers; a TRL field we cannot honour is absent, or accepts
only the value we implement and rejects others with a clear message. Defaults
and semantics follow the installed `transformers` (v5) and `trl` versions unless a comment says
otherwise. This module only describes and validates a run: it never touches arrays or devices.
"""

import dataclasses
import difflib
import importlib.util
import json
import math
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jaxrl import config_fields
from jaxrl.config_fields import Foreign


class ConfigError(ValueError):
    """A config key or value the user supplied is invalid; the message names the fix."""


# HF optimizer names we accept -> the optax optimizer the trainer builds. The torch variants
# (fused, xla, npu, apex) differ only in kernels, so they map to the same update rule. HF's 8-bit
# and paged optimizers (bitsandbytes) keep quantized state; optax has no such state, so they are
# rejected rather than run silently in 32 bits.
OPTIMIZERS = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_torch_xla": "adamw",
    "adamw_torch_npu_fused": "adamw",
    "adamw_apex_fused": "adamw",
    "adamw": "adamw",
    "sgd": "sgd",
    "adagrad": "adagrad",
    "rmsprop": "rmsprop",
    "adafactor": "adafactor",
    "lion_32bit": "lion",
    "lion": "lion",
}
# Every HF scheduler with a closed form in the step count (transformers.optimization).
LR_SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
)
# The lr_scheduler_kwargs each scheduler accepts (HF's keyword names; defaults live in optim.py).
LR_SCHEDULER_KWARGS: dict[str, tuple[str, ...]] = {
    "linear": (),
    "cosine": ("num_cycles",),
    "cosine_with_restarts": ("num_cycles",),
    "polynomial": ("lr_end", "power"),
    "constant": (),
    "constant_with_warmup": (),
    "inverse_sqrt": ("timescale",),
    "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate"),
    "cosine_warmup_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"),
    "warmup_stable_decay": (
        "num_decay_steps",
        "num_stable_steps",
        "warmup_type",
        "decay_type",
        "min_lr_ratio",
        "num_cycles",
    ),
}
WSD_SHAPES = ("linear", "cosine", "1-sqrt")
STRATEGIES = ("no", "steps", "epoch")
# HF's train_sampling_strategy values jaxrl implements ("batch_rebalance" is rejected).
TRAIN_SAMPLING_STRATEGIES = ("random", "sequential", "group_by_length")
INPUT_TOKEN_COUNTS = ("all", "non_padding", "no")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")
HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
REPORT_TO = ("none", "all", "wandb", "tensorboard")
# Attention implementations TRL scripts name: all compute exact softmax attention, which is what
# jaxrl's XLA attention computes, so they map to it (no kernel choice exists on JAX).
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
DTYPES = ("float32", "bfloat16", "float16")
# Must equal jaxrl.models.config.REMAT_POLICIES (kept here so configs import without JAX).
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
MESH_AXES = ("data", "fsdp", "tensor")
PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")
TRUNCATION_MODES = ("keep_start", "keep_end")
# TRL DPOTrainer's `loss_type` values (trl/trainer/dpo_trainer.py); equal to
# jaxrl.losses.dpo.LOSS_TYPES.
DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
# TRL's `f_divergence_type` values and the loss types that accept a non-default one (equal to
# jaxrl.losses.dpo.F_DIVERGENCE_TYPES / F_DIVERGENCE_LOSS_TYPES).
DPO_F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
DPO_F_DIVERGENCE_LOSS_TYPES = (
    "sigmoid",
    "sigmoid_norm",
    "hinge",
    "ipo",
    "exo_pair",
    "robust",
    "discopop",
    "sft",
)
REF_MODEL_QUANTIZATIONS = ("int8",)
SFT_LOSS_TYPES = ("nll", "dft")  # equal to jaxrl.losses.sft.SFT_LOSS_TYPES


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_choice(name: str, value: Any, choices: typing.Iterable[Any]) -> None:
    choices = tuple(choices)
    _check(value in choices, f"`{name}={value!r}` is not valid; choose one of {list(choices)}.")


def _check_steps(name: str, value: float) -> float | int:
    """HF semantics: a step count, or a float in (0, 1) meaning a ratio of the total steps."""
    _check(value > 0, f"`{name}` must be > 0 (a step count, or a ratio in (0, 1)); got {value}.")
    if value >= 1:
        _check(
            float(value).is_integer(),
            f"`{name}` must be an integer when >= 1 (or a ratio in (0, 1)); got {value}.",
        )
        return int(value)
    return value


def check_mesh_fields(config: Any) -> None:
    """Check a config's `mesh_data`/`mesh_fsdp`/`mesh_tensor` and normalise its
    `logical_axis_rules` to [name, axis | [axes] | None] lists (shared by every trainer config)."""
    sizes = {name: getattr(config, name) for name in ("mesh_data", "mesh_fsdp", "mesh_tensor")}
    for name, size in sizes.items():
        _check(size == -1 or size >= 1, f"`{name}` must be -1 or >= 1; got {size}.")
    _check(
        list(sizes.values()).count(-1) <= 1,
        f"At most one of {list(sizes)} may be -1 (take the remaining devices); got {sizes}.",
    )
    if config.logical_axis_rules is None:
        return
    rules = []
    for rule in config.logical_axis_rules:
        _check(
            isinstance(rule, list | tuple) and len(rule) == 2 and isinstance(rule[0], str),
            "`logical_axis_rules` entries must be [logical_name, mesh_axis | [mesh_axes] | "
            f"null]; got {rule!r}.",
        )
        name, axes = rule
        for axis in axes if isinstance(axes, list | tuple) else [axes]:
            _check(
                axis is None or axis in MESH_AXES,
                f"`logical_axis_rules` maps {name!r} to unknown mesh axis {axis!r}; "
                f"choose from {list(MESH_AXES)} or null.",
            )
        rules.append([name, list(axes) if isinstance(axes, list | tuple) else axes])
    config.logical_axis_rules = rules


# HF/TRL fields with no JAX meaning: present with TRL's default, rejected when set (see
# config_fields.py). They form base classes so every TRL script and recipe parses.
_ForeignTrainingFields = dataclasses.make_dataclass(
    "_ForeignTrainingFields", config_fields.dataclass_fields(config_fields.TRAINING_ARGUMENTS)
)


def _resolve_length_buckets(config: Any) -> None:
    """Normalise and check a config's `length_buckets` (SFT, reward, DPO): "auto", None (one
    static length; also "none"/"off" and an empty list) or strictly increasing lengths >= 1,
    each a multiple of `pad_to_multiple_of` when that is set."""
    value = config.length_buckets
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            config.length_buckets = "auto"
            return
        if text in ("none", "null", "off", ""):
            config.length_buckets = None
            return
        try:
            value = [int(v) for v in text.strip("[]").split(",")]
        except ValueError:
            raise ConfigError(
                f"`length_buckets` must be 'auto', None (one static row length) or a list of "
                f"row lengths such as [256, 512, 1024]; got {config.length_buckets!r}."
            ) from None
    if value is None or len(value) == 0:
        config.length_buckets = None
        return
    _check(
        isinstance(value, list | tuple)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value),
        f"`length_buckets` must be 'auto', None or a list of integer row lengths >= 1; got "
        f"{value!r}.",
    )
    value = list(value)
    _check(
        all(a < b for a, b in zip(value, value[1:], strict=False)),
        f"`length_buckets` must be strictly increasing (each length once); got {value}. "
        f"Did you mean {sorted(set(value))}?",
    )
    m = config.pad_to_multiple_of
    off = [v for v in value if m and v % m]
    _check(
        not off,
        f"`length_buckets` {off} are not multiples of `pad_to_multiple_of={m}`, which every "
        f"padded row length must be; use e.g. {[-(-v // m) * m for v in off]}.",
    )
    config.length_buckets = value


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
        _check(bool(self.output_dir), "`output_dir` must be a non-empty path.")
        for name in (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
        ):
            _check(getattr(self, name) >= 1, f"`{name}` must be >= 1; got {getattr(self, name)}.")
        _check(
            self.logprob_chunk_size is None or self.logprob_chunk_size >= 1,
            f"`logprob_chunk_size` must be None or >= 1; got {self.logprob_chunk_size}.",
        )
        self._resolve_pad_to_multiple_of()
        _check(
            self.pad_to_multiple_of is None or self.pad_to_multiple_of >= 1,
            f"`pad_to_multiple_of` must be None or >= 1; got {self.pad_to_multiple_of}.",
        )
        _check(
            math.isfinite(self.learning_rate) and self.learning_rate >= 0,
            f"`learning_rate` must be a finite number >= 0; got {self.learning_rate}.",
        )
        violations = config_fields.unset_violations(self, self._all_foreign_fields())
        _check(not violations, " ".join(violations))
        self._validate_eval_metrics()
        self._validate_schedule()
        _check(self.weight_decay >= 0, f"`weight_decay` must be >= 0; got {self.weight_decay}.")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            _check(0.0 <= value < 1.0, f"`{name}` must be in [0, 1); got {value}.")
        _check(self.adam_epsilon >= 0, f"`adam_epsilon` must be >= 0; got {self.adam_epsilon}.")
        _check(
            self.max_grad_norm >= 0,
            f"`max_grad_norm` must be >= 0 (0 disables clipping); got {self.max_grad_norm}.",
        )
        _check(
            not any(tag in self.optim for tag in ("8bit", "paged", "bnb", "4bit")),
            f"`optim={self.optim!r}` keeps quantized (bitsandbytes) optimizer state, which optax "
            "does not have; use 'adamw_torch' (32-bit state) or pass your own optax chain via "
            "`optimizers=(tx, None)`.",
        )
        _check_choice("optim", self.optim, OPTIMIZERS)
        _check(
            self.num_train_epochs > 0,
            f"`num_train_epochs` must be > 0; got {self.num_train_epochs}.",
        )
        _check(
            self.max_steps == -1 or self.max_steps > 0,
            f"`max_steps` must be -1 (use num_train_epochs) or > 0; got {self.max_steps}.",
        )
        self._validate_intervals()
        self._validate_sampling()
        _check(
            self.save_total_limit is None or self.save_total_limit >= 1,
            f"`save_total_limit` must be None (keep all) or >= 1; got {self.save_total_limit}.",
        )
        self._validate_best_model()
        self._validate_hub()
        _check(
            self.remove_unused_columns or self._keeps_unused_columns,
            "`remove_unused_columns=False` would change nothing here: this trainer tokenizes each "
            "example into the model's inputs and takes no custom data collator, so no step can "
            "read the other columns (they are always dropped, HF's default True). Remove the "
            "setting; to score with extra columns use GRPO/RLOO, whose reward functions get them.",
        )
        self._validate_checkpointing()
        _check(
            self.average_tokens_across_devices,
            "`average_tokens_across_devices=False` is not supported: jaxrl always averages the loss "
            "over every token of the global batch, so the loss does not change with the device "
            "count; remove the setting.",
        )
        if self.bf16 is None:
            self.bf16 = not self.fp16
        _check(not (self.bf16 and self.fp16), "Set at most one of `bf16` and `fp16` to true.")
        self.report_to = self._normalise_report_to(self.report_to)
        if self.resume_from_checkpoint in ("latest", False):
            self.resume_from_checkpoint = True if self.resume_from_checkpoint else None
        self.resolve_model_init_kwargs()
        self._validate_mesh()
        if self.remat_policy is None:
            self.remat_policy = "full" if self.gradient_checkpointing else "none"
        _check_choice("remat_policy", self.remat_policy, REMAT_POLICIES)

    def _validate_eval_metrics(self) -> None:
        value = self.include_for_metrics
        if isinstance(value, str):  # one name (HF's `"loss" in value` test reads it so too)
            value = [value]
        _check(
            isinstance(value, list | tuple) and all(v in ("inputs", "loss") for v in value),
            f"`include_for_metrics={value!r}` must be a list of 'inputs' and/or 'loss' (HF's "
            "options; HF ignores any other name).",
        )
        self.include_for_metrics = list(value)
        steps = self.eval_accumulation_steps
        _check(
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
        _check_choice("lr_scheduler_type", self.lr_scheduler_type, LR_SCHEDULERS)
        name = self.lr_scheduler_type
        if isinstance(self.lr_scheduler_kwargs, str):  # HF: a JSON string from the command line
            self.lr_scheduler_kwargs = _coerce(
                "lr_scheduler_kwargs", self.lr_scheduler_kwargs, dict
            )
        kwargs = self.lr_scheduler_kwargs or {}
        unknown = sorted(set(kwargs) - set(LR_SCHEDULER_KWARGS[name]))
        _check(
            not unknown,
            f"`lr_scheduler_kwargs` keys {unknown} do not apply to `lr_scheduler_type={name!r}`; it "
            f"takes {list(LR_SCHEDULER_KWARGS[name]) or 'none'}.",
        )
        for key, value in kwargs.items():
            if key not in ("warmup_type", "decay_type"):
                _check(
                    isinstance(value, int | float) and not isinstance(value, bool) and value >= 0,
                    f"`lr_scheduler_kwargs[{key!r}]` must be a number >= 0; got {value!r}.",
                )
            else:
                _check_choice(f"lr_scheduler_kwargs[{key!r}]", value, WSD_SHAPES)
        if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
            _check(
                len({"min_lr", "min_lr_rate"} & set(kwargs)) == 1,
                f"`lr_scheduler_type={name!r}` needs `lr_scheduler_kwargs` with exactly one of "
                f"'min_lr' or 'min_lr_rate'; got {kwargs}.",
            )
        if name == "warmup_stable_decay":
            _check(
                "num_decay_steps" in kwargs,
                "`lr_scheduler_type='warmup_stable_decay'` needs `lr_scheduler_kwargs` with "
                "'num_decay_steps' (and optionally 'num_stable_steps'; by default the rest of the "
                "run after warmup and decay).",
            )
        if name == "polynomial":
            _check(
                kwargs.get("lr_end", 1e-7) < self.learning_rate,
                f"`lr_scheduler_kwargs['lr_end']` ({kwargs.get('lr_end', 1e-7)}) must be smaller "
                f"than `learning_rate` ({self.learning_rate}) for 'polynomial'.",
            )
        _check(self.warmup_steps >= 0, f"`warmup_steps` must be >= 0; got {self.warmup_steps}.")
        if self.warmup_steps >= 1:
            _check(
                float(self.warmup_steps).is_integer(),
                f"`warmup_steps` must be an integer when >= 1 (or a ratio in [0, 1)); got "
                f"{self.warmup_steps}.",
            )
            self.warmup_steps = int(self.warmup_steps)
        _check(
            0.0 <= self.warmup_ratio < 1.0,
            f"`warmup_ratio` must be in [0, 1); got {self.warmup_ratio}.",
        )
        _check(
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
            _check(
                self.eval_strategy != "no",
                f"`{'save_strategy=best' if self.save_strategy == 'best' else 'load_best_model_at_end'}`"
                " compares evaluation metrics, so it needs `eval_strategy` 'steps' or 'epoch' (and "
                "an eval_dataset).",
            )
        if not self.load_best_model_at_end or self.save_strategy == "best":
            return
        _check(
            self.eval_strategy == self.save_strategy,
            "`load_best_model_at_end=True` needs `save_strategy` equal to `eval_strategy` (or "
            f"`save_strategy='best'`); got eval_strategy={self.eval_strategy!r}, "
            f"save_strategy={self.save_strategy!r}.",
        )
        if self.eval_strategy == "steps":
            ratio = isinstance(self.eval_steps, float) or isinstance(self.save_steps, float)
            _check(
                not ratio and self.save_steps % self.eval_steps == 0,
                "`load_best_model_at_end=True` needs `save_steps` to be a multiple of `eval_steps` "
                f"(every saved step is also evaluated); got save_steps={self.save_steps}, "
                f"eval_steps={self.eval_steps}.",
            )

    # Whether this config's trainer reads dataset columns besides those it tokenizes (the
    # on-policy trainers pass them to reward functions), so `remove_unused_columns` matters.
    _keeps_unused_columns: typing.ClassVar[bool] = False

    def _validate_hub(self) -> None:
        _check_choice("hub_strategy", self.hub_strategy, HUB_STRATEGIES)
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
            kwargs = _coerce("gradient_checkpointing_kwargs", kwargs, dict)
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - {"use_reentrant"})
        _check(
            not unknown,
            f"`gradient_checkpointing_kwargs` keys {unknown} have no JAX meaning; only "
            "'use_reentrant' is accepted (it does not change the gradients). Choose what is "
            "saved with `remat_policy` instead.",
        )
        self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs = kwargs or None

    def check_datasets(self, *, has_eval: bool) -> None:
        """Trainer-construction checks that need to know which datasets were given."""
        # As HF's Trainer: a periodic eval needs a dataset (eval_on_start alone is skipped).
        _check(
            has_eval or self.eval_strategy == "no",
            f"`eval_strategy={self.eval_strategy!r}` needs an `eval_dataset`, but "
            "none was given (for `python -m jaxrl.train`: `--dataset_test_split` names a split "
            "the dataset lacks). Pass an eval dataset or set `eval_strategy='no'`.",
        )

    def _validate_intervals(self) -> None:
        _check_choice("eval_strategy", self.eval_strategy, STRATEGIES)
        _check_choice("save_strategy", self.save_strategy, SAVE_STRATEGIES)
        _check_choice("logging_strategy", self.logging_strategy, STRATEGIES)
        self.logging_steps = _check_steps("logging_steps", self.logging_steps)
        if self.eval_steps is None:
            self.eval_steps = self.logging_steps
        self.eval_steps = _check_steps("eval_steps", self.eval_steps)
        self.save_steps = _check_steps("save_steps", self.save_steps)

    def _validate_sampling(self) -> None:
        """HF's data-order, NEFTune and token-count fields."""
        _check(
            math.isfinite(self.eval_delay) and self.eval_delay >= 0,
            f"`eval_delay` must be a number >= 0 (steps or epochs); got {self.eval_delay}.",
        )
        _check(
            self.train_sampling_strategy != "batch_rebalance",
            "`train_sampling_strategy='batch_rebalance'` is not supported: HF's "
            "BatchRebalanceSampler gives micro-batches of different sizes, but a jaxrl step "
            "compiles one batch shape (all its micro-batches and devices padded to one row "
            "length, so there is no per-device padding cost to rebalance); use 'random' or "
            "'group_by_length' (whose similar lengths per step pick shorter `length_buckets`).",
        )
        _check_choice(
            "train_sampling_strategy", self.train_sampling_strategy, TRAIN_SAMPLING_STRATEGIES
        )
        _check(bool(self.length_column_name), "`length_column_name` must be a column name.")
        _check(
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
        _check_choice("include_num_input_tokens_seen", seen, INPUT_TOKEN_COUNTS)
        self.include_num_input_tokens_seen = seen

    @staticmethod
    def _normalise_report_to(report_to: str | list[str] | None) -> list[str]:
        if report_to is None:
            return []
        names = report_to.split(",") if isinstance(report_to, str) else list(report_to)
        names = [name.strip() for name in names if name.strip()]
        for name in names:
            _check_choice("report_to", name, REPORT_TO)
        if "all" in names:
            # HF: "all" means every installed integration we support.
            modules = {"wandb": "wandb", "tensorboard": "tensorboardX"}
            return [n for n, m in modules.items() if importlib.util.find_spec(m) is not None]
        return [name for name in names if name != "none"]

    def resolve_model_init_kwargs(self) -> None:
        """Validate `model_init_kwargs` and map it onto jaxrl fields (idempotent).

        TRL's scripts fill `model_init_kwargs` after the config is built, so trainers call this
        again at construction."""
        _check_choice("param_dtype", self.param_dtype, DTYPES)
        if self.residual_dtype is not None:
            _check_choice("residual_dtype", self.residual_dtype, DTYPES)
        _check(
            not self.trust_remote_code,
            "`trust_remote_code=True` is not supported: jaxrl runs its own JAX implementation of "
            "each model family and never a checkpoint's Python code; remove the setting.",
        )
        kwargs = self.model_init_kwargs
        if isinstance(kwargs, str):
            kwargs = _coerce("model_init_kwargs", kwargs, dict)
        kwargs = {k: v for k, v in dict(kwargs or {}).items() if v is not None}
        if "torch_dtype" in kwargs:
            _check(
                "dtype" not in kwargs, "`model_init_kwargs` sets both 'dtype' and 'torch_dtype'."
            )
            kwargs["dtype"] = kwargs.pop("torch_dtype")
        _check(
            kwargs.get("revision", "main") == "main",
            f"`model_init_kwargs['revision']={kwargs.get('revision')!r}` (`--model_revision`) is "
            "not supported: jaxrl loads a local directory or the hub's main revision; download "
            "the revision yourself and pass its path.",
        )
        _check(
            not kwargs.get("trust_remote_code", False),
            "`trust_remote_code=True` is not supported: jaxrl runs its own JAX implementation of "
            "each model family and never a checkpoint's Python code; remove the setting.",
        )
        attn = kwargs.get("attn_implementation")
        _check(
            attn is None or attn in ATTN_IMPLEMENTATIONS,
            f"`attn_implementation={attn!r}` has no JAX counterpart; jaxrl's XLA attention "
            f"computes exact softmax attention, which {list(ATTN_IMPLEMENTATIONS)} all map to.",
        )
        unknown = sorted(
            set(kwargs) - {"dtype", "revision", "trust_remote_code", "attn_implementation"}
        )
        _check(
            not unknown,
            f"`model_init_kwargs` keys {unknown} are not supported; jaxrl honours 'dtype' (or "
            "'torch_dtype'), 'attn_implementation', 'revision' ('main') and 'trust_remote_code' "
            "(false).",
        )
        _check(
            kwargs.get("dtype") != "auto",
            "`dtype='auto'` is not supported: give the parameter dtype explicitly "
            "(`--dtype bfloat16` or `--param_dtype bfloat16`).",
        )
        if "dtype" in kwargs:
            dtype = str(kwargs["dtype"]).removeprefix("torch.")
            _check_choice("model_init_kwargs['dtype']", dtype, DTYPES)
            _check(
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


def _with_foreign(name: str, fields: tuple[Foreign, ...]) -> type:
    return dataclasses.make_dataclass(
        name, config_fields.dataclass_fields(fields), bases=(TrainingConfig,)
    )


@dataclass
class SFTConfig(_with_foreign("_SFTForeign", config_fields.SFT)):
    """TRL `SFTConfig` fields we implement."""

    FOREIGN_FIELDS: typing.ClassVar[tuple[Foreign, ...]] = config_fields.SFT
    # HF TrainingArguments fields that the other trainers reject and SFT implements.
    IMPLEMENTED_FIELDS: typing.ClassVar[tuple[str, ...]] = ("label_smoothing_factor",)

    # TRL: keep the activations saved for the backward pass in host memory between the forward
    # and the backward (with `gradient_checkpointing`, each layer's saved input); the same
    # numbers, less device memory, host transfers instead (`models.layers.remat_wrap`).
    activation_offloading: bool = False
    learning_rate: float = 2e-5
    dataset_text_field: str = "text"
    max_length: int | None = 1024
    # Deprecated alias of max_length (older TRL); warns and maps.
    max_seq_length: int | None = None
    packing: bool = False
    packing_strategy: str = "bfd"
    # TRL: each device's share of a micro-batch runs as one row, its examples back to back
    # (positions restarting at 0, attention kept within each example), padded only to a
    # `length_buckets` bucket of such rows. Needs `max_length=None` unless packing (TRL); best-fit
    # packing (`"bfd"`, `"bfd_split"`) is padding-free already.
    padding_free: bool = False
    # TRL: {"skip_prepare_dataset": True} uses already-tokenized rows as given (`rows_as_given`);
    # TRL reads no other key. A JSON string is parsed (CLI).
    dataset_kwargs: dict | str | None = None
    # TRL: whether the eval (and predict) datasets are packed; None follows `packing`.
    eval_packing: bool | None = None
    # TRL: shuffle each prepared dataset with `seed` (also before packing, so that different
    # documents share rows). Training batches are a seeded permutation either way.
    shuffle_dataset: bool = False
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    dataset_num_proc: int | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    # TRL: a .jinja / .j2 file whose template replaces the tokenizer's, or a tokenizer (directory
    # or hub id) whose template, added tokens and EOS are cloned (`models.resize.clone_chat_template`).
    chat_template_path: str | None = None
    # TRL 1.16: "keep_start" keeps a long sequence's first `max_length` tokens, "keep_end"
    # (deprecated there) its last ones. Unpacked rows only: packing cuts into rows instead.
    truncation_mode: str = "keep_start"
    # "nll", or "dft" (Dynamic Fine-Tuning, https://huggingface.co/papers/2508.05629: each
    # token's NLL scaled by its probability, without gradient). "chunked_nll" is TRL's
    # deprecated alias of "nll".
    loss_type: str = "nll"
    # HF's label smoothing (`LabelSmoother`), which TRL 1.16's SFTTrainer applies with the NLL
    # loss (deprecated there): (1 - eps) x NLL + eps x the mean over tokens of
    # -(1/V) sum_v log p_v. jaxrl computes it in the fused LM head (no full logits).
    label_smoothing_factor: float = 0.0
    # TRL: weight of the MoE load-balancing loss (transformers' `aux_loss`) added to the loss;
    # None takes the model config's own `router_aux_loss_coef`, 0.0 turns it off; nonzero on a
    # model without MoE layers is an error (`jaxrl.algos.router_aux`).
    router_aux_loss_coef: float | None = None
    # jaxrl: the row lengths a step's batch may be padded to (its train micro-batches, all
    # processes; each eval batch alike): the smallest one >= the batch's longest row. The run's
    # static length (the longest example, capped at `max_length`, rounded up to
    # `pad_to_multiple_of`) is always the last; longer entries are unused. "auto": powers of two
    # from 256 below it (rounded up to `pad_to_multiple_of`); None: every batch at the static
    # length (one compiled shape). TRL pads each batch to its own longest row; a few buckets
    # keep most of that saving while jit compiles one program per bucket. Packed rows
    # (`packing`, `eval_packing`) fill the static length by construction and always use it.
    # With `padding_free`, the lengths are those of the flattened rows (one per device); "auto"
    # then also has the midpoints 1.5 x 2^k between the powers of two.
    length_buckets: list[int] | str | None = "auto"

    @property
    def skip_prepare_dataset(self) -> bool:
        """TRL's `dataset_kwargs["skip_prepare_dataset"]`."""
        return bool((self.dataset_kwargs or {}).get("skip_prepare_dataset", False))

    def __post_init__(self) -> None:
        super().__post_init__()
        _resolve_length_buckets(self)
        _check(
            0.0 <= self.label_smoothing_factor < 1.0,
            f"`label_smoothing_factor` must be in [0, 1); got {self.label_smoothing_factor}.",
        )
        _check_choice("truncation_mode", self.truncation_mode, TRUNCATION_MODES)
        if isinstance(self.dataset_kwargs, str):
            try:
                self.dataset_kwargs = json.loads(self.dataset_kwargs)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"`dataset_kwargs` must be a dict or a JSON object string; got "
                    f"{self.dataset_kwargs!r} ({e})."
                ) from None
        if self.dataset_kwargs is not None:
            _check(
                isinstance(self.dataset_kwargs, dict),
                f"`dataset_kwargs` must be a dict; got {self.dataset_kwargs!r}.",
            )
            unknown = sorted(set(self.dataset_kwargs) - {"skip_prepare_dataset"})
            _check(
                not unknown,
                f"`dataset_kwargs` keys {unknown} are not read by TRL's SFTTrainer (nor by jaxrl); "
                "the only key is 'skip_prepare_dataset'.",
            )
            _check(
                not (self.skip_prepare_dataset and (self.packing or self.eval_packing)),
                "`dataset_kwargs={'skip_prepare_dataset': True}` uses the rows as given, and "
                "packing happens in the preparation it skips; pack the data yourself, or set "
                "`packing=False` (and `eval_packing`).",
            )
        if self.truncation_mode == "keep_end":
            warnings.warn(
                "truncation_mode='keep_end' is deprecated in TRL 1.16 (to be removed in TRL 2.0); "
                "the default 'keep_start' keeps each sequence's first tokens.",
                FutureWarning,
                stacklevel=3,
            )
        if self.loss_type == "chunked_nll":
            warnings.warn(
                "loss_type='chunked_nll' is TRL's deprecated alias of 'nll'; use 'nll'.",
                FutureWarning,
                stacklevel=3,
            )
            self.loss_type = "nll"
        _check_choice("loss_type", self.loss_type, SFT_LOSS_TYPES)
        _check(
            not (self.label_smoothing_factor and self.loss_type == "dft"),
            "`label_smoothing_factor` smooths the NLL loss; TRL ignores it with `loss_type='dft'`. "
            "Set one of them back to its default.",
        )
        if self.max_seq_length is not None:
            warnings.warn(
                "`max_seq_length` is deprecated; use `max_length` instead.",
                FutureWarning,
                stacklevel=3,
            )
            self.max_length = self.max_seq_length
            self.max_seq_length = None
        _check(
            self.max_length is None or self.max_length >= 1,
            f"`max_length` must be None or >= 1; got {self.max_length}.",
        )
        _check(
            not (self.packing and self.max_length is None),
            "`packing=True` needs `max_length` (the packed sequence length).",
        )
        if self.packing_strategy == "bfd-requeue":  # TRL 1.16's deprecated name
            warnings.warn(
                "The `bfd-requeue` packing strategy has been renamed to `bfd_split`. Please update "
                "your configuration accordingly.",
                FutureWarning,
                stacklevel=3,
            )
            self.packing_strategy = "bfd_split"
        _check_choice("packing_strategy", self.packing_strategy, PACKING_STRATEGIES)
        _check(
            self.dataset_num_proc is None or self.dataset_num_proc >= 1,
            f"`dataset_num_proc` must be None or >= 1; got {self.dataset_num_proc}.",
        )


@dataclass
class RewardConfig(_with_foreign("_RewardForeign", config_fields.REWARD)):
    """TRL `RewardConfig` fields we implement."""

    FOREIGN_FIELDS: typing.ClassVar[tuple[Foreign, ...]] = config_fields.REWARD

    # TRL: keep the activations saved for the backward pass in host memory between the forward
    # and the backward (with `gradient_checkpointing`, each layer's saved input); the same
    # numbers, less device memory, host transfers instead (`models.layers.remat_wrap`).
    activation_offloading: bool = False
    learning_rate: float = 1e-4
    # TRL: pairs whose chosen or rejected sequence exceeds max_length are filtered out.
    max_length: int | None = 1024
    # TRL default True. False: the policy's training forwards apply the model config's dropout
    # (GPT-2's and Phi-3's, any family's attention_dropout; `jaxrl.algos.model_dropout`).
    disable_dropout: bool = True
    dataset_num_proc: int | None = None
    # Eq. 2 of https://huggingface.co/papers/2312.09244: coef * mean((r_chosen + r_rejected)^2).
    center_rewards_coefficient: float | None = None
    pad_token: str | None = None
    # TRL: the tokenizer's EOS (appended to standard chosen/rejected texts, rendered by chat
    # templates) and the model config's `eos_token_id`.
    eos_token: str | None = None
    # TRL: a .jinja / .j2 file whose template replaces the tokenizer's, or a tokenizer (directory
    # or hub id) whose template, added tokens and EOS are cloned (`models.resize.clone_chat_template`).
    chat_template_path: str | None = None
    # jaxrl: the row lengths a step's batch may be padded to (its train micro-batches, all
    # processes; each eval batch alike): the smallest one >= the batch's longest row. The run's
    # static length (the longest example, capped at `max_length`, rounded up to
    # `pad_to_multiple_of`) is always the last; longer entries are unused. "auto": powers of two
    # from 256 below it (rounded up to `pad_to_multiple_of`); None: every batch at the static
    # length (one compiled shape). TRL pads each batch to its own longest row; a few buckets
    # keep most of that saving while jit compiles one program per bucket.
    length_buckets: list[int] | str | None = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        _resolve_length_buckets(self)
        _check(
            self.max_length is None or self.max_length >= 1,
            f"`max_length` must be None or >= 1; got {self.max_length}.",
        )
        _check(
            self.dataset_num_proc is None or self.dataset_num_proc >= 1,
            f"`dataset_num_proc` must be None or >= 1; got {self.dataset_num_proc}.",
        )
        _check(
            self.center_rewards_coefficient is None or self.center_rewards_coefficient >= 0,
            f"`center_rewards_coefficient` must be None or >= 0; got "
            f"{self.center_rewards_coefficient}.",
        )


@dataclass
class DPOConfig(_with_foreign("_DPOForeign", config_fields.DPO)):
    """TRL `DPOConfig` fields we implement, plus TRL < 1.0's prompt/completion length limits."""

    FOREIGN_FIELDS: typing.ClassVar[tuple[Foreign, ...]] = config_fields.DPO

    # TRL: keep the activations saved for the backward pass in host memory between the forward
    # and the backward (with `gradient_checkpointing`, each layer's saved input); the same
    # numbers, less device memory, host transfers instead (`models.layers.remat_wrap`).
    activation_offloading: bool = False
    learning_rate: float = 1e-6
    beta: float = 0.1
    loss_type: list[str] = field(default_factory=lambda: ["sigmoid"])
    loss_weights: list[float] | None = None  # None -> 1.0 for every loss_type
    label_smoothing: float = 0.0
    max_length: int | None = 1024
    # TRL < 1.0 (and the v0.7.2 API): cut prompts to this many tokens first. None (TRL 1.16, which
    # has no such field): a pair longer than max_length keeps its prompt and cuts its completions.
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    # Which end of the prompt survives truncation to max_prompt_length. TRL 1.16's default
    # "keep_start"; TRL < 1.0 defaulted to "keep_end".
    truncation_mode: str = "keep_start"
    padding_value: int | None = None  # None -> tokenizer.pad_token_id
    label_pad_token_id: int = -100  # only -100: padding is masked, never scored
    # TRL default True. False: the policy's training forwards apply the model config's dropout
    # (GPT-2's and Phi-3's, any family's attention_dropout; `jaxrl.algos.model_dropout`).
    disable_dropout: bool = True
    reference_free: bool = False
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    # TR-DPO (https://huggingface.co/papers/2404.09656): ref <- alpha*policy + (1-alpha)*ref
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    discopop_tau: float = 0.05
    # LD-DPO (https://huggingface.co/papers/2409.06411): each completion's log-prob sums its
    # first min(len(chosen), len(rejected)) tokens in full and the rest scaled by `ld_alpha`, for
    # the policy and the reference alike. None: plain sums (standard DPO).
    ld_alpha: float | None = None
    # f-DPO (https://huggingface.co/papers/2309.16240): the pair's score difference uses
    # f'(pi / pi_ref) of this divergence instead of the log-ratio (reverse KL). Rewards stay
    # beta * log-ratio, as in TRL.
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5  # alpha of `alpha_divergence`
    # WPO (https://huggingface.co/papers/2406.11827): each pair's loss is scaled by the product of
    # its two completions' weights exp(mean_t [log p(y_t) - log sum_v p_v^2]) under the current
    # policy, without gradient.
    use_weighting: bool = False
    dataset_num_proc: int | None = None
    # jaxrl: store the frozen reference weights as int8 to halve/quarter their memory.
    ref_model_quantization: str | None = None
    # jaxrl: run each pair as one row `prompt + chosen + rejected` with a prefix-tree attention
    # mask (https://huggingface.co/papers/2410.20305), so the prompt is computed once, not twice.
    # Same log-probs as the two-row layout; fewer tokens when prompts are long.
    prefix_sharing: bool = False
    # TRL: weight of the MoE load-balancing loss (transformers' `aux_loss`) added to the loss;
    # None takes the model config's own `router_aux_loss_coef`, 0.0 turns it off; nonzero on a
    # model without MoE layers is an error (`jaxrl.algos.router_aux`).
    router_aux_loss_coef: float | None = None
    pad_token: str | None = None  # TRL: overrides the tokenizer's pad token
    # TRL < 1.0 (dropped in 1.0): at each evaluation, sample completions of a random eval batch
    # from the policy and from the reference model; logged as the W&B table `game_log` (columns
    # Prompt / Policy / Ref Model) and always as JSON lines in `output_dir/game_log.jsonl`.
    generate_during_eval: bool = False
    # jaxrl: the row lengths a step's batch may be padded to (its train micro-batches, all
    # processes; each eval batch alike): the smallest one >= the batch's longest row. The run's
    # static length (the longest example, capped at `max_length`, rounded up to
    # `pad_to_multiple_of`) is always the last; longer entries are unused. "auto": powers of two
    # from 256 below it (rounded up to `pad_to_multiple_of`); None: every batch at the static
    # length (one compiled shape). TRL pads each batch to its own longest row; a few buckets
    # keep most of that saving while jit compiles one program per bucket. With `prefix_sharing`,
    # a row holds the prompt and both completions.
    length_buckets: list[int] | str | None = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        _resolve_length_buckets(self)
        _check(
            self.label_pad_token_id == -100,
            "`label_pad_token_id` other than -100 is not supported: jaxrl marks padded completion "
            "tokens with a loss mask, so remove the setting.",
        )
        if isinstance(self.loss_type, str):
            self.loss_type = [name.strip() for name in self.loss_type.split(",")]
        _check(bool(self.loss_type), "`loss_type` needs at least one loss name.")
        for name in self.loss_type:
            _check_choice("loss_type", name, DPO_LOSS_TYPES)
        _check(
            self.loss_weights is None or len(self.loss_weights) == len(self.loss_type),
            f"`loss_weights` must have the same length as `loss_type`; got "
            f"{len(self.loss_weights or [])} weights for {len(self.loss_type)} loss types.",
        )
        _check(self.beta > 0, f"`beta` must be > 0; got {self.beta}.")
        _check(
            0.0 <= self.label_smoothing < 0.5,
            f"`label_smoothing` must be in [0, 0.5); got {self.label_smoothing}.",
        )
        _check(
            "exo_pair" not in self.loss_type or self.label_smoothing > 0,
            "`loss_type='exo_pair'` needs `label_smoothing` > 0 (the EXO paper recommends 1e-3).",
        )
        for name in ("max_length", "max_prompt_length", "max_completion_length"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"`{name}` must be None or >= 1; got {value}.")
        _check_choice("truncation_mode", self.truncation_mode, TRUNCATION_MODES)
        _check(
            self.truncation_mode == "keep_start" or self.max_prompt_length is not None,
            "`truncation_mode='keep_end'` chooses which end of the prompt survives "
            "`max_prompt_length`, so it needs `max_prompt_length` set (TRL 1.16's deprecated "
            "whole-sequence 'keep_end' is not implemented).",
        )
        _check(
            not (self.sync_ref_model and self.precompute_ref_log_probs),
            "`sync_ref_model=True` cannot be combined with `precompute_ref_log_probs=True`: the "
            "precomputed log-probs would go stale when the reference syncs. Disable one of them.",
        )
        _check(
            not (self.reference_free and (self.sync_ref_model or self.precompute_ref_log_probs)),
            "`reference_free=True` uses no reference model; unset `sync_ref_model` and "
            "`precompute_ref_log_probs`.",
        )
        _check(
            0.0 <= self.ref_model_mixup_alpha <= 1.0,
            f"`ref_model_mixup_alpha` must be in [0, 1]; got {self.ref_model_mixup_alpha}.",
        )
        _check(
            self.ref_model_sync_steps >= 1,
            f"`ref_model_sync_steps` must be >= 1; got {self.ref_model_sync_steps}.",
        )
        _check(self.discopop_tau > 0, f"`discopop_tau` must be > 0; got {self.discopop_tau}.")
        _check(
            self.ld_alpha is None or 0.0 <= self.ld_alpha <= 1.0,
            f"`ld_alpha` must be None or in [0, 1] (1 weighs every token fully, 0 drops the tokens "
            f"past the shorter completion's length); got {self.ld_alpha}.",
        )
        _check_choice("f_divergence_type", self.f_divergence_type, DPO_F_DIVERGENCE_TYPES)
        if self.f_divergence_type != "reverse_kl":
            other = [t for t in self.loss_type if t not in DPO_F_DIVERGENCE_LOSS_TYPES]
            _check(
                not other,
                f"`f_divergence_type={self.f_divergence_type!r}` is only defined for the loss types "
                f"built on the chosen-rejected score difference {list(DPO_F_DIVERGENCE_LOSS_TYPES)}, "
                f"not {other}; use `f_divergence_type='reverse_kl'` with those.",
            )
        _check(
            not (self.use_weighting and {"aot", "aot_unpaired"} & set(self.loss_type)),
            "`use_weighting=True` (WPO) is not defined for 'aot' / 'aot_unpaired': they sort the "
            "pairs, which would misalign the per-pair weights (as in TRL). Drop one of them.",
        )
        _check(
            not (self.use_weighting and "sft" in self.loss_type),
            "`use_weighting=True` (WPO) weighs pairs, and the 'sft' loss is one NLL over the "
            "batch's chosen tokens, not a per-pair loss; TRL 1.16's DPOTrainer fails on this "
            "combination too. Drop 'sft' from `loss_type` or set `use_weighting=False`.",
        )
        for name in ("precompute_ref_batch_size", "dataset_num_proc"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"`{name}` must be None or >= 1; got {value}.")
        if self.ref_model_quantization is not None:
            _check_choice(
                "ref_model_quantization", self.ref_model_quantization, REF_MODEL_QUANTIZATIONS
            )


CONFIGS: dict[str, type[TrainingConfig]] = {
    "sft": SFTConfig,
    "reward": RewardConfig,
    "dpo": DPOConfig,
}


@dataclass
class PeftArguments:
    """TRL `ModelConfig`'s PEFT / bitsandbytes fields (same names and defaults), shared by the
    CLI's `ScriptArguments` and `jaxrl.scripting.ModelConfig`; both build the trainer's LoRA with
    `scripting.get_peft_config` / `get_quantization_config`."""

    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | None = None
    lora_target_parameters: list[str] | None = None
    lora_modules_to_save: list[str] | None = None
    lora_task_type: str | None = "CAUSAL_LM"
    use_rslora: bool = False
    use_dora: bool = False
    load_in_8bit: bool = False
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "nf4"
    use_bnb_nested_quant: bool = False
    bnb_4bit_quant_storage: str | None = None


@dataclass
class ScriptArguments(PeftArguments):
    """Script-level flags of `python -m jaxrl.train` (TRL `ScriptArguments` / `ModelConfig` names)."""

    algo: str | None = None
    config: str | None = None
    model_name_or_path: str | None = None
    tokenizer_name_or_path: str | None = None  # None -> model_name_or_path
    dataset_name: str | None = None  # hub id, local file or directory
    dataset_config: str | None = None
    dataset_train_split: str = "train"
    dataset_test_split: str = "test"
    # lora_task_type None: the trainer's own (CAUSAL_LM, or SEQ_CLS for reward).
    lora_task_type: str | None = None


@dataclass
class OnlineScriptArguments(ScriptArguments):
    """`--algo grpo` / `--algo rloo` script flags: TRL's `GRPOScriptArguments` (trl/scripts/grpo.py).
    `reward_model_name_or_path`: a reward model directory, scored first; `reward_funcs`: names
    from `jaxrl.rewards.SCRIPT_REWARD_FUNCS` or dotted import paths (`my_lib.rewards.fn`).
    Neither: the embedded arithmetic task's `arith_correct` (only without `dataset_name`)."""

    reward_model_name_or_path: str | None = None
    reward_funcs: list[str] | None = None


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Convert a YAML/CLI value to `annotation`, or raise ConfigError naming the key."""
    members = _union_members(annotation)
    # "null"/"None" spell None; a lowercase "none" stays a string where strings are allowed
    # (e.g. report_to="none").
    if value is None or (
        isinstance(value, str)
        and (value in ("null", "None", "~") or (str not in members and value.lower() == "none"))
    ):
        if type(None) in members:
            return None
        raise ConfigError(f"`{key}` cannot be null.")
    errors = []
    for member in members:
        if member is type(None):
            continue
        try:
            return _coerce_one(value, member)
        except (ValueError, TypeError, yaml.YAMLError) as error:
            errors.append(str(error))
    expected = " or ".join(getattr(m, "__name__", str(m)) for m in members)
    raise ConfigError(f"`{key}` expects {expected}; got {value!r} ({'; '.join(errors)}).")


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-4` (no dot) as a float, as JSON and Python do."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _parse_text(text: str) -> Any:
    # YAML is a superset of JSON, so this reads both.
    return yaml.load(text, Loader=_YamlLoader)


def _coerce_one(value: Any, target: Any) -> Any:
    origin = typing.get_origin(target)
    if target is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError("not a boolean (use true/false)")
    if target is int:
        if isinstance(value, bool):
            raise TypeError("not an integer")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return int(value) if isinstance(value, int | str) else _fail("not an integer")
    if target is float:
        if isinstance(value, bool):
            raise TypeError("not a number")
        return float(value) if isinstance(value, int | float | str) else _fail("not a number")
    if target is str:
        return value if isinstance(value, str) else _fail("not a string")
    if target is list or origin is list:
        if isinstance(value, str):
            text = value.strip()
            value = _parse_text(text) if text.startswith("[") else text.split(",")
        if not isinstance(value, list | tuple):
            value = [value]
        (item_type,) = typing.get_args(target) or (None,)
        if item_type is None:
            return list(value)
        return [
            _coerce_one(item.strip() if isinstance(item, str) else item, item_type)
            for item in value
        ]
    if target is dict or origin is dict:
        if isinstance(value, str):
            value = _parse_text(value)
        return dict(value) if isinstance(value, dict) else _fail("not a mapping (use JSON/YAML)")
    raise TypeError(f"unsupported annotation {target}")


def _fail(message: str) -> typing.NoReturn:
    raise ValueError(message)


def split_cli(
    cli_args: list[str], bool_keys: set[str], list_keys: set[str] = frozenset()
) -> dict[str, str | bool | list[str]]:
    """Command-line tokens -> {key: raw value}, with HF `HfArgumentParser`'s spellings:
    `--key value`, `--key=value`, a bare `--flag` (bool fields), `--no_flag` (bool false) and
    `--key v1 v2 ...` (list fields)."""
    parsed: dict[str, str | bool | list[str]] = {}
    i = 0
    while i < len(cli_args):
        token = cli_args[i]
        if not token.startswith("--") or token == "--":
            raise ConfigError(
                f"Unexpected command-line argument {token!r}; flags look like `--field value`."
            )
        key, eq, raw = token[2:].partition("=")
        key = key.replace("-", "_")
        values = []
        while i + 1 + len(values) < len(cli_args) and not cli_args[i + 1 + len(values)].startswith(
            "--"
        ):
            values.append(cli_args[i + 1 + len(values)])
            if key not in list_keys:
                break
        if eq:
            parsed[key] = raw
            i += 1
        elif values:
            parsed[key] = values if key in list_keys and len(values) > 1 else values[0]
            i += 1 + len(values)
        elif key in bool_keys:
            parsed[key] = True
            i += 1
        elif key.startswith("no_") and key[3:] in bool_keys:
            parsed[key[3:]] = False
            i += 1
        else:
            raise ConfigError(f"Flag `--{key}` needs a value: `--{key} VALUE` or `--{key}=VALUE`.")
    return parsed


def field_types(cls: type) -> dict[str, Any]:
    """Init fields of dataclass `cls` -> their resolved type annotations."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def kinds_of_keys(types_by_key: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(bool keys, list keys) of a {key: annotation} map, for `split_cli`."""
    bool_keys = {k for k, t in types_by_key.items() if bool in _union_members(t)}
    list_keys = {
        k
        for k, t in types_by_key.items()
        if any(m is list or typing.get_origin(m) is list for m in _union_members(t))
    }
    return bool_keys, list_keys


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping from `path`, or ConfigError naming the file (and line) and the fix."""
    try:
        values = _parse_text(Path(path).read_text()) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(
            f"{path}{where} is not valid YAML ({problem}); fix the file there (each line is "
            "`field: value`, lists as `[a, b]`)."
        ) from None
    except OSError as error:
        raise ConfigError(f"Cannot read config file {path}: {error.strerror}.") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} must contain a mapping of field: value.")
    return values


def coerce(key: str, value: Any, annotation: Any) -> Any:
    """Convert a YAML/CLI value to `annotation`, or raise ConfigError naming the key."""
    return _coerce(key, value, annotation)


def parse_config(
    cls: type[TrainingConfig],
    yaml_path: str | Path | None = None,
    cli_args: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    script_class: type[ScriptArguments] = ScriptArguments,
) -> tuple[TrainingConfig, ScriptArguments]:
    """Build `cls` from defaults < YAML file < CLI flags < `overrides`.

    Script-level keys (`script_class` fields: `ScriptArguments`, or `OnlineScriptArguments` for
    GRPO/RLOO) may appear in any source and are returned separately. `--config FILE` on the command line is used when `yaml_path` is not given.
    Unknown keys and bad values raise ConfigError naming the key and the closest valid keys.
    """
    script_types = field_types(script_class)
    all_types = {**script_types, **field_types(cls)}
    bool_keys, list_keys = kinds_of_keys(all_types)

    cli_values = split_cli(list(cli_args or []), bool_keys, list_keys)
    if yaml_path is None and "config" in cli_values:
        yaml_path = str(cli_values["config"])

    sources: list[tuple[str, dict[str, Any]]] = []
    if yaml_path is not None:
        sources.append((str(yaml_path), read_yaml(yaml_path)))
    sources += [("the command line", cli_values), ("overrides", dict(overrides or {}))]

    config_kwargs: dict[str, Any] = {}
    script_kwargs: dict[str, Any] = {"config": None if yaml_path is None else str(yaml_path)}
    for source, values in sources:
        for key, value in values.items():
            if key not in all_types:
                close = difflib.get_close_matches(key, list(all_types), n=3, cutoff=0.6)
                hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
                raise ConfigError(f"Unknown key {key!r} in {source} for {cls.__name__}.{hint}")
            target = script_kwargs if key in script_types else config_kwargs
            target[key] = _coerce(key, value, all_types[key])
    try:
        config = cls(**config_kwargs)
    except ConfigError as error:
        raise ConfigError(f"{cls.__name__}: {error}") from None
    return config, script_class(**script_kwargs)
