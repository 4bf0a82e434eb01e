"""The one generic train step: gradient accumulation, clipping, mixed precision, donation.

Algorithms inject a loss function; the step owns everything else. A loss function is

    loss_fn(params, state, micro_batch, rng, extras) -> (loss_sum, (aux, extras))

where `loss_sum` is the *unnormalised* sum of the per-unit losses of the micro-batch (per token
for SFT, per pair for DPO/reward) and `aux` is a dict of reductions:
`{"sum": {...}, "count": {...}, "min": {...}, "max": {...}}`. `aux["count"]["loss"]` is the number
of loss units. The step adds sums and counts over micro-batches and divides once at the end, so
loss and gradients are those of the full batch whatever the accumulation factor (token-weighted,
not the mean of micro-batch means that makes HF's loss change with accumulation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxrl.core.state import TrainState

LossFn = Callable[..., tuple[jax.Array, tuple[dict, Any]]]

_GROWTH_INTERVAL = 2000  # HF GradScaler defaults


def reduce_aux(aux_A: dict) -> dict[str, jax.Array]:
    """Collapse per-micro-batch reductions (leading axis A) into final metric values."""
    out = {}
    counts = aux_A.get("count", {})
    for name, s in aux_A.get("sum", {}).items():
        out[name] = jnp.sum(s) / jnp.maximum(jnp.sum(counts[name]), 1)
    for name, v in aux_A.get("min", {}).items():
        out[name] = jnp.min(v)
    for name, v in aux_A.get("max", {}).items():
        out[name] = jnp.max(v)
    for name, v in aux_A.get("total", {}).items():
        out[name] = jnp.sum(v)
    return out


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    schedule: Callable | None = None,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """Build `train_step(state, batch)`; batch leaves have a leading micro-batch axis [A, ...]."""

    def grads_and_aux(state: TrainState, batch_A: dict, rng: jax.Array):
        scale = state.loss_scale[0] if state.loss_scale is not None else None

        def scaled_loss(params, mb, key, extras):
            loss_sum, (aux, extras) = loss_fn(params, state, mb, key, extras)
            scaled = loss_sum * scale if scale is not None else loss_sum
            return scaled, (aux, extras)

        grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

        def micro(carry, xs):
            grads_acc, extras = carry
            mb, i = xs
            (_, (aux, extras)), g = grad_fn(state.params, mb, jax.random.fold_in(rng, i), extras)
            grads_acc = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads_acc, g)
            return (grads_acc, extras), aux

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
        n_micro = jax.tree.leaves(batch_A)[0].shape[0]
        (grads, extras), aux_A = jax.lax.scan(
            micro, (zeros, state.extras), (batch_A, jnp.arange(n_micro))
        )
        count = jnp.maximum(jnp.sum(aux_A["count"]["loss"]), 1)
        denom = count * scale if scale is not None else count
        grads = jax.tree.map(lambda g: g / denom, grads)
        return grads, aux_A, extras

    def train_step(state: TrainState, batch_A: dict) -> tuple[TrainState, dict]:
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        grads, aux_A, extras = grads_and_aux(state, batch_A, rng)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        loss_scale = state.loss_scale
        if loss_scale is not None:
            # fp16: skip the update on overflow and halve the scale; grow it after a run of
            # finite steps (torch.amp.GradScaler semantics).
            keep = lambda new, old: jax.tree.map(  # noqa: E731
                lambda n, o: jnp.where(finite, n, o), new, old
            )
            params = keep(params, state.params)
            opt_state = keep(opt_state, state.opt_state)
            scale, good = loss_scale
            good = jnp.where(finite, good + 1, 0)
            grow = good >= _GROWTH_INTERVAL
            scale = jnp.where(finite, jnp.where(grow, scale * 2, scale), scale / 2)
            loss_scale = (scale, jnp.where(grow, 0, good))
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            extras=extras,
            loss_scale=loss_scale,
        )
        metrics = reduce_aux(aux_A)
        metrics["grad_norm"] = grad_norm
        if loss_scale is not None:
            # An overflowing fp16 step is expected and skipped, not a divergence: log the scale
            # and a zero grad norm so the NaN check only stops runs whose loss is non-finite.
            metrics["grad_norm"] = jnp.where(finite, grad_norm, 0.0)
            metrics["loss_scale"] = loss_scale[0]
        if schedule is not None:
            metrics["learning_rate"] = schedule(new_state.step)
        return new_state, metrics

    return train_step


def make_eval_step(loss_fn: LossFn) -> Callable[[TrainState, dict], dict]:
    """Forward-only step returning the un-reduced aux of one batch (leading axis A)."""

    def eval_step(state: TrainState, batch_A: dict) -> dict:
        rng = jax.random.wrap_key_data(state.rng)

        def micro(extras, xs):
            mb, i = xs
            _, (aux, _) = loss_fn(state.params, state, mb, jax.random.fold_in(rng, i), extras)
            return extras, aux

        n_micro = jax.tree.leaves(batch_A)[0].shape[0]
        _, aux_A = jax.lax.scan(micro, state.extras, (batch_A, jnp.arange(n_micro)))
        return aux_A

    return eval_step
