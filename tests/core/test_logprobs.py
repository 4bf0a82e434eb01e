"""Chunked token log-probs equal the naive full-vocab computation (values, stats, gradients)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxprs import equations

from jaxrl.core.logprobs import resolve_chunk_size, shift_targets, token_logprobs

B, T, D, V = 2, 13, 16, 37


def naive(hidden, unembed, targets, temperature=1.0, softcap=None):
    logits = jnp.einsum("btd,dv->btv", hidden.astype(jnp.float32), unembed.astype(jnp.float32))
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    logits = logits / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    p = jnp.exp(logp)
    stats = {
        "argmax_correct": jnp.argmax(logits, -1) == targets,
        "entropy": -jnp.sum(p * logp, -1),
        "logit_mean": logits.mean(-1),
        "log_sum_sq_probs": jnp.log(jnp.sum(p * p, -1)),
    }
    return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0], stats


# The reference as one program per shape and options (run eagerly, it compiled one per
# primitive and shape); `naive` itself stays a plain function for the traced uses below.
naive_jit = jax.jit(naive, static_argnums=(3, 4))


@functools.cache
def naive_grad(temperature, softcap):
    """Gradient of `sum(naive log-probs x weights)` w.r.t. hidden and unembedding, jitted once
    per temperature and soft-cap (the gradient tests' chunk sizes share it)."""

    def full(h, w, targets, weights):
        return jnp.sum(naive(h, w, targets, temperature, softcap)[0] * weights)

    return jax.jit(jax.grad(full, argnums=(0, 1)))


@pytest.fixture(scope="module")
@jax.jit  # one program, not one per primitive and shape
def inputs():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(k1, (B, T, D))
    unembed = jax.random.normal(k2, (D, V)) * 0.5
    targets = jax.random.randint(k3, (B, T), 0, V)
    # Make some targets the argmax so `argmax_correct` is exercised both ways.
    logits = jnp.einsum("btd,dv->btv", hidden, unembed)
    targets = targets.at[:, ::3].set(jnp.argmax(logits, -1)[:, ::3])
    return hidden, unembed, targets


@pytest.mark.parametrize("chunk_size", [4, 13, 128])  # ragged (13 = 3*4 + 1), exact, larger than T
def test_values_and_stats_match_naive(inputs, chunk_size):
    hidden, unembed, targets = inputs
    # Jitted, as the trainers run it: one program per chunk size (eagerly, one per primitive).
    logps, stats = jax.jit(
        lambda h, w: token_logprobs(h, w, targets, chunk_size=chunk_size, with_stats=True)
    )(hidden, unembed)
    ref, ref_stats = naive_jit(hidden, unembed, targets)
    assert logps.shape == (B, T) and logps.dtype == jnp.float32
    np.testing.assert_allclose(logps, ref, atol=1e-5, rtol=1e-5)
    assert bool(jnp.all(stats["argmax_correct"] == ref_stats["argmax_correct"]))
    assert 0 < int(stats["argmax_correct"].sum()) < B * T
    for name in ("entropy", "logit_mean", "log_sum_sq_probs"):
        np.testing.assert_allclose(stats[name], ref_stats[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [4, 16])  # 4 chunks (recomputed), one chunk (kept logits)
@pytest.mark.parametrize(
    ("temperature", "softcap", "with_stats"), [(1.0, None, False), (0.7, 3.0, True)]
)
def test_gradients_match_naive(inputs, temperature, softcap, with_stats, chunk_size):
    """The fused head's own VJP (onehot - softmax, through temperature and soft-capping) equals
    autodiff of the full-vocab computation; the statistics add no gradient."""
    hidden, unembed, targets = inputs
    weights = jax.random.normal(jax.random.key(5), (B, T))

    def chunked(h, w):
        out = token_logprobs(
            h, w, targets, chunk_size=chunk_size, temperature=temperature,
            logit_softcap=softcap, with_stats=with_stats,
        )  # fmt: skip
        logps, stats = out if with_stats else (out, {})
        return jnp.sum(logps * weights) + sum(
            jnp.sum(v) for k, v in stats.items() if k == "entropy"
        )

    g_chunked = jax.jit(jax.grad(chunked, argnums=(0, 1)))(hidden, unembed)
    g_full = naive_grad(temperature, softcap)(hidden, unembed, targets, weights)
    for a, b in zip(g_chunked, g_full, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_temperature_and_softcap(inputs):
    hidden, unembed, targets = inputs
    logps = jax.jit(
        lambda h, w: token_logprobs(h, w, targets, chunk_size=5, temperature=0.7, logit_softcap=3.0)
    )(hidden, unembed)
    np.testing.assert_allclose(
        logps, naive_jit(hidden, unembed, targets, 0.7, 3.0)[0], atol=1e-5, rtol=1e-5
    )


def test_bf16_head_rounds_logits_like_autocast(inputs):
    """A bf16 unembedding is a bf16 LM head (torch autocast, TRL's fused head): f32 hidden states
    are cast to bf16 and the logits rounded to bf16 before the f32 softmax."""
    hidden, unembed, targets = inputs
    w16 = unembed.astype(jnp.bfloat16)

    @jax.jit  # the head's log-probs and their gradients in one program
    def ours(h, w):
        head = lambda h, w: token_logprobs(h, w, targets, chunk_size=4)  # noqa: E731
        return head(h, w), jax.grad(lambda h, w: head(h, w).sum(), argnums=(0, 1))(h, w)

    logps, grads = ours(hidden, w16)
    assert logps.dtype == jnp.float32

    @jax.jit  # the references in one program, not one per primitive and shape
    def references(hidden, unembed, w16):
        h16 = hidden.astype(jnp.bfloat16).astype(jnp.float32)
        logits = jnp.einsum("btd,dv->btv", h16, w16.astype(jnp.float32))
        rounded = jax.nn.log_softmax(logits.astype(jnp.bfloat16).astype(jnp.float32), axis=-1)
        want = jnp.take_along_axis(rounded, targets[..., None], -1)[..., 0]
        unrounded = naive(h16, w16, targets)[0]
        ref_grads = jax.grad(lambda h, w: naive(h, w, targets)[0].sum(), argnums=(0, 1))(
            hidden, unembed
        )
        # As TRL's fused head: the logits gradient is rounded to bf16, the hidden one is not.
        onehot = jax.nn.one_hot(targets, V)
        g16 = (onehot - jnp.exp(rounded)).astype(jnp.bfloat16).astype(jnp.float32)
        dh = jnp.einsum("btv,dv->btd", g16, w16.astype(jnp.float32))
        return want, unrounded, ref_grads, dh

    want, unrounded, ref_grads, dh = references(hidden, unembed, w16)
    np.testing.assert_allclose(logps, want, atol=1e-5, rtol=1e-5)
    assert float(jnp.max(jnp.abs(logps - unrounded))) > 1e-3  # the rounding is really there
    assert grads[0].dtype == jnp.float32 and grads[1].dtype == jnp.bfloat16
    for a, b in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=0.1, rtol=0.05)
    # The hidden-state gradient is the one from bf16-rounded logits gradients (dh).
    np.testing.assert_allclose(grads[0], dh, atol=1e-5, rtol=1e-5)


def test_never_materialises_full_f32_logits():
    b, t, d, v, chunk = 2, 128, 16, 2048, 16
    hidden = jnp.ones((b, t, d))
    unembed = jnp.ones((d, v))
    targets = jnp.zeros((b, t), jnp.int32)
    full_logits_bytes = b * t * v * 4

    def temp_bytes(fn):
        grad_fn = jax.jit(jax.grad(lambda h, w: fn(h, w).sum(), argnums=(0, 1)))
        return grad_fn.lower(hidden, unembed).compile().memory_analysis().temp_size_in_bytes

    chunked = temp_bytes(
        lambda h, w: token_logprobs(h, w, targets, chunk_size=chunk, with_stats=True)[0]
    )
    full = temp_bytes(lambda h, w: naive(h, w, targets)[0])
    assert full >= full_logits_bytes  # sanity: the naive backward holds [B, T, V] f32
    assert chunked < full_logits_bytes / 2, (chunked, full_logits_bytes)


def test_shift_targets():
    ids = jnp.array([[5, 6, 7, 8]])
    mask = jnp.array([[0, 0, 1, 1]])
    targets, shifted = shift_targets(ids, mask)
    np.testing.assert_array_equal(targets, [[6, 7, 8, 0]])
    np.testing.assert_array_equal(shifted, [[0, 1, 1, 0]])


def test_shape_mismatch_message(inputs):
    hidden, unembed, targets = inputs
    with pytest.raises(ValueError, match="embedding.T"):
        token_logprobs(hidden, unembed.T, targets)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])  # two passes; one online-softmax reduce
def test_sharded_batch_and_vocab_equal_unsharded(backend, monkeypatch):
    """A vocabulary sharded over `tensor` gives the unsharded values, whichever reductions the
    backend's path runs (XLA partitions the online-softmax reduce's custom merge too)."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))
    rng = np.random.default_rng(7)
    hidden = jnp.asarray(rng.normal(size=(4, 9, D)), jnp.float32)
    unembed = jnp.asarray(rng.normal(size=(D, 40)) * 0.5, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 40, (4, 9)))
    h = jax.device_put(hidden, NamedSharding(mesh, PartitionSpec("data")))
    w = jax.device_put(unembed, NamedSharding(mesh, PartitionSpec(None, "tensor")))
    t = jax.device_put(targets, NamedSharding(mesh, PartitionSpec("data")))
    fn = jax.jit(lambda h, w, t: token_logprobs(h, w, t, chunk_size=4, with_stats=True))
    logps, stats = fn(h, w, t)
    ref, ref_stats = naive_jit(hidden, unembed, targets)
    np.testing.assert_allclose(logps, ref, atol=1e-5, rtol=1e-5)
    for name in ("entropy", "logit_mean", "log_sum_sq_probs"):
        np.testing.assert_allclose(stats[name], ref_stats[name], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(stats["argmax_correct"], ref_stats["argmax_correct"])
    assert logps.sharding.spec[0] == "data"


@pytest.mark.parametrize(
    "seq_len, chunk_size, num_chunks, chunk",
    [(129, 128, 2, 65), (128, 128, 1, 128), (300, 128, 3, 100), (5, 128, 1, 5), (13, 4, 4, 4)],
)
def test_chunks_are_balanced(seq_len, chunk_size, num_chunks, chunk):
    """ceil(T / chunk_size) chunks of ceil(T / num_chunks): a 129-token row is 2 x 65, not
    2 x 128 (which would compute almost twice the logits)."""
    hidden = jnp.ones((1, seq_len, D))
    targets = jnp.zeros((1, seq_len), jnp.int32)
    jaxpr = jax.make_jaxpr(
        lambda h: token_logprobs(h, jnp.ones((D, V)), targets, chunk_size=chunk_size)
    )(hidden)
    # The fused head's custom-VJP call takes the chunked hidden states and scans over the chunks
    # (one chunk: no loop).
    (head,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name.startswith("custom_vjp")]
    hidden_chunks = [v.aval.shape for v in head.invars if v.aval.shape[-1:] == (D,)]
    assert hidden_chunks == [(num_chunks, 1, chunk, D)]
    scans = [e for e in head.params["call_jaxpr"].jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == ([] if num_chunks == 1 else [num_chunks])


@pytest.mark.parametrize(
    "backend, head, chunk_size, batch, seq_len, vocab, want",
    [
        ("cpu", jnp.bfloat16, None, 8, 1024, 151936, 128),  # CPU: cache-sized chunks
        ("gpu", jnp.bfloat16, None, 8, 1024, 151936, 1024),  # 2.5 GB of bf16 logits: one chunk
        ("gpu", jnp.bfloat16, None, 32, 1024, 151936, 441),  # 2**31 // (32 * 151936) positions
        ("gpu", jnp.float32, None, 8, 1024, 151936, 883),  # f32 logits: 2**30 // (8 * 151936)
        ("tpu", jnp.bfloat16, None, 8, 1024, 151936, 883),  # TPU's head GEMM writes f32
        ("tpu", jnp.bfloat16, None, 4096, 8, 10**6, 1),  # never below one position
        ("gpu", jnp.bfloat16, 64, 8, 1024, 151936, 64),  # an explicit size is kept everywhere
        ("cpu", jnp.float32, 7, 1, 5, 10, 7),
    ],
)
def test_chunk_size_resolves_per_backend(
    monkeypatch, backend, head, chunk_size, batch, seq_len, vocab, want
):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert resolve_chunk_size(chunk_size, batch, seq_len, vocab, head) == want


def test_default_chunk_on_cpu_is_128_positions():
    """`chunk_size=None` (the config default) on CPU runs 300 positions as 3 x 100."""
    hidden = jnp.ones((1, 300, D))
    targets = jnp.zeros((1, 300), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda h: token_logprobs(h, jnp.ones((D, V)), targets))(hidden)
    (head,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name.startswith("custom_vjp")]
    (scan,) = [e for e in head.params["call_jaxpr"].jaxpr.eqns if e.primitive.name == "scan"]
    assert scan.params["length"] == 3


@pytest.mark.parametrize("bad", [0, -3])
def test_chunk_size_below_one_is_rejected(bad):
    with pytest.raises(ValueError, match="chunk_size must be >= 1 or None"):
        token_logprobs(
            jnp.ones((1, 4, D)), jnp.ones((D, V)), jnp.zeros((1, 4), jnp.int32), chunk_size=bad
        )


def _count(jaxpr, name: str) -> int:
    """Equations named `name` in a jaxpr and every jaxpr nested in its equations' params."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _count(inner, name)
    return n


@pytest.mark.parametrize(("chunk_size", "matmuls"), [(16, 3), (4, 4)])
def test_one_chunk_keeps_its_logits_for_the_backward(inputs, chunk_size, matmuls):
    """The head's forward + backward traces three matmuls (logits; hidden and weight gradients)
    when the sequence is one chunk, and four (the logits once more) when it is several: each
    scan body is traced once, so these are the matmuls per chunk."""
    hidden, unembed, targets = inputs
    grad = jax.grad(
        lambda h, w: token_logprobs(h, w, targets, chunk_size=chunk_size).sum(), argnums=(0, 1)
    )
    assert _count(jax.make_jaxpr(grad)(hidden, unembed).jaxpr, "dot_general") == matmuls


def test_forward_alone_keeps_no_logits(inputs):
    """Without differentiation (a reference forward) the one-chunk head outputs no logits."""
    hidden, unembed, targets = inputs
    jaxpr = jax.make_jaxpr(lambda h, w: token_logprobs(h, w, targets, chunk_size=16))(
        hidden, unembed
    )
    (head,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name.startswith("custom_vjp")]
    eqns = head.params["call_jaxpr"].jaxpr.eqns
    # One chunk runs without a loop; its logits [B, C, V] exist, but no chunk-stacked copy
    # [1, B, C, V] (kept for a backward) is made.
    assert not [e for e in eqns if e.primitive.name == "scan"]
    assert any(v.aval.shape[-1:] == (V,) for e in eqns for v in e.outvars)
    assert not [v for e in eqns for v in e.outvars if v.aval.ndim == 4 and v.aval.shape[-1] == V]


def _vocab_reduction_names(jaxpr) -> list[str]:
    """Reductions of any kind over a `[..., V]` operand, in a jaxpr and the jaxprs nested in it."""
    return [
        eqn.primitive.name
        for eqn in equations(jaxpr)
        if eqn.primitive.name.startswith(("reduce", "argm"))
        and any(getattr(v.aval, "shape", ())[-1:] == (V,) for v in eqn.invars)
    ]


def _head_fn(targets, with_stats=True):
    """A new function per call: JAX caches traces per function, and the tests below trace the
    same head under two backends."""
    return lambda h, w: token_logprobs(h, w, targets, chunk_size=16, with_stats=with_stats)


def test_head_statistics_without_argmax_reduce(inputs):
    """On CPU the statistics are the row max, then plain sums and a first-index-of-max `min`
    (vectorised reductions), no `argmax` (an index-carrying reduce about twice as slow there)."""
    hidden, unembed, targets = inputs
    names = _vocab_reduction_names(jax.make_jaxpr(_head_fn(targets))(hidden, unembed).jaxpr)
    assert names.count("reduce_max") == 1
    assert sorted(set(names)) == ["reduce_max", "reduce_min", "reduce_sum"]


@pytest.mark.parametrize("with_stats", [False, True])
def test_head_reads_the_logits_once_on_accelerators(inputs, monkeypatch, with_stats):
    """On GPU/TPU the forward reduces over the vocabulary once: an online-softmax reduce for
    log Z, every statistic and the argmax (`logsumexp` + `argmax` + a sum per statistic made
    five reads of the logits). Same values as the CPU path and the naive one."""
    hidden, unembed, targets = inputs
    cpu_out = jax.jit(_head_fn(targets, with_stats))(hidden, unembed)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    run = _head_fn(targets, with_stats)
    names = _vocab_reduction_names(jax.make_jaxpr(run)(hidden, unembed).jaxpr)
    assert names == ["reduce"]
    out = jax.jit(run)(hidden, unembed)  # traced under the GPU backend (a new function)
    logps, stats = out if with_stats else (out, None)
    cpu_logps, cpu_stats = cpu_out if with_stats else (cpu_out, None)
    ref, ref_stats = naive_jit(hidden, unembed, targets)
    np.testing.assert_allclose(logps, ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(logps, cpu_logps, atol=1e-6, rtol=1e-6)
    if with_stats:
        np.testing.assert_array_equal(stats["argmax"], cpu_stats["argmax"])
        assert bool(jnp.all(stats["argmax_correct"] == ref_stats["argmax_correct"]))
        for name in ("entropy", "logit_mean", "log_sum_sq_probs"):
            np.testing.assert_allclose(stats[name], ref_stats[name], atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(stats[name], cpu_stats[name], atol=1e-5, rtol=1e-5)


def test_argmax_statistic_ties_nans_and_infinities(monkeypatch):
    """`argmax` agrees with `jnp.argmax`: first index on ties, a row with NaNs gives its first
    NaN, a row of -inf gives index 0."""
    from jaxrl.core.logprobs import _chunk_softmax

    nan, inf = jnp.nan, jnp.inf
    rows = jnp.array(
        [
            [1.0, 3.0, 3.0, 2.0, 3.0],
            [-inf, -inf, -inf, -inf, -inf],
            [0.0, nan, 5.0, nan, 1.0],
            [inf, 2.0, inf, -inf, 0.0],
            [-1.0, -2.0, -3.0, -0.5, -0.5],
        ]
    )[None]
    rand = jax.random.normal(jax.random.key(1), (3, 7, 301)).round(1)  # many ties
    for backend in ("cpu", "gpu"):  # two passes of plain reductions; one online reduce
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)

        # One program per backend (a new function each, traced under that backend) for both
        # inputs' statistic and jnp.argmax, instead of one per primitive and shape.
        @jax.jit
        def argmaxes(rows, rand):
            return [
                (_chunk_softmax(x, jnp.zeros(x.shape[:2], jnp.int32), True)[2]["argmax"],
                 jnp.argmax(x, -1))
                for x in (rows, rand)
            ]  # fmt: skip

        for got, want in argmaxes(rows, rand):
            np.testing.assert_array_equal(got, want)
