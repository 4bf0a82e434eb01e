"""DDPO clipped loss, approx_kl, clipfrac, advantage clipping and the per-prompt stat tracker
(TRL v0.7.2 semantics; the tracker against tests/golden/ddpo_trl072.json)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses.ddpo import PerPromptStatTracker, ddpo_loss, normalize_rewards

GOLDEN = json.loads(
    (Path(__file__).resolve().parents[1] / "golden" / "ddpo_trl072.json").read_text()
)


def test_trl_unit_case_loss_is_one():
    # TRL tests/test_ddpo_trainer.py test_loss: advantage -1, ratio 1 -> loss 1.
    out = ddpo_loss(jnp.zeros(1), jnp.zeros(1), -jnp.ones(1), clip_range=1e-4, adv_clip_max=5.0)
    assert float(out.loss) == 1.0
    assert float(out.approx_kl) == 0.0
    assert float(out.clipfrac) == 0.0


def test_loss_formula_clipping_and_kl():
    logp = jnp.array([0.0, 0.0, 0.0, 0.0])
    old = jnp.array([-0.1, 0.1, -0.1, 0.1])  # ratios e^0.1, e^-0.1, e^0.1, e^-0.1
    adv = jnp.array([2.0, 2.0, -8.0, -8.0])  # -8 is clipped to -5
    out = ddpo_loss(logp, old, adv, clip_range=0.05, adv_clip_max=5.0)
    r_hi, r_lo = np.exp(0.1), np.exp(-0.1)
    # max(-A r, -A clip(r)): pessimistic side of the clip for each sign of A.
    want = np.mean([-2 * 1.05, -2 * r_lo, 5 * r_hi, 5 * 0.95])
    np.testing.assert_allclose(out.loss, want, rtol=1e-6)
    np.testing.assert_allclose(out.approx_kl, 0.5 * 0.01, rtol=1e-6)
    assert float(out.clipfrac) == 1.0
    assert float(ddpo_loss(logp, old, adv, clip_range=0.2).clipfrac) == 0.0


def test_loss_gradient_is_zero_where_clipped():
    old = jnp.array([-0.1, -0.1])
    adv = jnp.array([1.0, -1.0])
    # ratio e^0.1 > 1 + clip: for A > 0 the clipped (constant) branch wins -> no gradient;
    # for A < 0 the unclipped branch wins -> gradient -A * ratio / 2.
    grad = jax.grad(lambda lp: ddpo_loss(lp, old, adv, clip_range=0.05).loss)(jnp.zeros(2))
    np.testing.assert_allclose(grad, [0.0, 0.5 * np.exp(0.1)], rtol=1e-6)


def test_normalize_rewards_uses_population_std():
    r = np.array([1.0, 2.0, 4.0])
    np.testing.assert_allclose(normalize_rewards(r), (r - r.mean()) / (np.std(r) + 1e-8))


def test_stat_tracker_matches_trl():
    golden = GOLDEN["stat_tracker"]
    tracker = PerPromptStatTracker(golden["buffer_size"], golden["min_count"])
    for step in golden["steps"]:
        adv = tracker.update(step["prompts"], np.asarray(step["rewards"]))
        np.testing.assert_allclose(adv, step["advantages"], rtol=1e-12)
    stats = tracker.get_stats()
    assert stats.keys() == golden["stats"].keys()
    for prompt, want in golden["stats"].items():
        assert stats[prompt]["count"] == want["count"]
        assert stats[prompt]["mean"] == pytest.approx(want["mean"])
        assert stats[prompt]["std"] == pytest.approx(want["std"])
