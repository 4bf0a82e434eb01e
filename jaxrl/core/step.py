"""The one generic train step, in two halves: loss-and-grads (gradient accumulation over
micro-batches) and apply-grads (clipping via the optimizer, fp16 loss scaling, in-step state
updates such as reference sync). The offline step composes the two; on-policy updates call them
inside their own epoch x minibatch scans.

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

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxrl.core import loops
from jaxrl.core.state import TrainState

LossFn = Callable[..., tuple[jax.Array, tuple[dict, Any]]]

_GROWTH_INTERVAL = 2000  # HF GradScaler defaults


def reduce_aux(aux_A: dict) -> dict[str, jax.Array]:
    """Collapse per-micro-batch reductions (leading axis A) into final metric values."""
    out = {}
    counts = aux_A.get("count", {})
    for name, s in aux_A.get("sum", {}).items():
        out[name] = jnp.sum(s) / jnp.maximum(jnp.sum(counts[name]), 1)
    # NaN-ignoring, NaN when every micro-batch's is (TRL's nanmin/nanmax: a min over no value,
    # e.g. every completion masked, is NaN and is left out).
    for name, v in aux_A.get("min", {}).items():
        out[name] = jnp.nanmin(v)
    for name, v in aux_A.get("max", {}).items():
        out[name] = jnp.nanmax(v)
    for name, v in aux_A.get("total", {}).items():
        out[name] = jnp.sum(v)
    return out


StateUpdate = Callable[[TrainState], TrainState]


# Micro-batch key set by `make_loss_and_grads(loss_units=...)`: the batch's loss-unit count over
# the number of micro-batches. A loss function adds a per-micro-batch mean term `m` (HF adds it
# to each micro-batch's loss, divided by the accumulation steps: the MoE load-balancing loss) as
# `m * mb[UNITS_PER_MICRO]` to its sum, which the step then divides by the unit count.
UNITS_PER_MICRO = "loss_units_per_micro_batch"


def make_loss_and_grads(
    loss_fn: LossFn, loss_units: Callable[[dict], jax.Array] | None = None
) -> Callable[[TrainState, dict, jax.Array], tuple[Any, dict, Any]]:
    """Build `loss_and_grads(state, batch_A, rng) -> (grads, aux_A, extras)`.

    Micro-batches (leading axis A) run as a `lax.scan`; gradients are summed in f32 and divided
    once by the total loss-unit count (and the fp16 loss scale), so they are the gradients of the
    full batch whatever A is. `aux_A` keeps the per-micro-batch reductions (see `reduce_aux`).
    `loss_units(batch_A)`, when given, is that count computed from the batch before the scan;
    every micro-batch then carries it over A under `UNITS_PER_MICRO`.
    """

    def loss_and_grads(state: TrainState, batch_A: dict, rng: jax.Array):
        scale = state.loss_scale[0] if state.loss_scale is not None else None
        n_micro = jax.tree.leaves(batch_A)[0].shape[0]
        if loss_units is not None:
            per_micro = jnp.maximum(loss_units(batch_A).astype(jnp.float32), 1) / n_micro
            batch_A = {**batch_A, UNITS_PER_MICRO: jnp.full((n_micro,), per_micro)}

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
        (grads, extras), aux_A = loops.scan(
            micro, (zeros, state.extras), (batch_A, jnp.arange(n_micro))
        )
        count = jnp.maximum(jnp.sum(aux_A["count"]["loss"]), 1)
        denom = count * scale if scale is not None else count
        grads = jax.tree.map(lambda g: g / denom, grads)
        return grads, aux_A, extras

    return loss_and_grads


def make_apply_grads(
    tx: optax.GradientTransformation,
    schedule: Callable | None = None,
    state_updates: Sequence[StateUpdate] = (),
) -> Callable[[TrainState, Any, Any], tuple[TrainState, dict]]:
    """Build `apply_grads(state, grads, extras) -> (state, metrics)`: one optimizer update.

    The transformation `tx` owns clipping and the learning rate. fp16 runs skip non-finite
    updates. After the update (`state.step` is then the number of updates done, HF's
    `global_step`), each `state_updates` function runs in order: pure `state -> state` updates
    that decide *inside* the step whether to act (e.g. TR-DPO reference sync as a `lax.cond` on
    the step count), so no host code rewrites the state between steps.
    """

    def apply_grads(state: TrainState, grads: Any, extras: Any) -> tuple[TrainState, dict]:
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
        for update in state_updates:
            new_state = update(new_state)
        metrics = {"grad_norm": grad_norm}
        if loss_scale is not None:
            # An overflowing fp16 step is expected and skipped, not a divergence: log the scale
            # and a zero grad norm so the NaN check only stops runs whose loss is non-finite.
            metrics["grad_norm"] = jnp.where(finite, grad_norm, 0.0)
            metrics["loss_scale"] = loss_scale[0]
        if schedule is not None:
            metrics["learning_rate"] = schedule(new_state.step)
        return new_state, metrics

    return apply_grads


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    schedule: Callable | None = None,
    state_updates: Sequence[StateUpdate] = (),
    loss_units: Callable[[dict], jax.Array] | None = None,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """The offline step: `loss_and_grads` then `apply_grads`; batch leaves are [A, ...]."""
    loss_and_grads = make_loss_and_grads(loss_fn, loss_units)
    apply_grads = make_apply_grads(tx, schedule, state_updates)

    def train_step(state: TrainState, batch_A: dict) -> tuple[TrainState, dict]:
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        grads, aux_A, extras = loss_and_grads(state, batch_A, rng)
        new_state, update_metrics = apply_grads(state, grads, extras)
        return new_state, {**reduce_aux(aux_A), **update_metrics}

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
        _, aux_A = loops.scan(micro, state.extras, (batch_A, jnp.arange(n_micro)))
        return aux_A

    return eval_step
