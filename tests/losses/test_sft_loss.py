"""SFT loss sums/counts: token-weighted, exact under any micro-batch split; TRL metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses import entropy, mean_of, mean_token_accuracy, sft_loss_sum


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    logps = -rng.exponential(1.0, (4, 7))
    mask = (rng.random((4, 7)) < 0.6).astype(np.float32)
    mask[0] = 0  # a sequence without loss tokens
    mask[1, :5] = 1
    return logps, mask


def test_nll_sum_and_count(data):
    logps, mask = data
    total, count = sft_loss_sum(jnp.asarray(logps), jnp.asarray(mask))
    np.testing.assert_allclose(total, -(logps * mask).sum(), rtol=1e-6)
    assert float(count) == mask.sum()


def test_micro_batches_sum_to_full_batch_token_mean(data):
    logps, mask = data
    full = mean_of(*sft_loss_sum(jnp.asarray(logps), jnp.asarray(mask)))
    parts = [
        sft_loss_sum(jnp.asarray(logps[i : i + 1]), jnp.asarray(mask[i : i + 1])) for i in range(4)
    ]
    split = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    np.testing.assert_allclose(split, full, rtol=1e-6)
    # A per-micro-batch mean (what token-unaware accumulation does) would differ here.
    per_micro = np.mean([float(mean_of(*p)) for p in parts])
    assert abs(per_micro - float(full)) > 1e-3


def test_dft_value_and_gradient(data):
    logps, mask = data
    total, _ = sft_loss_sum(jnp.asarray(logps), jnp.asarray(mask), loss_type="dft")
    np.testing.assert_allclose(total, -(logps * np.exp(logps) * mask).sum(), rtol=1e-6)
    grad = jax.grad(lambda lp: sft_loss_sum(lp, jnp.asarray(mask), loss_type="dft")[0])(
        jnp.asarray(logps)
    )
    # The probability weight is detached: d/dlogp = -p * mask.
    np.testing.assert_allclose(grad, -np.exp(logps) * mask, rtol=1e-5)


def test_metrics_sums_and_empty_batch(data):
    _, mask = data
    correct = np.arange(28).reshape(4, 7) % 3 == 0
    ent = np.linspace(0.1, 2.8, 28).reshape(4, 7)
    num_correct, n = mean_token_accuracy(jnp.asarray(correct), jnp.asarray(mask))
    ent_sum, n2 = entropy(jnp.asarray(ent), jnp.asarray(mask))
    assert float(num_correct) == (correct * mask).sum() and float(n) == float(n2) == mask.sum()
    np.testing.assert_allclose(ent_sum, (ent * mask).sum(), rtol=1e-6)
    assert float(mean_of(jnp.float32(3.0), jnp.float32(0.0))) == 0.0


def test_unknown_loss_type():
    with pytest.raises(ValueError, match="'nll', 'dft'"):
        sft_loss_sum(jnp.zeros((1, 2)), jnp.ones((1, 2)), loss_type="cross_entropy")
