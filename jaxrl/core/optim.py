"""Optimizer and learning-rate schedule built from a training config.

HF `TrainingArguments` names map onto optax transformations here; schedules reproduce the
`transformers.get_scheduler` lambdas (warmup is linear from 0, the first update uses step 0).
This file builds optax objects; it never touches parameters or runs an update.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

Schedule = Callable[[jax.Array | int], jax.Array]

OPTIMIZERS = ("adamw", "sgd", "adafactor", "lion")  # config.OPTIMIZERS maps HF names onto these
SCHEDULERS = ("linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup")

# Parameters HF's Trainer keeps out of weight decay: biases and normalisation scales
# (`get_decay_parameter_names` excludes bias and LayerNorm/RMSNorm weights).
_NO_DECAY = re.compile(r"(bias|norm|ln_\d|ln_f|layernorm)", re.IGNORECASE)


def make_schedule(
    name: str,
    learning_rate: float,
    max_steps: int,
    warmup: int,
    scheduler_kwargs: dict[str, Any] | None = None,
) -> Schedule:
    """`lr(step)` for the update number `step` (0-based), equal to HF's LambdaLR lambdas."""
    kw = dict(scheduler_kwargs or {})
    if name not in SCHEDULERS:
        raise ValueError(f"lr_scheduler_type={name!r} is not supported; use one of {SCHEDULERS}.")
    min_lr_rate = 0.0
    if name == "cosine_with_min_lr":
        if "min_lr" in kw:
            min_lr_rate = kw.pop("min_lr") / learning_rate
        elif "min_lr_rate" in kw:
            min_lr_rate = kw.pop("min_lr_rate")
        else:
            raise ValueError(
                "lr_scheduler_type='cosine_with_min_lr' needs lr_scheduler_kwargs "
                "{'min_lr': ...} or {'min_lr_rate': ...}."
            )
    num_cycles = kw.pop("num_cycles", 0.5) if name.startswith("cosine") else 0.5
    if kw:
        raise ValueError(f"Unsupported lr_scheduler_kwargs for {name!r}: {sorted(kw)}.")
    total = max(1, max_steps)

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        warm = s / max(1, warmup)
        if name == "constant":
            factor = jnp.ones_like(s)
        elif name == "constant_with_warmup":
            factor = jnp.where(s < warmup, warm, 1.0)
        elif name == "linear":
            decay = jnp.maximum(0.0, (total - s) / max(1, total - warmup))
            factor = jnp.where(s < warmup, warm, decay)
        else:
            progress = (s - warmup) / max(1, total - warmup)
            cos = 0.5 * (1.0 + jnp.cos(jnp.pi * num_cycles * 2.0 * progress))
            cos = jnp.maximum(0.0, cos * (1 - min_lr_rate) + min_lr_rate)
            factor = jnp.where(s < warmup, warm, cos)
        return learning_rate * factor

    return schedule


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay (not biases, not norm scales)."""

    def keep(path, _):
        return not _NO_DECAY.search(jax.tree_util.keystr(path))

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(
    *,
    optim: str,
    schedule: Schedule,
    weight_decay: float,
    adam_beta1: float,
    adam_beta2: float,
    adam_epsilon: float,
    max_grad_norm: float | None,
    user_tx: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
    """Gradient clipping (as HF's Trainer does, also for a user optimizer) then the optimizer."""
    if user_tx is not None:
        tx = user_tx
    elif optim == "adamw":
        tx = optax.adamw(
            schedule,
            b1=adam_beta1,
            b2=adam_beta2,
            eps=adam_epsilon,
            weight_decay=weight_decay,
            mask=decay_mask,
        )
    elif optim == "sgd":
        tx = optax.chain(
            optax.add_decayed_weights(weight_decay, mask=decay_mask), optax.sgd(schedule)
        )
    elif optim == "adafactor":
        # HF's Adafactor with an external lr: no relative step, no parameter scaling.
        tx = optax.adafactor(
            schedule,
            multiply_by_parameter_scale=False,
            weight_decay_rate=weight_decay or None,
            weight_decay_mask=decay_mask,
        )
    elif optim == "lion":
        tx = optax.lion(
            schedule, b1=adam_beta1, b2=adam_beta2, weight_decay=weight_decay, mask=decay_mask
        )
    else:
        raise ValueError(f"optim={optim!r} is not supported; use one of {OPTIMIZERS}.")
    if max_grad_norm and max_grad_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(max_grad_norm), tx)
    return tx
