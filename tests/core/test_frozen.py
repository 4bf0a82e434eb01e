"""`jaxrl.core.frozen`: which weights a forward only reads in the compute dtype, found from its
jaxpr through scans, calls, custom derivatives and conds; the cast copy gives the same forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from jaxrl import models
from jaxrl.core import frozen


def test_leaves_read_only_in_the_compute_dtype():
    @jax.custom_vjp
    def through_vjp(w):
        return w.astype(jnp.bfloat16) * 2

    through_vjp.defvjp(lambda w: (through_vjp(w), None), lambda _, g: (g,))

    def fn(p):
        x = jnp.ones((4, 4), jnp.bfloat16)
        y = x @ p["kernel"].astype(jnp.bfloat16)  # cast: qualifies
        y = y + jax.jit(lambda b: b.astype(jnp.bfloat16))(p["bias"])  # cast inside a call
        y = y * p["scale"]  # read in f32: stays
        y = y + through_vjp(p["vjp"])  # cast inside a custom_vjp
        branches = (lambda w: w.astype(jnp.bfloat16), lambda w: 0 * w.astype(jnp.bfloat16))
        y = jax.lax.cond(y.sum() > 0, *branches, p["cond"])
        _, ys = jax.lax.scan(lambda c, w: (c, w.astype(jnp.bfloat16)), 0.0, p["stacked"])
        tied = p["tied"].astype(jnp.bfloat16).sum() + p["tied"].sum()  # both ways: stays
        half = p["f16"].astype(jnp.float16)  # another dtype: stays
        return y, ys, tied, half, p["steps"]

    params = {
        k: jnp.ones(shape, jnp.float32)
        for k, shape in dict(
            kernel=(4, 4), bias=(4,), scale=(4,), vjp=(4,), cond=(4, 4), stacked=(3, 4),
            tied=(4,), f16=(4,),
        ).items()
    }  # fmt: skip
    params["steps"] = jnp.zeros((), jnp.int32)
    flags = frozen.cast_only_leaves(fn, params, jnp.bfloat16)
    want = {"kernel", "bias", "vjp", "cond", "stacked"}
    assert {k for k, v in flags.items() if v} == want, flags
    # Only to a narrower dtype: a bf16 weight read in f32 stays bf16 (an f32 copy saves nothing).
    upcast = frozen.cast_only_leaves(
        lambda p: p.astype(jnp.float32), params["kernel"].astype(jnp.bfloat16), jnp.float32
    )
    assert upcast is False


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize(
    "hf_config",
    [
        Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
        MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, sliding_window=3),
        GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16),
    ],
    ids=["qwen2-tied", "llama-untied", "mistral", "gpt2"],
)  # fmt: skip
def test_model_copy_is_the_same_forward_in_less_memory(hf_config, scan_layers):
    model = models.from_config(
        hf_config,
        seed=0,
        task="causal_lm",
        dtype=jnp.bfloat16,
        param_dtype=jnp.float32,
        scan_layers=scan_layers,
    )
    graphdef, params = nnx.split(model)
    ids = jnp.arange(16).reshape(2, 8) % 64

    def fn(p):
        return nnx.merge(graphdef, p)(ids)

    copy = frozen.in_compute_dtype(fn, params, jnp.bfloat16)
    dtypes = {
        jax.tree_util.keystr(path): leaf.dtype
        for path, leaf in jax.tree_util.tree_flatten_with_path(copy)[0]
    }
    for name, dtype in dtypes.items():
        # Norms (GPT-2: ln_*), and the embedding tables, looked up into the f32 residual stream.
        kept = any(k in name for k in ("norm", "embed_tokens", "ln_", "wte", "wpe"))
        assert dtype == (jnp.float32 if kept else jnp.bfloat16), name
    assert any("lm_head" in n for n in dtypes) != hf_config.tie_word_embeddings
    forward = jax.jit(fn)  # one program each (eagerly: one per op), both compiled alike
    np.testing.assert_array_equal(
        np.asarray(forward(copy), np.float32), np.asarray(forward(params), np.float32)
    )
    nbytes = [sum(x.nbytes for x in jax.tree.leaves(t)) for t in (copy, params)]
    assert nbytes[0] < 0.75 * nbytes[1]
    for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(params), strict=True):
        assert a is not b  # a copy: the policy's buffers are donated to its train step
