"""Reward-model loss and metrics against TRL `RewardTrainer.compute_loss` formulas (numpy)."""

import jax.numpy as jnp
import numpy as np

from jaxrl.losses import reward_loss, reward_metrics

RC = np.array([1.5, -0.2, 0.3, 2.0, 0.7])
RR = np.array([0.5, 0.4, 0.3, -1.0, 0.1])
MARGIN = np.array([0.5, 0.0, 1.0, 2.5, 0.2])


def logsig(x):
    return -np.logaddexp(0.0, -x)


def test_plain_bradley_terry():
    losses = reward_loss(jnp.asarray(RC), jnp.asarray(RR))
    np.testing.assert_allclose(losses, -logsig(RC - RR), rtol=1e-6)


def test_margin_and_centering_mean_equals_trl_loss():
    losses = reward_loss(
        jnp.asarray(RC),
        jnp.asarray(RR),
        margin_B=jnp.asarray(MARGIN),
        center_rewards_coefficient=0.01,
    )
    trl_loss = -logsig(RC - RR - MARGIN).mean() + 0.01 * np.mean((RC + RR) ** 2)
    np.testing.assert_allclose(losses.mean(), trl_loss, rtol=1e-6)
    np.testing.assert_allclose(losses[3], -logsig(0.5) + 0.01 * 1.0, rtol=1e-6)


def test_metrics():
    m = reward_metrics(jnp.asarray(RC), jnp.asarray(RR))
    # pair 2 is a tie: TRL counts `r_c > r_r`, so ties are wrong.
    np.testing.assert_allclose(m["accuracy"], 3 / 5)
    np.testing.assert_allclose(m["margin"], np.mean(RC - RR), rtol=1e-6)
    np.testing.assert_allclose(m["min_reward"], -1.0)
    np.testing.assert_allclose(m["max_reward"], 2.0)
    np.testing.assert_allclose(m["mean_reward"], np.concatenate([RC, RR]).mean(), rtol=1e-6)
