"""algos.rloo: the RLOO loss function of one micro-batch (tiny model, no trainer) against a NumPy
hand computation of TRL's RLOO: the leave-one-out baseline of a KL-shaped reward, the clipped
surrogate on the sequence log-prob ratio, the eval batch's ratio 1, and the loss-unit count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algos import rloo
from jaxrl.losses.rloo import rloo_advantages, rloo_sequence_kl
from jaxrl.trainers.rloo_config import RLOOConfig
from tests.algos.tiny_lm import TinyLM, np_logprobs_and_entropy, rollout_batch, tiny_params

TEMPERATURE = 0.8


def _apply(params, state):
    del state
    return TinyLM(params)


def _config(**kw) -> RLOOConfig:
    defaults = dict(output_dir="unused", temperature=TEMPERATURE, logprob_chunk_size=2)
    return RLOOConfig(**{**defaults, **kw})


def _rollout(seed: int = 0):
    params, batch = tiny_params(seed), rollout_batch(seed)
    logp, entropy = np_logprobs_and_entropy(params, batch, temperature=TEMPERATURE)
    rng = np.random.default_rng(seed + 50)
    old = (logp + rng.uniform(-0.3, 0.3, logp.shape)).astype(np.float32)
    ref = (logp + rng.uniform(-0.3, 0.3, logp.shape)).astype(np.float32)
    return params, batch, logp, entropy, old, ref


def _np_leave_one_out(rewards_N, G):
    """Each completion's reward minus the mean of its group's other completions, by loops."""
    adv = np.zeros_like(rewards_N)
    for start in range(0, len(rewards_N), G):
        group = rewards_N[start : start + G]
        for i in range(G):
            others = [group[j] for j in range(G) if j != i]
            adv[start + i] = group[i] - sum(others) / len(others)
    return adv


def test_leave_one_out_advantages_of_the_kl_shaped_reward_then_the_loss():
    params, batch, logp, entropy, old, ref = _rollout()
    m = batch["completion_mask"].astype(np.float64)
    beta, eps, eps_high = 0.05, 0.2, 0.28
    rewards_NK = np.array([[1.0, 0.5], [0.0, 2.0], [3.0, -1.0], [0.5, 0.5]], np.float32)
    weights_K = np.array([1.0, 0.5], np.float32)
    kl_N, _ = rloo_sequence_kl(old, ref, batch["completion_mask"])
    adv_N, _ = rloo_advantages(rewards_NK, weights_K, num_generations=2, beta=beta, kl_N=kl_N)

    # By hand: reward = weighted sum - beta * sum_t (old - ref); baseline = the sibling's reward.
    reward = rewards_NK.astype(np.float64) @ weights_K - beta * ((old - ref) * m).sum(-1)
    want_adv = _np_leave_one_out(reward, G=2)
    np.testing.assert_allclose(adv_N, want_adv, rtol=1e-5, atol=1e-6)

    c = _config(epsilon=eps, epsilon_high=eps_high)
    mb = {**batch, "advantages": np.asarray(adv_N), "old_logps": old}
    loss, (aux, extras) = jax.jit(rloo.make_loss(c, _apply))(params, None, mb, None, {"x": 0})
    ratio = np.exp((logp * m).sum(-1) - (old * m).sum(-1))
    assert (ratio < 1 - eps).any() or (ratio > 1 + eps_high).any()  # the clip acts
    A = want_adv
    want = -np.minimum(ratio * A, np.clip(ratio, 1 - eps, 1 + eps_high) * A)
    np.testing.assert_allclose(float(loss), want.sum(), rtol=2e-5, atol=1e-6)
    assert float(aux["count"]["loss"]) == 4.0
    np.testing.assert_allclose(
        float(aux["sum"]["entropy"] / aux["count"]["entropy"]), (entropy * m).sum() / m.sum(),
        rtol=1e-5,
    )  # fmt: skip
    low = ((ratio < 1 - eps) & (A < 0)).mean()
    high = ((ratio > 1 + eps_high) & (A > 0)).mean()
    np.testing.assert_allclose(float(aux["sum"]["clip_ratio/low_mean"]) / 4, low)
    np.testing.assert_allclose(float(aux["sum"]["clip_ratio/high_mean"]) / 4, high)
    assert int(extras["x"]) == 0


@pytest.mark.parametrize("G", [3, 4])
def test_leave_one_out_baseline_of_larger_groups(G):
    rng = np.random.default_rng(G)
    rewards_NK = rng.normal(size=(2 * G, 1)).astype(np.float32)
    adv, _ = rloo_advantages(rewards_NK, np.ones(1, np.float32), num_generations=G, beta=0.0)
    np.testing.assert_allclose(
        adv, _np_leave_one_out(rewards_NK[:, 0].astype(np.float64), G), rtol=1e-5, atol=1e-6
    )


def test_eval_batch_without_old_logps_has_ratio_one():
    params, batch, *_ = _rollout(1)
    adv = np.array([0.5, -1.0, 2.0, -0.25], np.float32)
    loss, (aux, _) = rloo.make_loss(_config(), _apply)(
        params, None, {**batch, "advantages": adv}, None, {}
    )
    np.testing.assert_allclose(float(loss), -adv.sum(), rtol=1e-6)
    assert float(aux["sum"]["clip_ratio/region_mean"]) == 0.0


def test_loss_units_count_the_steps_rows():
    batch_A = {"advantages": jnp.zeros((3, 4)), "completion_mask": jnp.ones((3, 4, 2))}
    assert float(rloo.loss_units(batch_A)) == 12.0
