"""The value sets jaxrl's training configs accept and the checks they share: the allowed values of
`TrainingConfig`'s and the trainer configs' choice fields (`OPTIMIZERS`, `LR_SCHEDULERS`,
`DPO_LOSS_TYPES`, ...), `check`/`check_choice` (raise a `ConfigError` naming the fix), step-count,
mesh-field and `length_buckets` normalisation.

The bottom of the config stack: `config.py` (`TrainingConfig`), `trainers/*_config.py`,
`core/optim.py` and `scripting.py` import from here. It knows no config class, never imports
JAX, models/, core/ or trainers/, and never touches arrays or devices.
"""

import math
import typing
from typing import Any

from jaxrl.config_cli import ConfigError

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


def check(ok: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless `ok` (the check every config's validation uses)."""
    if not ok:
        raise ConfigError(message)


def check_choice(name: str, value: Any, choices: typing.Iterable[Any]) -> None:
    """Raise a `ConfigError` naming the valid choices unless `value` is one of them."""
    choices = tuple(choices)
    check(value in choices, f"`{name}={value!r}` is not valid; choose one of {list(choices)}.")


# The sampler's engines (`jaxrl.generation`): decode slots refilled as rows finish, or the
# batch in lockstep.
GENERATION_ENGINES = ("continuous", "static")


def check_generation_engine(engine: str, num_slots: int | None) -> None:
    """The online trainers' `generation_engine` and `generation_num_slots`."""
    check_choice("generation_engine", engine, GENERATION_ENGINES)
    check(
        num_slots is None or (isinstance(num_slots, int) and num_slots >= 1),
        f"`generation_num_slots={num_slots!r}` must be an int >= 1, or None for the default "
        "(CPU: one slot per row up to 64 rows, then a quarter of the rows; accelerators: what "
        "half the free memory holds).",
    )


# Upper bounds where TRL has none but a larger value is a typo, not a setting (issue 44): beta
# scales log-ratios of order 1 (TRL's defaults 0.0-0.1, published runs 0.01-1), a temperature
# divides logits (above 100 sampling is uniform over the vocabulary).
BETA_MAX = 1000.0
TEMPERATURE_MAX = 100.0


def check_number(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    why: str = "",
) -> None:
    """Raise a `ConfigError` unless `value` is a finite real number in `[minimum, maximum]`
    (`(minimum, maximum]` with `exclusive_minimum`); `why` says what the range protects."""
    low = "" if minimum is None else f"{'>' if exclusive_minimum else '>='} {minimum:g}"
    high = "" if maximum is None else f"<= {maximum:g}"
    bounds = " and ".join(b for b in (low, high) if b)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > minimum if exclusive_minimum else value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    check(
        ok,
        f"`{name}` must be a finite number{' ' + bounds if bounds else ''}; got {value!r}."
        + (f" {why}" if why else ""),
    )


def check_steps(name: str, value: float) -> float | int:
    """HF semantics: a step count, or a float in (0, 1) meaning a ratio of the total steps."""
    check(value > 0, f"`{name}` must be > 0 (a step count, or a ratio in (0, 1)); got {value}.")
    if value >= 1:
        check(
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
        check(size == -1 or size >= 1, f"`{name}` must be -1 or >= 1; got {size}.")
    check(
        list(sizes.values()).count(-1) <= 1,
        f"At most one of {list(sizes)} may be -1 (take the remaining devices); got {sizes}.",
    )
    if config.logical_axis_rules is None:
        return
    rules = []
    for rule in config.logical_axis_rules:
        check(
            isinstance(rule, list | tuple) and len(rule) == 2 and isinstance(rule[0], str),
            "`logical_axis_rules` entries must be [logical_name, mesh_axis | [mesh_axes] | "
            f"null]; got {rule!r}.",
        )
        name, axes = rule
        for axis in axes if isinstance(axes, list | tuple) else [axes]:
            check(
                axis is None or axis in MESH_AXES,
                f"`logical_axis_rules` maps {name!r} to unknown mesh axis {axis!r}; "
                f"choose from {list(MESH_AXES)} or null.",
            )
        rules.append([name, list(axes) if isinstance(axes, list | tuple) else axes])
    config.logical_axis_rules = rules


def resolve_length_buckets(config: Any) -> None:
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
    check(
        isinstance(value, list | tuple)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value),
        f"`length_buckets` must be 'auto', None or a list of integer row lengths >= 1; got "
        f"{value!r}.",
    )
    value = list(value)
    check(
        all(a < b for a, b in zip(value, value[1:], strict=False)),
        f"`length_buckets` must be strictly increasing (each length once); got {value}. "
        f"Did you mean {sorted(set(value))}?",
    )
    m = config.pad_to_multiple_of
    off = [v for v in value if m and v % m]
    check(
        not off,
        f"`length_buckets` {off} are not multiples of `pad_to_multiple_of={m}`, which every "
        f"padded row length must be; use e.g. {[-(-v // m) * m for v in off]}.",
    )
    config.length_buckets = value
