"""Ref-sync and BEMA against a per-parameter numpy loop transcribing TRL's callbacks."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.core.averaging import (
    bema_init,
    bema_should_update,
    bema_update,
    sync_ref_should_update,
    sync_ref_update,
)


def random_params(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    tree = {
        "dense": {"kernel": rng.normal(size=(8, 16)), "bias": rng.normal(size=16)},
        "embed": rng.normal(size=(32, 8)),
    }
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


class NumpyBEMA:
    """TRL `BEMACallback` (on_train_begin / on_step_end) with one numpy buffer per parameter."""

    def __init__(
        self,
        params,
        update_freq,
        update_after,
        ema_power=0.5,
        bias_power=0.2,
        lag=10,
        multiplier=1.0,
        min_ema=0.0,
    ):
        self.cfg = (update_freq, update_after, ema_power, bias_power, lag, multiplier, min_ema)
        leaves = [np.array(x, np.float64) for x in jax.tree.leaves(params)]
        self.theta0 = [x.copy() for x in leaves]
        self.ema = [x.copy() for x in leaves]
        self.running = [x.copy() for x in leaves]

    def on_step_end(self, step, params):
        update_freq, update_after, ema_power, bias_power, lag, multiplier, min_ema = self.cfg
        if step < update_after:
            return
        leaves = [np.array(x, np.float64) for x in jax.tree.leaves(params)]
        if step == update_after:
            for i, p in enumerate(leaves):
                self.theta0[i] = p.copy()
                self.ema[i] = p.copy()
        elif (step - update_after) % update_freq == 0:
            beta = max((lag + multiplier * step) ** (-ema_power), min_ema)
            alpha = (lag + multiplier * step) ** (-bias_power)
            for i, p in enumerate(leaves):
                self.ema[i] = (1 - beta) * self.ema[i] + beta * p
                self.running[i] = self.ema[i] + alpha * (p - self.theta0[i])


@pytest.mark.parametrize(
    "update_freq,update_after,kwargs",
    [(1, 0, {}), (3, 4, {}), (2, 5, {"min_ema_multiplier": 0.3, "multiplier": 2.0, "lag": 3})],
)
def test_bema_matches_trl_loop(update_freq, update_after, kwargs):
    params = random_params(0)
    ref = NumpyBEMA(
        params,
        update_freq,
        update_after,
        lag=kwargs.get("lag", 10),
        multiplier=kwargs.get("multiplier", 1.0),
        min_ema=kwargs.get("min_ema_multiplier", 0.0),
    )
    state = bema_init(params)
    update = jax.jit(
        lambda s, p, step: bema_update(
            s, p, step, update_freq=update_freq, update_after=update_after, **kwargs
        )
    )
    changed_steps = []
    for step in range(1, 16):  # TRL's global_step after each optimizer step starts at 1
        params = jax.tree.map(
            lambda x, s=step: x + 0.1 * jnp.sin(s * x + 1.0), params
        )  # a fake optimizer step
        new_state = update(state, params, step)
        if any(
            not np.array_equal(a, b)
            for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state), strict=True)
        ):
            changed_steps.append(step)
        assert bool(bema_should_update(step, update_freq, update_after)) == (
            step in changed_steps[-1:]
        )
        state = new_state
        ref.on_step_end(step, params)
        chex.assert_trees_all_close(jax.tree.leaves(state.theta0), ref.theta0, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(jax.tree.leaves(state.ema), ref.ema, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(jax.tree.leaves(state.bema), ref.running, rtol=1e-5, atol=1e-6)
    snapshot = [update_after] if update_after > 0 else []
    assert changed_steps == snapshot + list(range(update_after + update_freq, 16, update_freq))


def test_bema_keeps_param_dtype_or_uses_requested_dtype():
    params = random_params(1, jnp.bfloat16)
    state = jax.jit(bema_update)(bema_init(params), params, 400)
    assert {x.dtype for x in jax.tree.leaves(state)} == {jnp.dtype(jnp.bfloat16)}
    state32 = bema_init(params, dtype=jnp.float32)
    assert {x.dtype for x in jax.tree.leaves(state32)} == {jnp.dtype(jnp.float32)}


def test_sync_ref_matches_loop_and_schedule():
    ref, policy = random_params(2), random_params(3)
    ref_np = [np.array(x, np.float64) for x in jax.tree.leaves(ref)]
    sync = jax.jit(sync_ref_update)
    for step in range(1, 9):
        policy = jax.tree.map(lambda x: x * 0.9 + 0.05, policy)
        if sync_ref_should_update(step, 4):
            ref = sync(ref, policy, 0.6)
            ref_np = [
                (1 - 0.6) * r + 0.6 * np.array(p, np.float64)
                for r, p in zip(ref_np, jax.tree.leaves(policy), strict=True)
            ]
    assert [s for s in range(1, 9) if sync_ref_should_update(s, 4)] == [4, 8]
    chex.assert_trees_all_close(jax.tree.leaves(ref), ref_np, rtol=1e-6, atol=1e-6)
    mixed16 = sync_ref_update(random_params(2, jnp.bfloat16), random_params(3), 0.5)
    assert {x.dtype for x in jax.tree.leaves(mixed16)} == {jnp.dtype(jnp.bfloat16)}


def test_sharded_equals_unsharded_and_keeps_shardings():
    assert jax.device_count() == 8, "conftest must provide 8 fake CPU devices"
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tensor"))
    specs = {
        "dense": {"kernel": PartitionSpec("fsdp", "tensor"), "bias": PartitionSpec("tensor")},
        "embed": PartitionSpec(None, "fsdp"),
    }
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    params, policy = random_params(4), random_params(5)
    sharded_params = jax.device_put(params, shardings)
    sharded_policy = jax.device_put(policy, shardings)

    state = bema_init(sharded_params)
    assert jax.tree.map(lambda x: x.sharding, state.ema) == shardings
    hp = {"update_freq": 2, "update_after": 1}
    update = jax.jit(lambda s, p, step: bema_update(s, p, step, **hp), donate_argnums=0)
    ref_update = jax.jit(lambda s, p, step: bema_update(s, p, step, **hp))
    ref_state = bema_init(params)
    for step in range(1, 6):
        state = update(state, sharded_policy, step)
        ref_state = ref_update(ref_state, policy, step)
    for buffers in state:
        assert jax.tree.map(lambda x: x.sharding, buffers) == shardings
    chex.assert_trees_all_close(state, ref_state, rtol=1e-6, atol=1e-7)

    synced = jax.jit(sync_ref_update)(sharded_params, sharded_policy, 0.6)
    assert jax.tree.map(lambda x: x.sharding, synced) == shardings
    chex.assert_trees_all_close(synced, sync_ref_update(params, policy, 0.6), rtol=1e-6, atol=1e-7)
