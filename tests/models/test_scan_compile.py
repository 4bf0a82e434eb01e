"""Scanned layers keep the compiled program the same size whatever the depth (so compile time
does not grow with depth); unscanned layers grow linearly. Measured on HLO text, not seconds."""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from transformers import LlamaConfig

from jaxrl import models


def hlo_ops(num_layers: int, scan: bool) -> int:
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = models.from_config(cfg, scan_layers=scan)
    graphdef, params = nnx.split(model)
    ids = jnp.zeros((2, 8), jnp.int32)

    def loss(p):
        return nnx.merge(graphdef, p)(ids).astype(jnp.float32).mean()

    text = jax.jit(jax.grad(loss)).lower(params).as_text()
    return len(re.findall(r"^\s*%\S+ = ", text, flags=re.M)) or text.count("\n")


@pytest.mark.slow
def test_scanned_program_size_is_depth_independent():
    assert hlo_ops(2, scan=True) == hlo_ops(8, scan=True)
    assert hlo_ops(8, scan=False) > 2 * hlo_ops(2, scan=False)
