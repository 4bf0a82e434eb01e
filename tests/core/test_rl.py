"""jaxrl.core.rl against torch transcriptions of TRL v0.7.2's formulas (trl/core.py,
PPOTrainer.compute_rewards/compute_advantages, AdaptiveKLController, RunningMoments)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl.core import rl

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _fresh_rng():
    """Every test draws the same inputs whatever ran before it in its worker (xdist
    spreads the tests differently run to run)."""
    global RNG
    RNG = np.random.default_rng(0)


def _t(x):
    return torch.tensor(np.asarray(x))


def _torch_masked_mean(v, m):
    return (v * m).sum() / m.sum()


def _torch_masked_var(v, m):
    mean = _torch_masked_mean(v, m)
    var = _torch_masked_mean((v - mean) ** 2, m)
    n = m.sum()
    return var * n / (n - 1)


def _torch_masked_whiten(v, m, shift_mean=True):
    mean, var = _torch_masked_mean(v, m), _torch_masked_var(v, m)
    out = (v - mean) * torch.rsqrt(var + 1e-8)
    return out if shift_mean else out + mean


def _mask(B=3, T=7):
    m = np.zeros((B, T), np.float32)
    for b in range(B):
        s = RNG.integers(0, 3)
        m[b, s : s + RNG.integers(2, T - s + 1)] = 1
    return m


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_statistics_match_trl(shift_mean):
    v = RNG.normal(size=(3, 7)).astype(np.float32)
    m = _mask()
    # atol: a mean near 0 of unit-sized f32 values (summation order shows at ~1e-8)
    np.testing.assert_allclose(
        rl.masked_mean(v, m), _torch_masked_mean(_t(v), _t(m)), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(rl.masked_var(v, m), _torch_masked_var(_t(v), _t(m)), rtol=1e-5)
    np.testing.assert_allclose(
        rl.masked_whiten(v, m, shift_mean),
        _torch_masked_whiten(_t(v), _t(m), shift_mean),
        rtol=1e-5,
        atol=1e-6,
    )
    x = _t(v).flatten()
    ref = (x - x.mean()) * torch.rsqrt(torch.var(x) + 1e-8)
    np.testing.assert_allclose(rl.whiten(v.ravel()), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rl.masked_var(v, m, unbiased=False) > 0, True)


def test_clip_by_value_is_elementwise():
    x = jnp.array([-3.0, 0.5, 4.0])
    np.testing.assert_allclose(
        rl.clip_by_value(x, jnp.array([-1.0, 1.0, 0.0]), jnp.array([1.0, 2.0, 3.0])), [-1, 1, 3]
    )


@pytest.mark.parametrize("chunk", [None, 5, 16])
def test_entropy_from_logits(chunk):
    logits = RNG.normal(size=(2, 3, 13)).astype(np.float32) * 3
    lt = _t(logits).double()  # float64: float32 logsumexp - sum(p * l) cancels to ~2e-6
    pd = torch.softmax(lt, -1)
    ref = torch.logsumexp(lt, -1) - (pd * lt).sum(-1)
    np.testing.assert_allclose(rl.entropy_from_logits(logits, chunk), ref, rtol=1e-5, atol=1e-6)


def test_kl_penalties():
    lp, ref = (RNG.normal(size=(2, 5)).astype(np.float32) for _ in range(2))
    np.testing.assert_allclose(rl.kl_penalty(lp, ref, "kl"), lp - ref, rtol=1e-6)
    np.testing.assert_allclose(rl.kl_penalty(lp, ref, "abs"), np.abs(lp - ref), rtol=1e-6)
    np.testing.assert_allclose(rl.kl_penalty(lp, ref, "mse"), 0.5 * (lp - ref) ** 2, rtol=1e-6)
    full = torch.log_softmax(_t(RNG.normal(size=(2, 5, 11)).astype(np.float32)), -1)
    full_ref = torch.log_softmax(_t(RNG.normal(size=(2, 5, 11)).astype(np.float32)), -1)
    expected = torch.nn.functional.kl_div(full_ref, full, log_target=True, reduction="none").sum(-1)
    np.testing.assert_allclose(
        rl.kl_penalty(full.numpy(), full_ref.numpy(), "full"), expected, rtol=1e-6
    )
    with pytest.raises(ValueError, match="kl_penalty"):
        rl.kl_penalty(lp, ref, "bad")


def test_full_kl_from_hidden_matches_full_logits():
    h, h_ref = RNG.normal(size=(2, 9, 4)), RNG.normal(size=(2, 9, 4))
    w, w_ref = RNG.normal(size=(4, 17)), RNG.normal(size=(4, 17))
    h, h_ref, w, w_ref = (jnp.asarray(x, jnp.float32) for x in (h, h_ref, w, w_ref))
    expected = rl.kl_penalty(
        jax.nn.log_softmax(h @ w, -1), jax.nn.log_softmax(h_ref @ w_ref, -1), "full"
    )
    got = rl.full_kl_from_hidden(h, w, h_ref, w_ref, chunk_size=4)  # 9 is not a multiple of 4
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def _torch_compute_rewards(scores, kl, masks, kl_coef):
    rewards, nsr = [], []
    for score, k, mask in zip(scores, kl, masks, strict=True):
        non_score = -kl_coef * k
        nsr.append(non_score)
        reward = non_score.clone()
        reward[mask.nonzero()[-1]] += score
        rewards.append(reward)
    return torch.stack(rewards), torch.stack(nsr)


def _torch_compute_advantages(values, rewards, mask, gamma, lam, whiten_rewards):
    lastgaelam, rev = 0, []
    T = rewards.shape[-1]
    values, rewards = values * mask, rewards * mask
    if whiten_rewards:
        rewards = _torch_masked_whiten(rewards, mask, shift_mean=False)
    for t in reversed(range(T)):
        nextvalues = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        rev.append(lastgaelam)
    adv = torch.stack(rev[::-1]).transpose(0, 1)
    returns = adv + values
    return values, _torch_masked_whiten(adv, mask), returns


@pytest.mark.parametrize("whiten_rewards", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5)])
def test_rewards_and_advantages_match_trl(gamma, lam, whiten_rewards):
    B, T = 3, 7
    m = _mask(B, T)
    scores = RNG.normal(size=(B,)).astype(np.float32)
    kl = RNG.normal(size=(B, T)).astype(np.float32)
    values = RNG.normal(size=(B, T)).astype(np.float32)
    rewards, nsr = rl.compute_rewards(jnp.asarray(scores), jnp.asarray(kl), jnp.asarray(m), 0.2)
    t_rewards, t_nsr = _torch_compute_rewards(_t(scores), _t(kl), _t(m), 0.2)
    np.testing.assert_allclose(rewards, t_rewards, rtol=1e-6)
    np.testing.assert_allclose(nsr, t_nsr, rtol=1e-6)
    got = jax.jit(
        lambda v, r, mk: rl.compute_advantages(
            v, r, mk, gamma=gamma, lam=lam, whiten_rewards=whiten_rewards
        )
    )(jnp.asarray(values), rewards, jnp.asarray(m))
    want = _torch_compute_advantages(_t(values), t_rewards, _t(m), gamma, lam, whiten_rewards)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_adaptive_and_fixed_kl_controllers():
    ctl = rl.adaptive_kl_controller(0.2, target=6, horizon=10000)
    state = ctl.init()
    value = 0.2
    for kl in [3.0, 12.0, 6.5]:
        state = jax.jit(ctl.update, static_argnums=2)(state, kl, 256)
        value *= 1 + np.clip(kl / 6 - 1, -0.2, 0.2) * 256 / 10000
        np.testing.assert_allclose(state.value, value, rtol=1e-6)
    fixed = rl.fixed_kl_controller(0.1)
    assert float(fixed.update(fixed.init(), 100.0, 8).value) == pytest.approx(0.1)


def test_running_moments_match_trl():
    # TRL RunningMoments.update, transcribed
    mean, std, var, count = 0.0, 1.0, 1.0, 1e-24
    state = rl.running_moments_init()
    for _ in range(3):
        xs = RNG.normal(size=(5,)).astype(np.float32) * 3 + 1
        xt = torch.tensor(xs, dtype=torch.float64)
        xs_var, xs_mean = torch.var_mean(xt, unbiased=False)
        n = xt.numel()
        delta = xs_mean - mean
        tot = count + n
        old_sum = var * count + delta**2 * count * n / tot
        mean = mean + delta * n / tot
        var = (old_sum + xs_var * n) / tot
        std = (var * tot / (tot - 1)).sqrt()
        count = tot
        state, (bm, bs) = rl.running_moments_update(state, xs)
        np.testing.assert_allclose(bm, xs_mean, rtol=1e-5)
        np.testing.assert_allclose(bs, (xs_var * n / (n - 1)).sqrt(), rtol=1e-5)
        for got, want in zip(state, (mean, std, var, count), strict=True):
            np.testing.assert_allclose(got, float(want), rtol=1e-5)


def test_scale_scores_order_update_then_scale_then_clip():
    scores = jnp.array([1.0, 3.0, -2.0, 10.0])
    moments = rl.running_moments_init()
    out, new = rl.scale_scores(
        scores, moments, use_score_scaling=True, use_score_norm=True, score_clip=1.0
    )
    # The current batch is included before scaling: mean/std are this batch's (count ~ 4).
    expected = (scores - scores.mean()) / (jnp.std(scores, ddof=1) + jnp.finfo(jnp.float32).eps)
    np.testing.assert_allclose(out, jnp.clip(expected, -1, 1), rtol=1e-5)
    np.testing.assert_allclose(new.count, 4.0)
    same, _ = rl.scale_scores(
        scores, moments, use_score_scaling=False, use_score_norm=False, score_clip=None
    )
    np.testing.assert_array_equal(same, scores)
