"""The generic train step on a toy loss: exact accumulation, fp16 loss scaling that skips
overflowing updates, and learning-rate schedules equal to transformers' lambdas."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl.core import optim
from jaxrl.core.state import TrainState
from jaxrl.core.step import make_train_step


def toy_loss(params, state, mb, rng, extras):
    """Per-row squared error; `count` = rows, so the step averages over the whole batch."""
    err_B = jnp.sum((mb["x"] @ params["w"] - mb["y"]) ** 2, axis=-1)
    loss_sum = jnp.sum(err_B)
    n = jnp.float32(err_B.shape[0])
    return loss_sum, ({"sum": {"loss": loss_sum}, "count": {"loss": n}}, extras)


def batch(a: int, b: int, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(a * b, 3)).astype(np.float32) * scale
    y = rng.normal(size=(a * b, 2)).astype(np.float32)
    return {"x": jnp.asarray(x.reshape(a, b, 3)), "y": jnp.asarray(y.reshape(a, b, 2))}


def test_accumulation_equals_full_batch():
    tx = optax.sgd(0.1)
    params = {"w": jnp.ones((3, 2))}
    step = jax.jit(make_train_step(toy_loss, tx))
    s1, m1 = step(TrainState.create(params, tx, seed=0), batch(1, 8))
    s8, m8 = step(TrainState.create(params, tx, seed=0), batch(8, 1))
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-6)
    np.testing.assert_allclose(m8["grad_norm"], m1["grad_norm"], rtol=1e-6)
    np.testing.assert_allclose(s8.params["w"], s1.params["w"], rtol=1e-6)


def test_fp16_overflow_skips_update_and_halves_scale():
    tx = optax.sgd(0.1)
    params = {"w": jnp.ones((3, 2), jnp.float16)}
    step = jax.jit(make_train_step(toy_loss, tx))
    state = TrainState.create(params, tx, seed=0, fp16=True)
    big = batch(1, 4, scale=300.0)  # loss * 2**16 overflows float16
    new, metrics = step(state, big)
    assert float(metrics["grad_norm"]) == 0.0 and float(metrics["loss_scale"]) == 2.0**15
    np.testing.assert_array_equal(new.params["w"], params["w"])  # update skipped
    assert float(new.loss_scale[0]) == 2.0**15
    ok, _ = step(new.replace(loss_scale=(jnp.float32(1.0), jnp.int32(0))), batch(1, 4))
    assert not np.array_equal(ok.params["w"], params["w"])
    assert int(ok.loss_scale[1]) == 1


@pytest.mark.parametrize("name", ["linear", "cosine", "constant", "constant_with_warmup"])
def test_schedules_match_transformers(name):
    torch = pytest.importorskip("torch")
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    hf = get_scheduler(name, opt, num_warmup_steps=5, num_training_steps=40)
    ours = optim.make_schedule(name, 3e-4, 40, 5)
    for step in range(40):
        np.testing.assert_allclose(float(ours(step)), hf.get_last_lr()[0], rtol=1e-5, atol=1e-12)
        opt.step()
        hf.step()


def test_weight_decay_skips_biases_and_norms():
    params = {"dense": {"kernel": 1, "bias": 1}, "input_layernorm": {"scale": 1}}
    mask = optim.decay_mask(params)
    assert mask == {"dense": {"kernel": True, "bias": False}, "input_layernorm": {"scale": False}}
