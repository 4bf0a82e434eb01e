"""`token_logprobs(..., entropy_grad=True)`: the fused head's backward carries the entropy
statistic's gradient (GRPO's entropy bonus) along with the log-probs', equal to autodiff of the
full-vocabulary computation, on the CPU path and the accelerator (online-softmax) path, with no
extra matmul."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxprs import primitive_names

from jaxrl.core.logprobs import token_logprobs

B, T, D, V = 2, 13, 16, 37
# The entropy bonus's coefficient (loss = policy part - COEF x mean entropy), large enough that
# the entropy's share of the gradient is comparable to the log-probs'.
COEF = 10.0


@pytest.fixture(scope="module")
@jax.jit  # one program, not one per primitive and shape
def inputs():
    k = jax.random.split(jax.random.key(3), 5)
    hidden = jax.random.normal(k[0], (B, T, D))
    unembed = jax.random.normal(k[1], (D, V)) * 0.5
    targets = jax.random.randint(k[2], (B, T), 0, V)
    weights = jax.random.normal(k[3], (B, T))  # the log-probs' cotangent
    mask = (jax.random.uniform(k[4], (B, T)) < 0.7).astype(jnp.float32)
    return hidden, unembed, targets, weights, mask


def dense(hidden, unembed, targets, temperature, softcap):
    """Log-probs and entropies from the full `[B, T, V]` logits (plain autodiff)."""
    logits = jnp.einsum("btd,dv->btv", hidden, unembed)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0], entropy


def _loss(logps, entropy, weights, mask, coef=COEF):
    mean_entropy = jnp.sum(entropy * mask) / jnp.sum(mask)
    return jnp.sum(logps * weights) - coef * mean_entropy


@functools.cache
def _dense_reference(temperature, softcap):
    """The dense reference's loss, its gradients w.r.t. the hidden states and the unembedding,
    and the entropy term's own gradient w.r.t. the hidden states: one jitted program per
    temperature and soft-cap, shared by the backends and chunk sizes (it depends on neither)."""

    def reference(h, w, targets, weights, mask):
        return _loss(*dense(h, w, targets, temperature, softcap), weights, mask)

    def run(h, w, targets, weights, mask):
        value, grads = jax.value_and_grad(reference, argnums=(0, 1))(h, w, targets, weights, mask)
        bonus_only = jax.grad(reference)(h, w, targets, 0.0, mask)
        return value, grads, bonus_only

    return jax.jit(run)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])  # two passes; one online-softmax reduce
@pytest.mark.parametrize("chunk_size", [4, 16])  # 4 chunks, 3 padded rows (recomputed); one kept
@pytest.mark.parametrize(("temperature", "softcap"), [(0.7, 3.0), (1.0, None)])
def test_entropy_bonus_gradient_equals_dense_autodiff(
    inputs, monkeypatch, backend, chunk_size, temperature, softcap
):
    """Gradient of `sum(w x logp) - c x masked mean entropy` w.r.t. the hidden states and the
    unembedding through the fused head equals `jax.grad` of the dense reference, through
    temperature and soft-capping, for ragged chunks and a single kept chunk."""
    hidden, unembed, targets, weights, mask = inputs
    monkeypatch.setattr(jax, "default_backend", lambda: backend)

    def fused(h, w):
        logps, stats = token_logprobs(
            h, w, targets, chunk_size=chunk_size, with_stats=True, temperature=temperature,
            logit_softcap=softcap, entropy_grad=True,
        )  # fmt: skip
        return _loss(logps, stats["entropy"], weights, mask)

    grad = jax.grad(fused, argnums=(0, 1))
    # The accelerator branch really runs: one online-softmax `reduce` in the forward.
    assert ("reduce" in primitive_names(jax.make_jaxpr(grad)(hidden, unembed).jaxpr)) == (
        backend == "gpu"
    )
    # The fused loss (its primal, undifferentiated path) and its gradient in one program.
    value, got = jax.jit(lambda h, w: (fused(h, w), grad(h, w)))(hidden, unembed)
    want_value, want, bonus_only = _dense_reference(temperature, softcap)(
        hidden, unembed, targets, weights, mask
    )
    np.testing.assert_allclose(value, want_value, 1e-5)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # The entropy's own share of the gradient (the reference's with zero log-prob weights) is
    # far above the tolerance.
    assert float(jnp.max(jnp.abs(bonus_only))) > 0.1


@pytest.mark.parametrize(("chunk_size", "matmuls"), [(16, 3), (4, 4)])
def test_entropy_gradient_adds_no_matmul(inputs, chunk_size, matmuls):
    """The entropy's gradient rides the log-probs' backward: forward + backward trace the same
    matmuls as the log-probs alone (logits, once more when recomputed; hidden and weight
    gradients), and the same single scan each way over several chunks (one chunk: none)."""
    hidden, unembed, targets, weights, mask = inputs

    def loss(h, w):
        logps, stats = token_logprobs(
            h, w, targets, chunk_size=chunk_size, with_stats=True, entropy_grad=True
        )
        return _loss(logps, stats["entropy"], weights, mask)

    names = primitive_names(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(hidden, unembed).jaxpr)
    assert names.count("dot_general") == matmuls
    assert names.count("scan") == (0 if chunk_size >= hidden.shape[1] else 2)


def test_other_statistics_stay_without_gradient(inputs):
    """With `entropy_grad` only the entropy is differentiated: a loss on `logit_mean` and
    `log_sum_sq_probs` has zero gradient."""
    hidden, unembed, targets, _, _ = inputs

    def loss(h):
        _, stats = token_logprobs(
            h, unembed, targets, chunk_size=4, with_stats=True, entropy_grad=True
        )
        return jnp.sum(stats["logit_mean"]) + jnp.sum(stats["log_sum_sq_probs"])

    np.testing.assert_array_equal(jax.jit(jax.grad(loss))(hidden), 0.0)


def test_entropy_grad_needs_with_stats(inputs):
    hidden, unembed, targets, _, _ = inputs
    with pytest.raises(ValueError, match="pass with_stats=True"):
        token_logprobs(hidden, unembed, targets, entropy_grad=True)


EPS = 0.3  # the label smoothing of the uniform-NLL test


def _smoothed_loss(logps, uniform, entropy, mask, with_entropy):
    smoothed = (1 - EPS) * jnp.sum(-logps * mask) + EPS * jnp.sum(uniform * mask)
    bonus = COEF * jnp.sum(entropy * mask) / jnp.sum(mask)  # GRPO's entropy bonus
    return smoothed - (bonus if with_entropy else 0.0)


@functools.cache
def _smoothed_reference(with_entropy):
    """The full log-softmax reference's smoothed loss and its gradients: one jitted program per
    `with_entropy`, shared by the backends and chunk sizes (it depends on neither)."""

    def reference(h, w, targets, mask):
        logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, w) / 0.7, axis=-1)
        logps = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
        uniform, entropy = -jnp.mean(logp, -1), -jnp.sum(jnp.exp(logp) * logp, -1)
        return _smoothed_loss(logps, uniform, entropy, mask, with_entropy)

    return jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("chunk_size", [4, 16])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_uniform_nll_gradient_equals_dense_autodiff(
    inputs, monkeypatch, backend, chunk_size, with_entropy
):
    """HF label smoothing's per-token term -(1/V) sum_v log p_v (`uniform_nll`) with its
    gradient through the fused head (`uniform_nll_grad`), alone and with the entropy's, equals
    autodiff of the full log-softmax; the unsmoothed program stays without that gradient."""
    hidden, unembed, targets, weights, mask = inputs
    monkeypatch.setattr(jax, "default_backend", lambda: backend)

    def fused(h, w):
        logps, stats = token_logprobs(
            h, w, targets, chunk_size=chunk_size, with_stats=True, temperature=0.7,
            entropy_grad=with_entropy, uniform_nll_grad=True,
        )  # fmt: skip
        return _smoothed_loss(logps, stats["uniform_nll"], stats["entropy"], mask, with_entropy)

    def unsmoothed(h):  # the same loss without `uniform_nll_grad`: that term has no gradient
        logps, stats = token_logprobs(h, unembed, targets, chunk_size=chunk_size, with_stats=True)
        return jnp.sum(stats["uniform_nll"] * mask)

    @jax.jit  # the fused loss (its undifferentiated path), its gradients and the unsmoothed one
    def run(h, w):
        return fused(h, w), jax.grad(fused, argnums=(0, 1))(h, w), jax.grad(unsmoothed)(h)

    value, got, unsmoothed_grad = run(hidden, unembed)
    want_value, want = _smoothed_reference(with_entropy)(hidden, unembed, targets, mask)
    np.testing.assert_allclose(value, want_value, 1e-5)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(unsmoothed_grad))) == 0.0
