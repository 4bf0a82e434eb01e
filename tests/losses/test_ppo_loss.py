"""ppo_loss against a torch transcription of TRL v0.7.2 `PPOTrainer.loss` (values, stats and
gradients), and the ratio_threshold skip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl.losses.ppo import PPO_ARRAY_STATS, PPO_SCALAR_STATS, ppo_loss

RNG = np.random.default_rng(1)


@pytest.fixture(autouse=True)
def _fresh_rng():
    """Every test draws the same inputs whatever ran before it in its worker (xdist
    spreads the tests differently run to run)."""
    global RNG
    RNG = np.random.default_rng(1)


def _mm(v, m):
    return (v * m).sum() / m.sum()


def _mv(v, m):
    mean = _mm(v, m)
    n = m.sum()
    return _mm((v - mean) ** 2, m) * n / (n - 1)


def _trl_loss(old_logprobs, values, logits, vpreds, logprobs, mask, adv, returns, cfg):
    vpredclipped = torch.max(
        torch.min(vpreds, values + cfg["cliprange_value"]), values - cfg["cliprange_value"]
    )
    vf1, vf2 = (vpreds - returns) ** 2, (vpredclipped - returns) ** 2
    vf_loss = 0.5 * _mm(torch.max(vf1, vf2), mask)
    vf_clipfrac = _mm(torch.gt(vf2, vf1).float(), mask)
    ratio = torch.exp(logprobs - old_logprobs)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - cfg["cliprange"], 1.0 + cfg["cliprange"])
    pg_loss = _mm(torch.max(pg1, pg2), mask)
    pg_clipfrac = _mm(torch.gt(pg2, pg1).float(), mask)
    loss = pg_loss + cfg["vf_coef"] * vf_loss
    if _mm(ratio, mask).item() > cfg["ratio_threshold"]:
        pg_loss, vf_loss, loss = pg_loss * 0.0, vf_loss * 0.0, loss * 0.0
    pd = torch.softmax(logits, -1)
    entropy = _mm(torch.logsumexp(logits, -1) - (pd * logits).sum(-1), mask)
    stats = {
        "loss/policy": pg_loss,
        "loss/value": vf_loss,
        "loss/total": loss,
        "policy/entropy": entropy,
        "policy/approxkl": 0.5 * _mm((logprobs - old_logprobs) ** 2, mask),
        "policy/policykl": _mm(old_logprobs - logprobs, mask),
        "policy/clipfrac": pg_clipfrac,
        "policy/advantages": adv,
        "policy/advantages_mean": _mm(adv, mask),
        "policy/ratio": ratio,
        "returns/mean": _mm(returns, mask),
        "returns/var": _mv(returns, mask),
        "val/vpred": _mm(vpreds, mask),
        "val/error": _mm((vpreds - returns) ** 2, mask),
        "val/clipfrac": vf_clipfrac,
        "val/mean": _mm(values, mask),
        "val/var": _mv(values, mask),
    }
    return pg_loss + cfg["vf_coef"] * vf_loss, stats


def _inputs(B=3, T=6, V=11, spread=0.3):
    mask = np.zeros((B, T), np.float32)
    mask[0, 1:5] = 1
    mask[1, 0:6] = 1
    mask[2, 2:4] = 1
    f = lambda *s: RNG.normal(size=s).astype(np.float32)  # noqa: E731
    old = f(B, T) - 2
    return dict(
        old_logprobs=old,
        values=f(B, T),
        logits=f(B, T, V),
        vpreds=f(B, T) * 0.3,
        logprobs=old + spread * f(B, T),
        mask=mask,
        adv=f(B, T),
        returns=f(B, T),
    )


@pytest.mark.parametrize("ratio_threshold", [10.0, 0.5])
def test_ppo_loss_matches_trl_values_stats_and_grads(ratio_threshold):
    cfg = dict(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, ratio_threshold=ratio_threshold)
    x = _inputs()
    t = {k: torch.tensor(v, requires_grad=k in ("logprobs", "vpreds")) for k, v in x.items()}
    t_loss, t_stats = _trl_loss(
        t["old_logprobs"], t["values"], t["logits"], t["vpreds"], t["logprobs"], t["mask"],
        t["adv"], t["returns"], cfg,
    )  # fmt: skip
    t_loss.backward()
    logits = jnp.asarray(x["logits"])
    entropy = jax.nn.logsumexp(logits, -1) - jnp.sum(jax.nn.softmax(logits) * logits, -1)

    def f(logprobs, vpreds):
        return ppo_loss(
            x["old_logprobs"], x["values"], logprobs, vpreds, x["mask"], x["adv"], x["returns"],
            entropy, **cfg,
        )  # fmt: skip

    (loss, stats), (g_lp, g_v) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        jnp.asarray(x["logprobs"]), jnp.asarray(x["vpreds"])
    )
    np.testing.assert_allclose(loss, t_loss.item(), rtol=1e-5, atol=1e-7)
    assert set(stats) == {*PPO_SCALAR_STATS, *PPO_ARRAY_STATS, "ratio_skipped"}
    for k, v in t_stats.items():
        np.testing.assert_allclose(stats[k], v.detach().numpy(), rtol=1e-5, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(g_lp, t["logprobs"].grad.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g_v, t["vpreds"].grad.numpy(), rtol=1e-5, atol=1e-7)
    skipped = ratio_threshold < 1.0
    assert float(stats["ratio_skipped"]) == float(skipped)
    assert (float(jnp.abs(g_lp).sum()) == 0.0) == skipped


def test_clipping_kicks_in_for_large_ratio_moves():
    x = _inputs(spread=2.0)
    entropy = jnp.zeros_like(jnp.asarray(x["values"]))
    _, stats = ppo_loss(
        x["old_logprobs"], x["values"], x["logprobs"], x["values"] + 1.0, x["mask"], x["adv"],
        x["returns"], entropy, ratio_threshold=1e9,
    )  # fmt: skip
    assert 0 < float(stats["policy/clipfrac"]) < 1
    assert float(stats["val/clipfrac"]) > 0
