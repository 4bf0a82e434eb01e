"""Parameter averaging as pure pytree updates: TR-DPO reference sync and BEMA.

optax style: NamedTuple state, pure `init` / `update` functions, jit-able on sharded pytrees
(every op is elementwise, so outputs keep the parameters' shardings). Host callbacks decide
*when* to call them (`sync_ref_should_update`, `bema_should_update`) and own the schedule
hyper-parameters; no training math lives in callbacks.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.core.shapes import same_tree_shapes

PyTree = Any


def _mix(old: jax.Array, new: jax.Array, weight_new: jax.Array | float) -> jax.Array:
    """`(1 - w) * old + w * new` in f32, cast back to `old`'s dtype (one rounding for bf16)."""
    mixed = (1 - weight_new) * old.astype(jnp.float32) + weight_new * new.astype(jnp.float32)
    return mixed.astype(old.dtype)


def sync_ref_should_update(step: int | jax.Array, ref_model_sync_steps: int) -> bool | jax.Array:
    """TRL `SyncRefModelCallback`: sync after optimizer steps where `step % sync_steps == 0`."""
    return step % ref_model_sync_steps == 0


def sync_ref_update(ref_params: PyTree, policy_params: PyTree, alpha: float | jax.Array) -> PyTree:
    """TR-DPO (Gorbatovski 2024) soft update: `ref <- alpha * policy + (1 - alpha) * ref`.

    TRL `ref_model_mixup_alpha` (default 0.6). Each leaf keeps the reference leaf's dtype.
    """
    same_tree_shapes("sync_ref_update", ref_params=ref_params, policy_params=policy_params)
    return jax.tree.map(lambda ref, pol: _mix(ref, pol, alpha), ref_params, policy_params)


class BEMAState(NamedTuple):
    """BEMA buffers: `theta0` (snapshot), `ema` and `bema` (the weights to evaluate/export)."""

    theta0: PyTree
    ema: PyTree
    bema: PyTree


def bema_init(params: PyTree, *, dtype: jnp.dtype | None = None) -> BEMAState:
    """All three buffers start as copies of the initial params (TRL `on_train_begin`).

    `dtype=None` keeps each leaf's dtype, as TRL does (it clones the parameters); pass
    `jnp.float32` for f32 buffers. The buffers are fresh arrays, so donating `params` to a train
    step never invalidates them.
    """

    def copy(x):
        return jnp.array(x, dtype=dtype or x.dtype, copy=True)

    return BEMAState(
        theta0=jax.tree.map(copy, params),
        ema=jax.tree.map(copy, params),
        bema=jax.tree.map(copy, params),
    )


def bema_should_update(
    step: int | jax.Array, update_freq: int = 400, update_after: int = 0
) -> bool | jax.Array:
    """Whether `bema_update` changes the state after optimizer step `step` (TRL global_step >= 1).

    True at the snapshot step `step == update_after` and at `step = update_after + k * update_freq`
    (k >= 1). With `update_after=0` there is no snapshot step (TRL's first `on_step_end` has
    step 1), so `theta0` stays the initial weights.
    """
    since = step - update_after
    return (since == 0) | ((since > 0) & (since % update_freq == 0))


def bema_update(
    state: BEMAState,
    params: PyTree,
    step: int | jax.Array,
    *,
    update_freq: int = 400,
    update_after: int = 0,
    ema_power: float = 0.5,
    bias_power: float = 0.2,
    lag: int = 10,
    multiplier: float = 1.0,
    min_ema_multiplier: float = 0.0,
) -> BEMAState:
    """TRL `BEMACallback.on_step_end` for optimizer step `step` (BEMA, Block & Zhang 2025).

    - `step < update_after` or off-schedule: state unchanged.
    - `step == update_after` (only reachable when > 0): `theta0 = ema = params`; `bema` untouched.
    - `step = update_after + k * update_freq`, k >= 1, with t = `step` (the global step, not the
      steps since `update_after`): `beta = max((lag + multiplier * t) ** -ema_power,
      min_ema_multiplier)`, `alpha = (lag + multiplier * t) ** -bias_power`,
      `ema <- (1 - beta) * ema + beta * params`, `bema <- ema + alpha * (params - theta0)`.

    Arithmetic is f32, results are cast to the buffer dtype. Safe to call every step under jit
    (`step` may be traced); or call it only when `bema_should_update` is true.
    """
    same_tree_shapes("bema_update", ema=state.ema, params=params)
    step = jnp.asarray(step)
    since = step - update_after
    # 0: no-op, 1: snapshot, 2: EMA/BEMA update.
    branch = jnp.where(since == 0, 1, jnp.where((since > 0) & (since % update_freq == 0), 2, 0))
    t = (lag + multiplier * step).astype(jnp.float32)
    beta = jnp.maximum(t ** (-ema_power), min_ema_multiplier)
    alpha = t ** (-bias_power)

    def keep(state, params):
        return state

    def snapshot(state, params):
        theta0 = jax.tree.map(lambda b, p: p.astype(b.dtype), state.theta0, params)
        ema = jax.tree.map(lambda b, p: p.astype(b.dtype), state.ema, params)
        return BEMAState(theta0=theta0, ema=ema, bema=state.bema)

    def update(state, params):
        ema = jax.tree.map(lambda e, p: _mix(e, p, beta), state.ema, params)

        def bema_leaf(b, e, p, t0):
            value = e.astype(jnp.float32) + alpha * (p.astype(jnp.float32) - t0.astype(jnp.float32))
            return value.astype(b.dtype)

        bema = jax.tree.map(bema_leaf, state.bema, ema, params, state.theta0)
        return BEMAState(theta0=state.theta0, ema=ema, bema=bema)

    return jax.lax.switch(branch, (keep, snapshot, update), state, params)
