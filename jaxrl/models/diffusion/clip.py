"""CLIP text encoder (Stable Diffusion's prompt encoder) and CLIP vision tower with projection
(image features for the aesthetic reward) in Flax NNX, with transformers' module names.

`CLIPTextModel(ids)` returns `last_hidden_state` (after final_layer_norm), which SD uses as
`prompt_embeds`. `CLIPVisionModelWithProjection(pixels)` returns `image_embeds`
(= CLIPModel.get_image_features). Causal self-attention in the text tower, none in the vision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.diffusion.nn import (
    Conv2d,
    Dtypes,
    Embedding,
    LayerNorm,
    Linear,
    multi_head_attention,
)
from jaxrl.models.layers import make_param


def quick_gelu(x: jax.Array) -> jax.Array:
    return x * jax.nn.sigmoid(1.702 * x)


def gelu_exact(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)


ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": gelu_exact}


@dataclasses.dataclass(frozen=True)
class CLIPConfig:
    """Fields shared by CLIPTextConfig and CLIPVisionConfig (transformers names)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    projection_dim: int = 768
    # text
    vocab_size: int = 49408
    max_position_embeddings: int = 77
    # vision
    image_size: int = 224
    patch_size: int = 14
    num_channels: int = 3
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], tower: str) -> CLIPConfig:
        """From a CLIPTextConfig / CLIPVisionConfig dict, or a full CLIPConfig dict (`tower` =
        "text" or "vision" picks the sub-config)."""
        sub = raw.get(f"{tower}_config") if raw.get("model_type") == "clip" else raw
        sub = dict(sub or {})
        if "projection_dim" not in sub and "projection_dim" in raw:
            sub["projection_dim"] = raw["projection_dim"]
        act = sub.get("hidden_act", "quick_gelu")
        if act not in ACTIVATIONS:
            raise ValueError(
                f"CLIP hidden_act={act!r} is not supported; use {sorted(ACTIVATIONS)}."
            )
        names = {f.name for f in dataclasses.fields(cls)} - {"raw"}
        return cls(**{k: v for k, v in sub.items() if k in names}, raw=dict(raw))


class CLIPAttention(nnx.Module):
    def __init__(self, cfg: CLIPConfig, dt: Dtypes, rngs: nnx.Rngs | None):
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.q_proj = Linear(d, d, dt, rngs, axes=("embed", "heads"))
        self.k_proj = Linear(d, d, dt, rngs, axes=("embed", "heads"))
        self.v_proj = Linear(d, d, dt, rngs, axes=("embed", "heads"))
        self.out_proj = Linear(d, d, dt, rngs, axes=("heads", "embed"))

    def __call__(self, x_BTD: jax.Array, causal: bool, mask_B1TS: jax.Array | None) -> jax.Array:
        y = multi_head_attention(
            self.q_proj(x_BTD),
            self.k_proj(x_BTD),
            self.v_proj(x_BTD),
            self.num_heads,
            is_causal=causal,
            mask_B1TS=mask_B1TS,
        )
        return self.out_proj(y)


class CLIPMLP(nnx.Module):
    def __init__(self, cfg: CLIPConfig, dt: Dtypes, rngs: nnx.Rngs | None):
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, dt, rngs, axes=("embed", "mlp"))
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, dt, rngs, axes=("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nnx.Module):
    def __init__(self, cfg: CLIPConfig, dt: Dtypes, rngs: nnx.Rngs | None):
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dt)
        self.self_attn = CLIPAttention(cfg, dt, rngs)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dt)
        self.mlp = CLIPMLP(cfg, dt, rngs)

    def __call__(self, x: jax.Array, causal: bool, mask_B1TS: jax.Array | None) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x), causal, mask_B1TS)
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nnx.Module):
    def __init__(self, cfg: CLIPConfig, dt: Dtypes, rngs: nnx.Rngs | None):
        self.layers = nnx.List(
            [CLIPEncoderLayer(cfg, dt, rngs) for _ in range(cfg.num_hidden_layers)]
        )

    def __call__(self, x: jax.Array, causal: bool, mask_B1TS: jax.Array | None) -> jax.Array:
        for layer in self.layers:
            x = layer(x, causal, mask_B1TS)
        return x


class CLIPTextEmbeddings(nnx.Module):
    def __init__(self, cfg: CLIPConfig, dt: Dtypes, rngs: nnx.Rngs | None):
        d = cfg.hidden_size
        self.token_embedding = Embedding(cfg.vocab_size, d, ("vocab", "embed"), dt, rngs)
        self.position_embedding = Embedding(
            cfg.max_position_embeddings, d, ("position", "embed"), dt, rngs
        )

    def __call__(self, ids_BT: jax.Array) -> jax.Array:
        positions = jnp.arange(ids_BT.shape[1])
        return self.token_embedding(ids_BT) + self.position_embedding(positions)[None]


class CLIPTextTransformer(nnx.Module):
    def __init__(self, cfg: CLIPConfig, dt: Dtypes, rngs: nnx.Rngs | None):
        self.embeddings = CLIPTextEmbeddings(cfg, dt, rngs)
        self.encoder = CLIPEncoder(cfg, dt, rngs)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dt)

    def __call__(self, ids_BT: jax.Array, attention_mask_BT: jax.Array | None) -> jax.Array:
        mask = None
        if attention_mask_BT is not None:
            t = ids_BT.shape[1]
            # Padding keys are hidden; every query keeps itself so padded rows never go all -inf.
            mask = (attention_mask_BT.astype(bool)[:, None, None, :]) | jnp.eye(t, dtype=bool)
        x = self.encoder(self.embeddings(ids_BT), True, mask)
        return self.final_layer_norm(x)


class CLIPTextModel(nnx.Module):
    """`model(input_ids_BT, attention_mask_BT=None) -> last_hidden_state [B, T, D]`."""

    def __init__(
        self,
        config: CLIPConfig,
        rngs: nnx.Rngs | None = None,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
    ):
        self.config = config
        self.text_model = CLIPTextTransformer(config, Dtypes(dtype, param_dtype), rngs)

    def __call__(
        self, input_ids_BT: jax.Array, attention_mask_BT: jax.Array | None = None
    ) -> jax.Array:
        return self.text_model(input_ids_BT, attention_mask_BT)


class CLIPVisionEmbeddings(nnx.Module):
    def __init__(self, cfg: CLIPConfig, dt: Dtypes, rngs: nnx.Rngs | None):
        d = cfg.hidden_size
        self.class_embedding = make_param(
            rngs, jax.nn.initializers.normal(0.02), (d,), ("embed",), dt.param_dtype
        )
        self.patch_embedding = Conv2d(
            cfg.num_channels,
            d,
            cfg.patch_size,
            dt,
            rngs,
            stride=cfg.patch_size,
            bias=False,
            axes=(None, None, None, "embed"),
        )
        num_positions = (cfg.image_size // cfg.patch_size) ** 2 + 1
        self.position_embedding = Embedding(num_positions, d, ("position", "embed"), dt, rngs)
        self.dtype = dt.dtype

    def __call__(self, pixels_BHWC: jax.Array) -> jax.Array:
        patches = self.patch_embedding(pixels_BHWC)
        b, _, _, d = patches.shape
        patches = patches.reshape(b, -1, d)
        cls = jnp.broadcast_to(self.class_embedding[...].astype(self.dtype), (b, 1, d))
        x = jnp.concatenate([cls, patches], axis=1)
        return x + self.position_embedding(jnp.arange(x.shape[1]))[None]


class CLIPVisionTransformer(nnx.Module):
    def __init__(self, cfg: CLIPConfig, dt: Dtypes, rngs: nnx.Rngs | None):
        self.embeddings = CLIPVisionEmbeddings(cfg, dt, rngs)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dt)  # HF's spelling
        self.encoder = CLIPEncoder(cfg, dt, rngs)
        self.post_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dt)

    def __call__(self, pixels_BHWC: jax.Array) -> jax.Array:
        x = self.encoder(self.pre_layrnorm(self.embeddings(pixels_BHWC)), False, None)
        return self.post_layernorm(x[:, 0])  # pooled: the class token


class CLIPVisionModelWithProjection(nnx.Module):
    """`model(pixel_values_BCHW) -> image_embeds [B, projection_dim]` (not normalised)."""

    def __init__(
        self,
        config: CLIPConfig,
        rngs: nnx.Rngs | None = None,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
    ):
        self.config = config
        dt = Dtypes(dtype, param_dtype)
        self.vision_model = CLIPVisionTransformer(config, dt, rngs)
        self.visual_projection = Linear(
            config.hidden_size, config.projection_dim, dt, rngs, bias=False
        )

    def __call__(self, pixel_values_BCHW: jax.Array) -> jax.Array:
        pooled = self.vision_model(jnp.transpose(pixel_values_BCHW, (0, 2, 3, 1)))
        return self.visual_projection(pooled)
