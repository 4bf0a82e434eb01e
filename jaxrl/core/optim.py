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

from jaxrl.config_checks import LR_SCHEDULERS

Schedule = Callable[[jax.Array | int], jax.Array]

OPTIMIZERS = ("adamw", "sgd", "adagrad", "rmsprop", "adafactor", "lion")  # config_checks.OPTIMIZERS maps
# One list of HF scheduler names, kept with the configs (which import without JAX).
SCHEDULERS = LR_SCHEDULERS

# Parameters HF's Trainer keeps out of weight decay: biases and normalisation scales
# (`get_decay_parameter_names` excludes bias and LayerNorm/RMSNorm weights).
_NO_DECAY = re.compile(r"(bias|norm|ln_\d|ln_f|layernorm)", re.IGNORECASE)


def _min_lr_rate(kw: dict[str, Any], learning_rate: float) -> float:
    if "min_lr" in kw:
        return kw["min_lr"] / learning_rate
    if "min_lr_rate" in kw:
        return kw["min_lr_rate"]
    raise ValueError(
        "This schedule needs lr_scheduler_kwargs {'min_lr': ...} or {'min_lr_rate': ...}."
    )


def _shape(kind: str, progress: jax.Array, num_cycles: float, rising: bool) -> jax.Array:
    """WSD's warmup (rising) and decay curves on progress in [0, 1] (HF `_get_wsd_scheduler_lambda`)."""
    if kind == "linear":
        return progress if rising else 1.0 - progress
    if kind == "cosine":
        if rising:
            return 0.5 * (1.0 - jnp.cos(jnp.pi * progress))
        return 0.5 * (1.0 + jnp.cos(jnp.pi * num_cycles * 2.0 * progress))
    if kind == "1-sqrt":
        return 1.0 - jnp.sqrt(1.0 - progress) if rising else 1.0 - jnp.sqrt(progress)
    raise ValueError(f"warmup/decay type {kind!r} is not one of 'linear', 'cosine', '1-sqrt'.")


def make_schedule(
    name: str,
    learning_rate: float,
    max_steps: int,
    warmup: int,
    scheduler_kwargs: dict[str, Any] | None = None,
) -> Schedule:
    """`lr(step)` for the update number `step` (0-based), equal to HF's LambdaLR lambdas
    (`transformers.optimization`, the `get_scheduler` name with `scheduler_specific_kwargs`)."""
    kw = dict(scheduler_kwargs or {})
    if name not in SCHEDULERS:
        raise ValueError(f"lr_scheduler_type={name!r} is not supported; use one of {SCHEDULERS}.")
    total = max_steps
    ramp = max(1, warmup)

    def cosine_factor(s, num_cycles, min_rate=0.0, shift=0.0):
        progress = (s - warmup + shift) / max(1, total - warmup)
        cos = 0.5 * (1.0 + jnp.cos(jnp.pi * num_cycles * 2.0 * progress))
        return jnp.maximum(0.0, cos * (1 - min_rate) + min_rate)

    def factor(s):
        warm = s / ramp
        if name == "constant":
            return jnp.ones_like(s)
        if name == "constant_with_warmup":
            return jnp.where(s < warmup, warm, 1.0)
        if name == "linear":
            return jnp.where(
                s < warmup, warm, jnp.maximum(0.0, (total - s) / max(1, total - warmup))
            )
        if name == "cosine":
            return jnp.where(s < warmup, warm, cosine_factor(s, kw.get("num_cycles", 0.5)))
        if name == "cosine_with_min_lr":
            rate = _min_lr_rate(kw, learning_rate)
            return jnp.where(s < warmup, warm, cosine_factor(s, kw.get("num_cycles", 0.5), rate))
        if name == "cosine_warmup_with_min_lr":
            # HF's "lr_rate" variant: warmup reaches 1 on its last step, decay is shifted by one.
            rate = _min_lr_rate(kw, learning_rate)
            start = kw.get("warmup_lr_rate")
            if start is None:
                warm = (s + 1.0) / max(1.0, warmup)
            else:
                warm = start + (1.0 - start) * s / max(1, warmup - 1)
            decay = cosine_factor(s, kw.get("num_cycles", 0.5), rate, shift=1.0)
            return jnp.where(s < warmup, warm, decay)
        if name == "cosine_with_restarts":
            progress = (s - warmup) / max(1, total - warmup)
            cycle = jnp.mod(kw.get("num_cycles", 1) * progress, 1.0)
            hard = jnp.where(progress >= 1.0, 0.0, 0.5 * (1.0 + jnp.cos(jnp.pi * cycle)))
            return jnp.where(s < warmup, warm, jnp.maximum(0.0, hard))
        if name == "polynomial":
            lr_end, power = kw.get("lr_end", 1e-7), kw.get("power", 1.0)
            remaining = 1.0 - (s - warmup) / max(1, total - warmup)
            poly = ((learning_rate - lr_end) * remaining**power + lr_end) / learning_rate
            poly = jnp.where(s > total, lr_end / learning_rate, poly)
            return jnp.where(s < warmup, warm, poly)
        if name == "inverse_sqrt":
            timescale = kw.get("timescale") or warmup or 10_000
            decay = 1.0 / jnp.sqrt((s + timescale - warmup) / timescale)
            return jnp.where(s < warmup, warm, decay)
        # warmup_stable_decay
        decay_steps = kw["num_decay_steps"]
        stable = kw.get("num_stable_steps")
        stable = total - warmup - decay_steps if stable is None else stable
        min_ratio, cycles = kw.get("min_lr_ratio", 0.0), kw.get("num_cycles", 0.5)
        up = _shape(kw.get("warmup_type", "linear"), s / ramp, cycles, rising=True)
        down_progress = jnp.clip((s - warmup - stable) / max(1, decay_steps), 0.0, 1.0)
        down = _shape(kw.get("decay_type", "cosine"), down_progress, cycles, rising=False)
        up, down = (jnp.maximum(0.0, f * (1.0 - min_ratio) + min_ratio) for f in (up, down))
        return jnp.where(
            s < warmup,
            up,
            jnp.where(
                s < warmup + stable,
                1.0,
                jnp.where(s < warmup + stable + decay_steps, down, min_ratio),
            ),
        )

    def schedule(step):
        return learning_rate * factor(jnp.asarray(step, jnp.float32))

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
    elif optim == "adagrad":
        # torch.optim.Adagrad (HF's defaults: initial accumulator 0, eps 1e-10); decay is L2 as torch.
        tx = optax.chain(
            optax.add_decayed_weights(weight_decay, mask=decay_mask),
            optax.adagrad(schedule, initial_accumulator_value=0.0, eps=1e-10),
        )
    elif optim == "rmsprop":
        # torch.optim.RMSprop defaults (alpha 0.99, eps 1e-8 added outside the sqrt); L2 decay.
        tx = optax.chain(
            optax.add_decayed_weights(weight_decay, mask=decay_mask),
            optax.rmsprop(schedule, decay=0.99, eps=1e-8, eps_in_sqrt=False),
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


def masked_updates(mask: Any) -> optax.GradientTransformation:
    """Multiply updates by a 0/1 tree (frozen shared layers get exactly zero change)."""

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u, m: u * m.astype(u.dtype), updates, mask), state

    return optax.GradientTransformation(init, update)
