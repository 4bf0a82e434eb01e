"""Model dropout (`jaxrl.models.dropout`): torch parity under the same masks, the attention
kernels' dropout (blockwise == XLA == an explicit reference, values and gradients), invariance
to block size, scanning and mesh, forwards that never drop, and the kernels that refuse it."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

from jaxrl.models import attention, from_pretrained, save_pretrained
from jaxrl.models import dropout as md
from jaxrl.models.blockwise_attention import blockwise_attention
from jaxrl.models.kv_cache import CacheView, init_cache
from jaxrl.models.masks import attention_mask_BTS
from jaxrl.parallel import make_mesh
from tests.models.conftest import TINY, VOCAB, _build, padded_batch

# Rates well above the checkpoints' 0.1 so that every site changes the outputs visibly.
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, attn_pdrop=0.3, resid_pdrop=0.2, embd_pdrop=0.25,
    ),
    # embd_pdrop is read by no module of transformers' Phi-3: set, it must change nothing.
    "phi3": lambda: transformers.Phi3Config(
        **TINY, attention_dropout=0.3, resid_pdrop=0.2, embd_pdrop=0.25
    ),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, attention_dropout=0.3),
}  # fmt: skip


@pytest.fixture(scope="module")
def dropout_ref(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = _build(
                CONFIGS[family], {}, tmp_path_factory.mktemp(f"{family}_dropout"),
                transformers.AutoModelForCausalLM, seed=40 + len(cache),
            )  # fmt: skip
        return cache[family]

    return get


def expected_masks(config, key, batch, seq_len):
    """(keep mask, rate) of every dropout site of one forward, in the order torch calls
    `nn.functional.dropout` (embeddings, then per layer: probabilities, attention output, MLP
    output), materialised from jaxrl's key derivation and mask functions."""
    shape = (batch, seq_len, config.hidden_size)
    rates = []
    if config.embedding_dropout:
        rates.append((None, md.EMBEDDING, config.embedding_dropout))
    for i in range(config.num_layers):
        if config.attention_dropout:
            rates.append((i, md.ATTENTION, config.attention_dropout))
        if config.residual_dropout:
            rates += [(i, site, config.residual_dropout) for site in (md.RESID_ATTN, md.RESID_MLP)]

    @jax.jit
    def masks(key):
        out = []
        for layer, site, rate in rates:
            site_key = md.site_key(key if layer is None else md.layer_key(key, layer), site)
            if site == md.ATTENTION and layer is not None:
                heads = config.num_heads
                out.append(
                    md.attention_dropout_mask(site_key, rate, batch, heads, seq_len, seq_len)
                )
            else:
                out.append(md.keep_mask(site_key, rate, shape))
        return out

    return [(np.asarray(m), r) for m, (_, _, r) in zip(masks(key), rates, strict=True)]


def torch_with_masks(monkeypatch, masks):
    """Replace torch's dropout by one applying `masks` in call order."""
    queue = list(masks)

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        keep, rate = queue.pop(0)
        assert tuple(input.shape) == keep.shape and rate == pytest.approx(p)
        return torch.where(torch.from_numpy(keep), input * (1.0 / (1.0 - p)), 0.0)

    monkeypatch.setattr(torch.nn.functional, "dropout", dropout)
    return queue


@pytest.mark.parametrize("family", list(CONFIGS))
def test_train_forward_and_every_gradient_equal_torch_under_the_same_masks(
    family, dropout_ref, monkeypatch, tmp_path
):
    """transformers in train mode with its dropout calls replaced by jaxrl's masks: logits
    (right-padded batch) and the gradient of mean(logits ** 2) w.r.t. every weight equal
    jaxrl's training forward's. GPT-2: embd/attn/resid dropout; Phi-3: attention and both
    residual dropouts (its embd_pdrop drops nothing); Qwen2: attention dropout."""
    ref = dropout_ref(family)
    model = from_pretrained(ref.path)
    config = model.config
    key = jax.random.key(11)
    ids, right, _ = padded_batch(seq_len=11)
    B, T = ids.shape
    masks = expected_masks(config, key, B, T)
    ref.model.train()
    try:
        # Logits of a right-padded batch, on the real positions.
        queue = torch_with_masks(monkeypatch, masks)
        positions = np.maximum(np.cumsum(right, axis=1) - 1, 0)
        padded_ids = np.where(right == 1, ids, 0)
        with torch.no_grad():
            want = ref.model(
                input_ids=torch.from_numpy(padded_ids).long(),
                attention_mask=torch.from_numpy(right).long(),
                position_ids=torch.from_numpy(positions).long(),
            ).logits.numpy()
        assert not queue  # every site drew its mask
        graphdef, params = nnx.split(model)

        @jax.jit
        def forward(params, ids, mask):  # with dropout, and clean
            model = nnx.merge(graphdef, params)
            with md.model_dropout(key):
                dropped = model(ids, mask)
            with md.model_dropout(None):
                return dropped, model(ids, mask)

        padded = jnp.asarray(padded_ids), jnp.asarray(right)
        got, clean = (np.asarray(x) for x in forward(params, *padded))
        real = right[..., None].astype(bool)
        diff = np.abs(np.where(real, got - want, 0)).max()
        assert diff <= 1e-5, diff
        assert np.abs(np.where(real, clean - want, 0)).max() > 1e-3  # dropout did something

        # Every weight's gradient, unpadded rows.
        queue = torch_with_masks(monkeypatch, masks)
        ref.model.zero_grad()
        out = ref.model(input_ids=torch.from_numpy(ids).long())
        (out.logits.float() ** 2).mean().backward()
        assert not queue
    finally:
        ref.model.eval()
    want = {name: p.grad.numpy() for name, p in ref.model.named_parameters()}

    def loss(params):
        with md.model_dropout(key):
            logits = nnx.merge(graphdef, params)(jnp.asarray(ids))
        return jnp.mean(logits.astype(jnp.float32) ** 2)

    nnx.update(model, jax.jit(jax.grad(loss))(params))
    save_pretrained(model, tmp_path)
    grads = load_file(tmp_path / "model.safetensors")
    assert set(grads) == set(want)
    for name, grad in want.items():
        scale = max(np.abs(grad).max(), 1e-6)
        np.testing.assert_allclose(grads[name] / scale, grad / scale, atol=1e-5, err_msg=name)


def _attention_inputs(B=2, T=21, N=4, K=2, H=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k = jax.random.normal(ks[1], (B, T, K, H))
    v = jax.random.normal(ks[2], (B, T, K, H))
    dout = jax.random.normal(ks[3], (B, T, N, H))
    # Row 0: two packed documents then padding; row 1: right padding.
    segments = np.zeros((B, T), np.int32)
    segments[0, :9], segments[0, 9:17] = 1, 2
    segments[1, : T - 4] = 1
    mask = jax.jit(attention_mask_BTS)(None, jnp.asarray(segments))
    return q, k, v, dout, mask, segments


def _reference(q, k, v, mask, window, key, rate, scale=None):
    """Explicit dense attention with the materialised mask (autodiff for its gradients)."""
    B, T, N, H = q.shape
    G = N // k.shape[2]
    kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, kr) * (H**-0.5 if scale is None else scale)
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    visible = (j <= i) & (mask[:, :, :, :] if mask is not None else True)
    if window is not None:
        visible = visible & (j > i - window)
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    keep = md.attention_dropout_mask(key, rate, B, N, T, T)
    p = jnp.where(keep, p / (1 - rate), 0.0)
    return jnp.einsum("bnts,bsnh->btnh", p, vr)


@pytest.mark.parametrize("window", [None, 5])
def test_blockwise_and_xla_dropout_equal_the_explicit_reference(window):
    """Values and q/k/v gradients of the blockwise kernel (blocks of 8 and one block) and the
    XLA path (`grouped_attention`) with dropout equal dense attention with the materialised mask
    (padding, packed documents, GQA, a sliding window)."""
    q, k, v, dout, mask, segments = _attention_inputs()
    key, rate = jax.random.key(5), 0.4
    real = (segments > 0)[:, :, None, None]

    def values_and_grads(fn, q, k, v, dout):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out * real, *vjp(dout * real))

    impls = {
        "reference": lambda q, k, v: _reference(q, k, v, mask, window, key, rate),
        "blockwise8": lambda q, k, v: blockwise_attention(
            q, k, v, mask, window=window, max_block=8, dropout=(key, rate)
        ),
        "blockwise": lambda q, k, v: blockwise_attention(
            q, k, v, mask, window=window, dropout=(key, rate)
        ),
        "xla": lambda q, k, v: attention.attend(q, k, v, mask, window, "xla", dropout=(key, rate)),
        "clean": lambda q, k, v: blockwise_attention(q, k, v, mask, window=window),
    }
    # All in one program (eagerly: one per op).
    got = jax.jit(
        lambda *inputs: {name: values_and_grads(fn, *inputs) for name, fn in impls.items()}
    )(q, k, v, dout)
    want, clean = got.pop("reference"), got.pop("clean")
    for name, results in got.items():
        for label, a, b in zip(("out", "dq", "dk", "dv"), results, want, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"{name} {label}")
    assert np.abs(np.asarray(clean[0]) - np.asarray(want[0])).max() > 0.1


def test_attention_mask_is_a_function_of_global_indices():
    """The keep mask of any block equals that block of the full mask (so every block size,
    kernel and shard sees the same mask), and drops about `rate` of the entries."""
    rate = 0.3

    @jax.jit  # one program (eagerly: one per op)
    def full_and_part(key):
        full = md.attention_dropout_mask(key, rate, 3, 4, 40, 40)
        b, n = jnp.arange(1, 3)[:, None, None, None], jnp.arange(2, 4)[None, :, None, None]
        k0, k1 = md.attention_row_keys(key, b, n)
        q, s = jnp.arange(17, 29)[:, None], jnp.arange(5, 38)[None, :]
        return full, md.attention_keep(k0, k1, q, s, rate)

    full, part = (np.asarray(x) for x in full_and_part(jax.random.key(9)))
    np.testing.assert_array_equal(part, full[1:3, 2:4, 17:29, 5:38])
    assert abs((1 - full.mean()) - rate) < 0.01
    assert not np.array_equal(full[0, 0], full[0, 1]) and not np.array_equal(full[0], full[1])


def test_same_training_loss_for_every_block_size_scan_and_mesh(dropout_ref, monkeypatch):
    """GPT-2 with all three dropouts: the training forward's loss is the same unsharded and
    unrolled with one attention block, and scanned on a (2, 2, 2) mesh of 8 CPU devices with
    blocks of 8 positions (the masks depend on global indices and layer numbers only)."""
    path = dropout_ref("gpt2").path
    ids = jnp.asarray(np.random.default_rng(0).integers(3, VOCAB, (4, 20)), jnp.int32)

    def loss(model, key):
        graphdef, params = nnx.split(model)

        @jax.jit
        def f(params):
            with md.model_dropout(key):
                logits = nnx.merge(graphdef, params)(ids)
            return jnp.mean(logits.astype(jnp.float32) ** 2)

        return float(f(params))

    model = from_pretrained(path)
    base = loss(model, jax.random.key(2))
    assert base != loss(model, None)
    monkeypatch.setattr("jaxrl.models.blockwise_attention.block_size", lambda seq_len, max_block: 8)
    sharded = from_pretrained(path, mesh=make_mesh(2, 2, 2), scan_layers=True)
    np.testing.assert_allclose(loss(sharded, jax.random.key(2)), base, rtol=1e-6)


def test_forwards_outside_training_never_drop(dropout_ref, tmp_path):
    """Without `model_dropout` (eval, reference, scoring) or with key None the forward is the
    dropout-free one (that of the checkpoint with every rate 0), and generation's cached forward
    ignores an enclosing `model_dropout`."""
    import json
    import shutil

    path = dropout_ref("gpt2").path
    model = from_pretrained(path)
    shutil.copytree(path, tmp_path / "zero")
    config = json.loads((tmp_path / "zero" / "config.json").read_text())
    config.update(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    (tmp_path / "zero" / "config.json").write_text(json.dumps(config))
    ids, right, _ = padded_batch()
    ids, right = jnp.asarray(np.where(right == 1, ids, 0)), jnp.asarray(right)

    def dropout_context(mode):
        """No context (mode "unset"), `model_dropout(None)` ("none") or a key's ("key")."""
        if mode == "unset":
            return contextlib.nullcontext()
        return md.model_dropout(None if mode == "none" else jax.random.key(0))

    # Jitted (one program; eagerly one per op), the context entered while tracing.
    @functools.partial(nnx.jit, static_argnums=1)
    def forward(model, mode):
        with dropout_context(mode):
            return model(ids, right)

    @functools.partial(nnx.jit, static_argnums=1)
    def cached_hidden_states(model, mode):
        cache = init_cache(model.config, 3, 9)
        view = CacheView(jnp.zeros((), jnp.int32), jnp.ones((3, 9), bool), prefill=True)
        positions = jnp.broadcast_to(jnp.arange(9), (3, 9))
        with dropout_context(mode):
            return model.cached_hidden_states(ids, positions, cache, view)[0]

    want = np.asarray(forward(from_pretrained(tmp_path / "zero"), "unset"))
    np.testing.assert_array_equal(np.asarray(forward(model, "unset")), want)
    np.testing.assert_array_equal(np.asarray(forward(model, "none")), want)
    assert np.abs(np.asarray(forward(model, "key")) - want).max() > 1e-3

    h = cached_hidden_states(model, "unset")
    h_train = cached_hidden_states(model, "key")
    np.testing.assert_array_equal(np.asarray(h_train), np.asarray(h))


def test_kernels_without_dropout_are_refused_or_avoided(dropout_ref, monkeypatch):
    """cuDNN and splash cannot take the masks: naming them with attention dropout in a training
    forward is an error; left unset, the kernel is blockwise while dropout is on (also where
    the default would be splash or cuDNN)."""
    q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    for impl in ("cudnn", "splash"):
        with pytest.raises(ValueError, match=f"attention_impl='{impl}' cannot apply attention"):
            attention.resolve_impl(impl, q, dropout=0.1)
        assert attention.resolve_impl(impl, q) == impl  # without dropout: as asked
    assert attention.resolve_impl("xla", q, dropout=0.1) == "xla"
    for backend, default in (("tpu", "splash"), ("gpu", "cudnn")):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert attention.resolve_impl(None, q) == default
        assert attention.resolve_impl(None, q, dropout=0.1) == "blockwise"
    monkeypatch.undo()

    model = from_pretrained(dropout_ref("qwen2").path, attention_impl="cudnn")
    ids = jnp.ones((1, 8), jnp.int32)
    with md.model_dropout(jax.random.key(0)), pytest.raises(ValueError, match="cudnn"):
        jax.eval_shape(model, ids)
