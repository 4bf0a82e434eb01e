"""algos.distill: TRL 1.16's generalised JSD (forward KL at beta 0, reverse KL at beta 1, the
mixture JSD between) against a NumPy hand computation over the full vocabulary, chunked or not,
with temperature and soft-capping; its gradient against the unchunked formula's; and the loss
function of one micro-batch (tiny models, no trainer): TRL's token sum over the loss tokens."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algos import distill
from tests.algos.tiny_lm import (
    TinyLM,
    np_completion_logits,
    np_log_softmax,
    rollout_batch,
    tiny_params,
)

B, C, D, E, V = 3, 7, 5, 6, 11


def _np_divergence(zs, zt, beta):
    """TRL's per-token divergence from both models' tempered logits, written out by hand."""
    log_ps, log_pt = np_log_softmax(zs), np_log_softmax(zt)
    ps, pt = np.exp(log_ps), np.exp(log_pt)
    if beta == 0.0:
        return (pt * (log_pt - log_ps)).sum(-1)
    if beta == 1.0:
        return (ps * (log_ps - log_pt)).sum(-1)
    m = (1 - beta) * ps + beta * pt
    kl_t = (pt * (log_pt - np.log(m))).sum(-1)
    kl_s = (ps * (log_ps - np.log(m))).sum(-1)
    return beta * kl_t + (1 - beta) * kl_s


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(B, C, D)).astype(np.float32),
        rng.normal(size=(D, V)).astype(np.float32),
        rng.normal(size=(B, C, E)).astype(np.float32),
        (1.5 * rng.normal(size=(E, V))).astype(np.float32),
    )


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.2])
@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_divergence_matches_the_hand_formula(beta, chunk_size, softcap):
    hs, ws, ht, wt = _arrays()
    T = 0.7
    div, ent = distill.generalized_jsd_from_hidden(
        hs, ws, ht, wt, beta=beta, temperature=T, chunk_size=chunk_size,
        student_logit_softcap=softcap, teacher_logit_softcap=softcap,
    )  # fmt: skip
    zs = hs.astype(np.float64) @ ws
    zt = ht.astype(np.float64) @ wt
    if softcap is not None:
        zs, zt = softcap * np.tanh(zs / softcap), softcap * np.tanh(zt / softcap)
    zs, zt = zs / T, zt / T
    want = _np_divergence(zs, zt, beta)
    assert div.shape == (B, C)
    np.testing.assert_allclose(np.asarray(div), want, rtol=2e-5, atol=2e-6)
    log_ps = np_log_softmax(zs)
    np.testing.assert_allclose(
        np.asarray(ent), -(np.exp(log_ps) * log_ps).sum(-1), rtol=2e-5, atol=2e-6
    )
    assert np.all(np.asarray(div) >= -1e-6)


def test_divergences_differ_by_beta_and_vanish_for_identical_models():
    hs, ws, ht, wt = _arrays(1)
    values = [
        np.asarray(distill.generalized_jsd_from_hidden(hs, ws, ht, wt, beta=b)[0])
        for b in (0.0, 0.5, 1.0)
    ]
    assert not np.allclose(values[0], values[2])
    assert np.all(values[1] <= np.log(2) + 1e-6)  # the JSD is bounded by log 2
    same = distill.generalized_jsd_from_hidden(hs, ws, hs, ws, beta=0.5)[0]
    np.testing.assert_allclose(np.asarray(same), 0.0, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gradient_through_the_chunked_scan_equals_the_direct_formula(beta):
    hs, ws, ht, wt = _arrays(2)
    mask = np.ones((B, C), np.float32)
    mask[0, 4:] = 0

    def chunked(hs, ws):
        div, _ = distill.generalized_jsd_from_hidden(hs, ws, ht, wt, beta=beta, chunk_size=2)
        return jnp.sum(div * mask)

    def direct(hs, ws):
        log_ps = jax.nn.log_softmax(hs @ ws, -1)
        log_pt = jax.nn.log_softmax(ht @ wt, -1)
        return jnp.sum(distill.divergence_from_log_probs(log_ps, log_pt, beta) * mask)

    g1 = jax.grad(chunked, argnums=(0, 1))(hs, ws)
    g2 = jax.grad(direct, argnums=(0, 1))(hs, ws)
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    # No gradient reaches the teacher.
    gt = jax.grad(
        lambda h: jnp.sum(distill.generalized_jsd_from_hidden(hs, ws, h, wt, beta=beta)[0])
    )(ht)
    assert not np.any(np.asarray(gt))


def test_bad_beta_and_temperature_are_refused():
    hs, ws, ht, wt = _arrays()
    with pytest.raises(ValueError, match="beta"):
        distill.generalized_jsd_from_hidden(hs, ws, ht, wt, beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        distill.generalized_jsd_from_hidden(hs, ws, ht, wt, beta=0.5, temperature=0.0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_loss_fn_sums_the_divergence_of_the_loss_tokens(beta):
    student_p, teacher_p = tiny_params(0), tiny_params(7)
    batch = rollout_batch(0)
    T = 0.9
    config = SimpleNamespace(beta=beta, temperature=T, logprob_chunk_size=2)
    loss_fn = distill.make_loss(config, lambda p, s: TinyLM(p), TinyLM)
    teacher_hidden = distill.make_teacher_hidden(TinyLM)(teacher_p, batch)
    mb = {**{k: jnp.asarray(v) for k, v in batch.items()}, distill.TEACHER_HIDDEN: teacher_hidden}
    state = SimpleNamespace(frozen={distill.TEACHER: teacher_p})
    loss_sum, (aux, _) = loss_fn(student_p, state, mb, None, None)

    zs, _ = np_completion_logits(student_p, batch, temperature=T)
    zt, _ = np_completion_logits(teacher_p, batch, temperature=T)
    per_token = _np_divergence(zs, zt, beta)
    m = batch["completion_mask"].astype(np.float64)
    np.testing.assert_allclose(float(loss_sum), (per_token * m).sum(), rtol=1e-5)
    assert float(aux["count"]["loss"]) == m.sum()
    log_ps = np_log_softmax(zs)
    ent = -(np.exp(log_ps) * log_ps).sum(-1)
    np.testing.assert_allclose(float(aux["sum"]["entropy"]), (ent * m).sum() / m.sum(), rtol=1e-5)
    assert float(distill.loss_units({"completion_mask": batch["completion_mask"][None]})) == m.sum()
