"""The attention kernels equal XLA's reference attention (values and gradients) for every mask the
models build, GQA included, and the blockwise kernel never holds [B, N, T, S] scores.

Masks and every checked computation run under `jax.jit`: eagerly, each op of them would compile
a program of its own."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxprs import primitive_names

from jaxrl.models.attention import attend, resolve_impl
from jaxrl.models.blockwise_attention import MAX_BLOCK, block_size, blockwise_attention
from jaxrl.models.hf_config import config_from_hf
from jaxrl.models.layers import dot_product_attention
from jaxrl.models.masks import attention_mask_BTS, attention_masks
from jaxrl.models.presets import get_preset
from tests.model_calls import jit_call

B, N, H = 2, 4, 8


def qkv(seq_len, num_kv, dtype=jnp.float32, seed=0):
    """Standard-normal q, k, v (in `dtype`) and output cotangent w (f32), drawn on the host:
    `jax.random.normal` compiles a program per shape and dtype (~30 in this file), and so does
    `jnp.asarray` of a host array (`device_put` does not)."""
    rng = np.random.default_rng(seed)

    def normal(heads, dtype):
        return jax.device_put(rng.standard_normal((B, seq_len, heads, H), np.float32).astype(dtype))

    return normal(N, dtype), normal(num_kv, dtype), normal(num_kv, dtype), normal(N, jnp.float32)


def reference(q, k, v, mask, window):
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="xla",
    )


def padding_mask(seq_len):
    # Row 0 right-padded by 5, row 1 left-padded by 3.
    idx = np.arange(seq_len)
    return jnp.asarray(np.stack([idx < seq_len - 5, idx >= 3]).astype(np.int32))


def segment_ids(seq_len):
    # Two packed documents then padding; a single document.
    a, b = seq_len // 3, seq_len // 2
    row0 = [1] * a + [2] * b + [0] * (seq_len - a - b)
    return jnp.asarray([row0, [1] * seq_len], jnp.int32)


def prefix_tree_mask(seq_len):
    """DPO prefix sharing: prompt (branch 0), chosen (1), rejected (2), padding (-1); a
    completion sees the prompt and its own branch (causality comes from the kernel)."""
    p, c = seq_len // 4, seq_len // 3
    r = seq_len - p - c - 2
    branch = jnp.asarray([[0] * p + [1] * c + [2] * r + [-1] * 2] * B)
    visible = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    visible &= branch[:, None, :] >= 0
    return visible[:, None]


MASKS = {
    "causal": lambda t: None,
    "padding": lambda t: attention_mask_BTS(padding_mask(t), None),
    "packed": lambda t: attention_mask_BTS(None, segment_ids(t)),
    "packed_padded": lambda t: attention_mask_BTS(padding_mask(t), segment_ids(t)),
    "prefix_tree": lambda t: attention_mask_BTS(prefix_tree_mask(t), None),
}


@functools.partial(jax.jit, static_argnums=(0, 1))
def dense_mask(kind, seq_len):
    """`MASKS[kind](seq_len)`."""
    return MASKS[kind](seq_len)


@functools.partial(jax.jit, static_argnums=0)
def padded_packed_masks(seq_len):
    """The kernels' `AttentionMask` of the "packed_padded" rows."""
    return attention_masks(padding_mask(seq_len), segment_ids(seq_len))


def values_and_grads(fn, q, k, v, w):
    """fn(q, k, v) and the gradients of sum(fn(q, k, v) * w)."""
    out, pullback = jax.vjp(fn, q, k, v)
    return out, pullback(w.astype(out.dtype))


def assert_values_and_grads(fn, ref, q, k, v, w, atol):
    @jax.jit  # both in one program
    def run(q, k, v, w):
        return values_and_grads(fn, q, k, v, w), values_and_grads(ref, q, k, v, w)

    assert_same_values_and_grads(*run(q, k, v, w), atol)


@functools.partial(jax.jit, static_argnames=("window", "max_block"))
def blockwise_and_reference(q, k, v, w, mask, window=None, max_block=MAX_BLOCK):
    """Values and grads of `blockwise_attention` and of `reference`, one program. The mask is an
    argument (not a constant of a closure): the masks of one shape share this program across
    tests and parametrizations."""
    return (
        values_and_grads(
            lambda q, k, v: blockwise_attention(q, k, v, mask, window=window, max_block=max_block),
            q, k, v, w,
        ),
        values_and_grads(lambda q, k, v: reference(q, k, v, mask, window), q, k, v, w),
    )  # fmt: skip


def assert_blockwise_equals_reference(q, k, v, w, mask, atol, window=None, max_block=MAX_BLOCK):
    """`assert_values_and_grads(blockwise_attention(..., mask, window, max_block), reference(...
    mask, window))` through the shared `blockwise_and_reference` program."""
    results = blockwise_and_reference(q, k, v, w, mask, window=window, max_block=max_block)
    assert_same_values_and_grads(*results, atol)


def assert_same_values_and_grads(got, want, atol):
    (out, grads), (ref_out, ref_grads) = got, want
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref_out, np.float32), atol=atol, rtol=atol
    )
    chex.assert_trees_all_equal_dtypes(grads, ref_grads)
    chex.assert_trees_all_close(grads, ref_grads, atol=atol, rtol=atol)


@pytest.mark.parametrize(
    "mask_kind, num_kv",
    [(kind, 2) for kind in sorted(MASKS)] + [("causal", 4), ("causal", 1), ("packed_padded", 1)],
)  # GQA for every mask; MHA (4) and MQA (1)
def test_blockwise_equals_reference(mask_kind, num_kv):
    seq_len = 37  # three blocks of 16 (the last partly padding)
    q, k, v, w = qkv(seq_len, num_kv)
    mask = dense_mask(mask_kind, seq_len)
    assert_blockwise_equals_reference(q, k, v, w, mask, atol=1e-5, max_block=16)


def test_blockwise_skips_the_blocks_of_earlier_documents():
    """Rows of several documents (packed, padding-free): a query block visits key blocks from
    the first one its mask shows any row of the batch, with the reference's values and grads.
    Values poisoned with NaN in block 0 (documents no query from position 48 on sees) reach no
    output there, so those blocks are not visited."""
    seq_len = 80  # five blocks of 16
    segments = jnp.asarray(
        [[1] * 20 + [2] * 35 + [3] * 18 + [0] * 7, [1] * 40 + [2] * 40], jnp.int32
    )
    mask = jax.jit(attention_mask_BTS)(None, segments)
    q, k, v, w = qkv(seq_len, 2)
    assert_blockwise_equals_reference(q, k, v, w, mask, atol=1e-5, max_block=16)
    out = jax.jit(
        lambda q, k, v: blockwise_attention(q, k, v.at[:, :16].set(jnp.nan), mask, max_block=16)
    )(q, k, v)
    assert np.isfinite(np.asarray(out[:, 48:])).all()
    assert np.isnan(np.asarray(out[:, 16:20])).any()  # block 1 still visits block 0


@pytest.mark.parametrize(
    "window, mask_kind",
    [(1, "causal"), (5, "packed_padded"), (16, "causal"), (40, "packed_padded")],
)  # within a block, across blocks, longer than T
def test_sliding_window_equals_reference(window, mask_kind):
    seq_len = 45
    q, k, v, w = qkv(seq_len, 2, seed=1)
    mask = dense_mask(mask_kind, seq_len)
    assert_blockwise_equals_reference(q, k, v, w, mask, atol=1e-5, window=window, max_block=8)


@pytest.mark.parametrize("impl", ["blockwise", "splash", "xla"])
def test_score_scale_equals_reference(impl):
    """Gemma's query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5, with a window."""
    seq_len, scale, window = 37, 0.2, 5
    q, k, v, w = qkv(seq_len, 2, seed=3)
    dense = dense_mask("packed_padded", seq_len)
    masks = padded_packed_masks(seq_len)
    assert_values_and_grads(
        lambda q, k, v: attend(q, k, v, masks, window, impl, scale=scale),
        lambda q, k, v: jax.nn.dot_product_attention(
            q,
            k,
            v,
            mask=dense,
            scale=scale,
            is_causal=True,
            local_window_size=(window - 1, 0),
            implementation="xla",
        ),  # fmt: skip
        q,
        k,
        v,
        w,
        atol=1e-5,
    )
    gap = jax.jit(
        lambda q, k, v: (
            attend(q, k, v, masks, window, impl) - attend(q, k, v, masks, window, impl, scale=scale)
        )
    )(q, k, v)
    assert np.abs(np.asarray(gap)).max() > 0.1  # the scale matters


def softcapped_reference(q, k, v, mask, window, scale, cap):
    """Gemma 2's eager attention written out: K/V heads repeated, scores scaled, then
    `cap * tanh(scores / cap)`, then masked (causal, window, `mask`), softmax."""
    T, G = q.shape[1], q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    s = cap * jnp.tanh(s / cap)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (j <= i) & (j > i - window)
    if mask is not None:
        visible = visible & mask
    s = jnp.where(visible, s, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize(
    ("impl", "mask_kind"),
    [
        ("blockwise", "prefix_tree"),
        ("blockwise", "packed_padded"),
        ("xla", "prefix_tree"),
        pytest.param("splash", "packed_padded", marks=pytest.mark.slow),
    ],
)
def test_softcap_equals_reference(impl, mask_kind):
    """Gemma 2's attn_logit_softcapping, values and gradients, GQA, a window across blocks."""
    seq_len, scale, window, cap = 37 if impl != "splash" else 140, 0.5, 20, 1.0
    q, k, v, w = qkv(seq_len, 2, seed=4)
    dense = dense_mask(mask_kind, seq_len)
    masks = dense
    if mask_kind == "packed_padded":
        masks = padded_packed_masks(seq_len)
    max_block = 16 if impl == "blockwise" else None

    def ours(q, k, v, softcap=cap):
        if max_block:
            return blockwise_attention(
                q, k, v, dense, window=window, max_block=max_block, scale=scale, softcap=softcap
            )
        return attend(q, k, v, masks, window, impl, scale=scale, softcap=softcap)

    assert_values_and_grads(
        ours,
        lambda q, k, v: softcapped_reference(q, k, v, dense, window, scale, cap),
        q, k, v, w, atol=1e-5,
    )  # fmt: skip
    gap = jax.jit(lambda q, k, v: ours(q, k, v) - ours(q, k, v, None))(q, k, v)
    assert np.abs(np.asarray(gap)).max() > 0.1  # the cap bends the scores


def test_softcap_dispatch(monkeypatch):
    """cuDNN's kernel has no soft-capping: the GPU default falls back to blockwise, and asking
    for cuDNN is an error naming the alternatives."""
    q, k, v, _ = qkv(16, 2, dtype=jnp.bfloat16)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_impl(None, q) == "cudnn"
    assert resolve_impl(None, q, softcap=50.0) == "blockwise"
    with pytest.raises(ValueError, match="cudnn.*soft-capping.*blockwise"):
        attend(q, k, v, None, None, "cudnn", softcap=50.0)


@jax.jit
def one_block_and_loop_with_sinks(q, k, v, w, mask, sinks):
    """Values and grads of `blockwise_attention` with `sinks` in one block of 128 and in blocks
    of 16 (the mask an argument: one program for every mask of a shape)."""

    def with_sinks(max_block):
        return lambda q, k, v: blockwise_attention(q, k, v, mask, max_block=max_block, sinks=sinks)

    return values_and_grads(with_sinks(128), q, k, v, w), values_and_grads(
        with_sinks(16), q, k, v, w
    )


@pytest.mark.parametrize("mask_kind", sorted(MASKS))
def test_one_block_runs_without_loops(mask_kind):
    """Rows that fit one block (T <= 128) run forward and backward with no scan or while loop,
    with the reference's values and gradients; rows that see no key at all (the padding masks'
    left-padded positions, also with sinks) give what the loop gives when it visits nothing."""
    seq_len = 37
    q, k, v, w = qkv(seq_len, 2, seed=3)
    mask = dense_mask(mask_kind, seq_len)
    assert_blockwise_equals_reference(q, k, v, w, mask, atol=1e-5)  # max_block 128: one block
    sinks = jax.device_put(np.random.default_rng(4).standard_normal(N, np.float32))  # host-drawn

    def with_sinks(max_block):
        return lambda q, k, v: blockwise_attention(q, k, v, mask, max_block=max_block, sinks=sinks)

    # max_block=16: three blocks through the loops (where an unseen block is never visited).
    assert_same_values_and_grads(*one_block_and_loop_with_sinks(q, k, v, w, mask, sinks), 1e-5)
    grads = jax.make_jaxpr(jax.grad(lambda q, k, v: with_sinks(128)(q, k, v).sum(), (0, 1, 2)))
    names = primitive_names(grads(q, k, v).jaxpr)
    assert "dot_general" in names and not {"scan", "while"} & set(names)


@pytest.mark.parametrize("seq_len", [1, 7, 17, 129])
def test_lengths_not_multiple_of_the_block(seq_len):
    q, k, v, w = qkv(seq_len, 2, seed=seq_len)
    mask = dense_mask("padding", seq_len) if seq_len > 8 else None
    assert_blockwise_equals_reference(q, k, v, w, mask, atol=1e-5, max_block=16)


@pytest.mark.slow
def test_bf16_within_bf16_tolerance():
    seq_len = 33
    q, k, v, w = qkv(seq_len, 2, dtype=jnp.bfloat16, seed=3)
    mask = dense_mask("packed_padded", seq_len)

    @jax.jit
    def out_and_f32_reference(q, k, v):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return blockwise_attention(q, k, v, mask, max_block=16), reference(*f32, mask, None)

    out, want = out_and_f32_reference(q, k, v)
    assert out.dtype == jnp.bfloat16
    # Against the f32 reference on the same (bf16-rounded) inputs: bf16 output rounding plus the
    # bf16 probabilities of the value matmul (which the XLA reference rounds the same way).
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=2e-2)
    assert_blockwise_equals_reference(q, k, v, w, mask, atol=5e-2, max_block=16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_backward_dots_are_standard_layout(dtype):
    """Every dot of the compiled forward + backward contracts the last dim of its left operand:
    XLA:CPU runs any other kind as a slow generic dot, and cannot run a bf16 x bf16 -> f32 one at
    all (an earlier backward's dQ was folded into one at these shapes)."""
    q = jnp.ones((2, 16, 4, 8), dtype)
    k = jnp.ones((2, 16, 2, 8), dtype)
    grad = jax.jit(
        jax.grad(
            lambda q, k: blockwise_attention(q, k, k).astype(jnp.float32).sum(), argnums=(0, 1)
        )
    )
    compiled = grad.lower(q, k).compile()
    dots = [line for line in compiled.as_text().splitlines() if " dot(" in line]
    assert len(dots) >= 6, dots  # forward: scores, p @ v; backward: s^T, dV, dP^T, dQ, dK
    assert all("lhs_contracting_dims={3}" in line for line in dots), dots
    dq, dk = jax.block_until_ready(compiled(q, k))
    assert dq.dtype == dk.dtype == dtype


@pytest.mark.slow
def test_traced_sliding_flag_through_the_layer_dispatch():
    """Scanned stacks that mix full and sliding layers pass `sliding` as a traced bool."""
    config = config_from_hf(get_preset("llama-tiny")).replace(
        sliding_window=6, attention_impl="blockwise"
    )
    seq_len = 21
    q, k, v, _ = qkv(seq_len, 2, seed=4)
    mask = dense_mask("padding", seq_len)

    @functools.partial(jax.jit, static_argnums=3)
    def reference_and_static_flag(q, k, v, flag):
        want = reference(q, k, v, mask, 6 if flag else None)
        return want, dot_product_attention(q, k, v, mask, flag, config)  # a Python bool

    for flag in (True, False):
        got = jax.jit(lambda q, k, v, s: dot_product_attention(q, k, v, mask, s, config))(
            q, k, v, jnp.asarray(flag)
        )
        want, static = reference_and_static_flag(q, k, v, flag)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(static, want, atol=1e-5, rtol=1e-5)


def test_never_holds_full_scores():
    batch, seq_len, heads = 2, 1024, 4
    q = jnp.ones((batch, seq_len, heads, H))
    k = v = jnp.ones((batch, seq_len, 2, H))
    scores_bytes = batch * heads * seq_len * seq_len * 4

    def temp_bytes(fn):
        grad = jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2)))
        return grad.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    ref = temp_bytes(lambda q, k, v: reference(q, k, v, None, None))
    blockwise = temp_bytes(lambda q, k, v: blockwise_attention(q, k, v, None))
    assert ref >= scores_bytes  # sanity: the reference backward holds the scores
    # What it does hold: [B, N, block, block] tiles and [B, T, ...] q/k/v-sized buffers.
    assert blockwise < scores_bytes / 8, (blockwise, scores_bytes)


def test_balanced_blocks():
    assert block_size(128) == 128
    assert block_size(129) == 72  # 2 blocks of 65, rounded up to a multiple of 8
    assert block_size(512) == 128
    assert block_size(37, 16) == 16
    assert block_size(5) == 5


def test_dispatch_defaults_and_forced_impls():
    q, k, v, _ = qkv(19, 2, seed=5)
    assert resolve_impl(None, q) == ("cudnn" if jax.default_backend() == "gpu" else "blockwise")
    assert resolve_impl("xla", q) == "xla"
    mask = dense_mask("packed", 19)
    impls = (None, "blockwise", "xla")
    want, *got = jax.jit(
        lambda q, k, v: [reference(q, k, v, mask, 4)] + [attend(q, k, v, mask, 4, i) for i in impls]
    )(q, k, v)
    for out in got:
        np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


def test_self_attention_only():
    q, k, v, _ = qkv(8, 2)
    with pytest.raises(ValueError, match="self-attention"):
        blockwise_attention(q, k[:, :4], v[:, :4])


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs a GPU")
@pytest.mark.parametrize("mask_kind", sorted(MASKS))
def test_cudnn_equals_reference(mask_kind):
    seq_len = 64
    q, k, v, w = qkv(seq_len, 2, dtype=jnp.bfloat16, seed=6)
    mask = dense_mask(mask_kind, seq_len)
    assert_values_and_grads(
        lambda q, k, v: attend(q, k, v, mask, None, "cudnn"),
        lambda q, k, v: reference(q, k, v, mask, None),
        q,
        k,
        v,
        w,
        atol=5e-2,
    )


# Splash (the TPU default) runs here in Pallas' interpreter, which is slow: one length that needs
# padding to 128 (T=140 -> 256, two 128 blocks), and the masks splash takes as segment ids.
@pytest.mark.slow
@pytest.mark.parametrize(("mask_kind", "window"), [("causal", None), ("packed_padded", 48)])
def test_splash_equals_reference(mask_kind, window):
    seq_len = 140
    q, k, v, w = qkv(seq_len, 2, seed=7)
    dense = dense_mask(mask_kind, seq_len)
    masks = {
        "causal": None,
        "packed_padded": padded_packed_masks(seq_len),
    }[mask_kind]
    assert masks is None or masks.segments_BT is not None
    assert_values_and_grads(
        lambda q, k, v: attend(q, k, v, masks, window, "splash"),
        lambda q, k, v: reference(q, k, v, dense, window),
        q,
        k,
        v,
        w,
        atol=1e-5,
    )


def test_splash_dispatch_and_explicit_masks(monkeypatch):
    q, k, v, _ = qkv(16, 2)
    tree = jax.jit(lambda: attention_masks(prefix_tree_mask(16), None))()
    assert tree.segments_BT is None  # an explicit mask is dense only
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_impl(None, q) == "splash"
    assert resolve_impl(None, q, segments_known=False) == "blockwise"
    with pytest.raises(ValueError, match="explicit mask.*blockwise"):
        attend(q, k, v, tree, None, "splash")


@pytest.mark.slow
def test_splash_model_on_a_mesh_equals_reference(tmp_path):
    """A scanned Llama with attention_impl='splash' on a 2 (data) x 2 (fsdp) x 2 (tensor) mesh:
    packed segments reach the kernel through the layer scan, which runs per shard; logits equal
    the same model's with the reference attention on one device (its weights saved and loaded
    onto the mesh: a second `from_config` compiled a second init program)."""
    from transformers import LlamaConfig

    from jaxrl import models, parallel

    hf = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    ids = jax.device_put(np.random.default_rng(1).integers(3, 64, (4, 130)).astype(np.int32))
    seg = jnp.asarray(np.concatenate([segment_ids(130), segment_ids(130)[::-1]]))
    reference_model = models.from_config(hf, scan_layers=True, attention_impl="xla")
    want = jit_call(reference_model, ids, segment_ids=seg)
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    models.save_pretrained(reference_model, tmp_path)
    model = models.from_pretrained(tmp_path, mesh=mesh, scan_layers=True, attention_impl="splash")
    got = jax.jit(lambda ids, seg: model(ids, segment_ids=seg))(ids, seg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "family, impl",
    [("llama", "blockwise"), ("llama", "xla"), ("mistral", "blockwise"), ("gpt2", "xla")],
)
def test_right_padded_rows_run_unmasked_exactly(family, impl, hf_causal, hf_seq_cls):
    """Collated rows holding one document each carry no segment ids and the trainers run them
    without a mask (`model_masks`): at every scored token the log-probs, and the parameter
    gradients, equal those of the masked call (sliding window included: mistral's is 3); reward
    scores at the last real token likewise. The models are the session's tiny checkpoints
    (tests/models/conftest.py; loading one compiles nothing, `from_config` compiled an init
    program per model)."""
    from jaxrl.algos.reward import pair_scores
    from jaxrl.algos.sft import lm_forward
    from jaxrl.data import collate_sft
    from jaxrl.models import from_pretrained

    rng = np.random.default_rng(0)
    lengths = (11, 4, 7, 1)
    examples = [{"input_ids": rng.integers(3, 64, n).tolist()} for n in lengths]
    batch = {k: jnp.asarray(v) for k, v in collate_sft(examples, 12, pad_token_id=0).items()}
    masked = dict(batch, segment_ids=batch["attention_mask"])  # the masked call, as before
    graphdef, params = nnx.split(from_pretrained(hf_causal(family).path, attention_impl=impl))

    def loss_and_logps(params, mb):
        logps_BT = lm_forward(nnx.merge(graphdef, params), mb, None, with_stats=False)
        return jnp.sum(logps_BT * mb["loss_mask"]), logps_BT

    run = jax.value_and_grad(loss_and_logps, has_aux=True)
    ((_, got), got_grads), ((_, want), want_grads) = jax.jit(
        lambda params, batch, masked: (run(params, batch), run(params, masked))
    )(params, batch, masked)  # one program
    scored = np.asarray(batch["loss_mask"]) > 0
    assert scored.sum() == sum(lengths) - len(lengths)
    np.testing.assert_allclose(np.asarray(got)[scored], np.asarray(want)[scored], atol=1e-6)
    assert not np.allclose(np.asarray(got)[~scored], np.asarray(want)[~scored])  # padding moved
    chex.assert_trees_all_close(got_grads, want_grads, atol=1e-6, rtol=1e-5)

    if family == "gpt2":
        return
    scorer = from_pretrained(
        hf_seq_cls(family).path, task="sequence_classification", attention_impl=impl
    )  # num_labels=1

    @nnx.jit
    def scores_and_masked_scores(scorer, batch):
        pairs = {k: v.reshape(2, 2, *v.shape[1:]) for k, v in batch.items()}  # [B, 2, T]
        _, scores = pair_scores(scorer, pairs)
        rows = jnp.concatenate([batch["input_ids"][0::2], batch["input_ids"][1::2]])
        mask = jnp.concatenate([batch["attention_mask"][0::2], batch["attention_mask"][1::2]])
        pos = jnp.concatenate([batch["positions"][0::2], batch["positions"][1::2]])
        return scores, scorer(rows, mask, pos, mask)[:, 0]

    scores, want_scores = scores_and_masked_scores(scorer, batch)
    np.testing.assert_allclose(np.asarray(scores), np.asarray(want_scores), atol=1e-6)
