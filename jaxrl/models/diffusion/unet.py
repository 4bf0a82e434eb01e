"""Stable Diffusion 1.x / 2.x `UNet2DConditionModel` in Flax NNX (diffusers' module tree and
numerics: exact-erf GEGLU, GroupNorm eps 1e-6 in the transformer blocks, norm_eps in the resnets).

`UNetConfig.from_diffusers` reads a diffusers `unet/config.json` and rejects every option this
implementation does not compute (rather than silently ignoring it). Activations are NCHW at the
boundary (as diffusers) and NHWC inside.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.diffusion.nn import (
    Conv2d,
    Dtypes,
    GroupNorm,
    LayerNorm,
    Linear,
    multi_head_attention,
)

DOWN_TYPES = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_TYPES = ("CrossAttnUpBlock2D", "UpBlock2D")
# Config keys whose value must be the SD default (or absent) for this implementation to be exact.
REQUIRED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "mid_block_type": ("UNetMidBlock2DCrossAttn",),
    "act_fn": ("silu",),
    "center_input_sample": (False,),
    "only_cross_attention": (False,),
    "dual_cross_attention": (False,),
    "class_embed_type": (None,),
    "addition_embed_type": (None,),
    "num_class_embeds": (None,),
    "time_embedding_type": ("positional",),
    "time_embedding_dim": (None,),
    "time_embedding_act_fn": (None,),
    "timestep_post_act": (None,),
    "time_cond_proj_dim": (None,),
    "resnet_time_scale_shift": ("default",),
    "resnet_skip_time_act": (False,),
    "resnet_out_scale_factor": (1.0, 1),
    "mid_block_scale_factor": (1.0, 1),
    "downsample_padding": (1,),
    "conv_in_kernel": (3,),
    "conv_out_kernel": (3,),
    "encoder_hid_dim": (None,),
    "encoder_hid_dim_type": (None,),
    "attention_type": ("default",),
    "cross_attention_norm": (None,),
    "class_embeddings_concat": (False,),
    "mid_block_only_cross_attention": (None, False),
    "reverse_transformer_layers_per_block": (None,),
    "addition_time_embed_dim": (None,),
    "projection_class_embeddings_input_dim": (None,),
    "dropout": (0.0, 0),
}


def _per_block(value: Any, n: int, name: str) -> tuple:
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(f"UNet config: {name} has {len(value)} entries for {n} blocks.")
        return tuple(value)
    return (value,) * n


@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """The UNet2DConditionModel fields SD 1.x/2.x use (diffusers names)."""

    in_channels: int = 4
    out_channels: int = 4
    down_block_types: tuple[str, ...] = (
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    )
    up_block_types: tuple[str, ...] = (
        "UpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
    )
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int = 2
    cross_attention_dim: int = 768
    num_heads: tuple[int, ...] = (8, 8, 8, 8)
    transformer_layers_per_block: tuple[int, ...] = (1, 1, 1, 1)
    use_linear_projection: bool = False
    upcast_attention: bool = False
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    sample_size: int = 64
    # The config.json this was read from (written back unchanged by `save_unet`).
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_diffusers(cls, raw: Mapping[str, Any]) -> UNetConfig:
        for key, allowed in REQUIRED_DEFAULTS.items():
            if raw.get(key, allowed[0]) not in allowed:
                raise ValueError(
                    f"UNet config {key}={raw[key]!r} is not supported by jaxrl's UNet (SD 1.x/2.x "
                    f"only supports {allowed[0]!r})."
                )
        down = tuple(raw["down_block_types"])
        up = tuple(raw["up_block_types"])
        for t in down:
            if t not in DOWN_TYPES:
                raise ValueError(f"UNet down block type {t!r} is not supported; use {DOWN_TYPES}.")
        for t in up:
            if t not in UP_TYPES:
                raise ValueError(f"UNet up block type {t!r} is not supported; use {UP_TYPES}.")
        if raw.get("norm_num_groups") is None:
            raise ValueError("UNet config norm_num_groups=None (no GroupNorm) is not supported.")
        n = len(raw["block_out_channels"])
        cross = raw.get("cross_attention_dim", 1280)
        if isinstance(cross, list | tuple):
            raise ValueError("UNet config: a per-block cross_attention_dim list is not supported.")
        # diffusers names the head count `attention_head_dim` (kept for old configs); an explicit
        # num_attention_heads takes precedence.
        heads = raw.get("num_attention_heads") or raw.get("attention_head_dim", 8)
        if isinstance(raw.get("layers_per_block", 2), list | tuple):
            raise ValueError("UNet config: a per-block layers_per_block list is not supported.")
        return cls(
            in_channels=raw.get("in_channels", 4),
            out_channels=raw.get("out_channels", 4),
            down_block_types=down,
            up_block_types=up,
            block_out_channels=tuple(raw["block_out_channels"]),
            layers_per_block=raw.get("layers_per_block", 2),
            cross_attention_dim=cross,
            num_heads=_per_block(heads, n, "attention_head_dim"),
            transformer_layers_per_block=_per_block(
                raw.get("transformer_layers_per_block", 1), n, "transformer_layers_per_block"
            ),
            use_linear_projection=bool(raw.get("use_linear_projection", False)),
            upcast_attention=bool(raw.get("upcast_attention", False)),
            norm_num_groups=raw["norm_num_groups"],
            norm_eps=raw.get("norm_eps", 1e-5),
            flip_sin_to_cos=raw.get("flip_sin_to_cos", True),
            freq_shift=raw.get("freq_shift", 0),
            sample_size=raw.get("sample_size", 64),
            raw=dict(raw),
        )


def timestep_embedding(
    t_B: jax.Array, dim: int, flip_sin_to_cos: bool, freq_shift: float
) -> jax.Array:
    """diffusers `get_timestep_embedding` (sinusoidal, max_period 10000), f32 [B, dim]."""
    half = dim // 2
    exponent = -math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift)
    emb_BF = t_B.astype(jnp.float32)[:, None] * jnp.exp(exponent)[None, :]
    sin, cos = jnp.sin(emb_BF), jnp.cos(emb_BF)
    emb = jnp.concatenate([cos, sin] if flip_sin_to_cos else [sin, cos], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


class TimestepEmbedding(nnx.Module):
    def __init__(self, n_in: int, n_out: int, dt: Dtypes, rngs: nnx.Rngs | None):
        self.linear_1 = Linear(n_in, n_out, dt, rngs)
        self.linear_2 = Linear(n_out, n_out, dt, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(jax.nn.silu(self.linear_1(x)))


class ResnetBlock2D(nnx.Module):
    """norm1 -> SiLU -> conv1 (+ time_emb_proj(SiLU(temb))) -> norm2 -> SiLU -> conv2, plus a
    1x1 conv_shortcut when the channel count changes. `temb_channels=None`: no time input (VAE)."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        temb_channels: int | None,
        groups: int,
        eps: float,
        dt: Dtypes,
        rngs: nnx.Rngs | None,
    ):
        self.norm1 = GroupNorm(groups, n_in, eps, dt)
        self.conv1 = Conv2d(n_in, n_out, 3, dt, rngs, padding=1)
        self.time_emb_proj = (
            Linear(temb_channels, n_out, dt, rngs) if temb_channels is not None else None
        )
        self.norm2 = GroupNorm(groups, n_out, eps, dt)
        self.conv2 = Conv2d(n_out, n_out, 3, dt, rngs, padding=1)
        self.conv_shortcut = Conv2d(n_in, n_out, 1, dt, rngs) if n_in != n_out else None

    def __call__(self, x_BHWC: jax.Array, temb_BD: jax.Array | None) -> jax.Array:
        h = self.conv1(jax.nn.silu(self.norm1(x_BHWC)))
        if self.time_emb_proj is not None:
            h = h + self.time_emb_proj(jax.nn.silu(temb_BD))[:, None, None, :]
        h = self.conv2(jax.nn.silu(self.norm2(h)))
        shortcut = self.conv_shortcut(x_BHWC) if self.conv_shortcut is not None else x_BHWC
        return shortcut.astype(h.dtype) + h


class Attention(nnx.Module):
    """diffusers `Attention` as used in BasicTransformerBlock: bias-free q/k/v, to_out.0 with bias.

    `upcast` (SD 2.x `upcast_attention`) computes the scores in f32 for low-precision dtypes.
    """

    def __init__(
        self,
        dim: int,
        context_dim: int,
        num_heads: int,
        upcast: bool,
        dt: Dtypes,
        rngs: nnx.Rngs | None,
    ):
        self.num_heads = num_heads
        self.upcast = upcast
        self.to_q = Linear(dim, dim, dt, rngs, bias=False, axes=("embed", "heads"))
        self.to_k = Linear(context_dim, dim, dt, rngs, bias=False, axes=("embed", "heads"))
        self.to_v = Linear(context_dim, dim, dt, rngs, bias=False, axes=("embed", "heads"))
        self.to_out = nnx.List([Linear(dim, dim, dt, rngs, axes=("heads", "embed"))])

    def __call__(self, x_BTC: jax.Array, context_BSD: jax.Array | None = None) -> jax.Array:
        context = x_BTC if context_BSD is None else context_BSD
        q, k, v = self.to_q(x_BTC), self.to_k(context), self.to_v(context)
        if self.upcast:
            dtype = q.dtype
            q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
            return self.to_out[0](multi_head_attention(q, k, v, self.num_heads).astype(dtype))
        return self.to_out[0](multi_head_attention(q, k, v, self.num_heads))


class GEGLU(nnx.Module):
    """proj -> (hidden, gate) halves -> hidden * gelu(gate) with PyTorch's exact (erf) GELU."""

    def __init__(self, dim: int, inner: int, dt: Dtypes, rngs: nnx.Rngs | None):
        self.proj = Linear(dim, 2 * inner, dt, rngs, axes=("embed", "mlp"))

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden, gate = jnp.split(self.proj(x), 2, axis=-1)
        return hidden * jax.nn.gelu(gate, approximate=False)


class FeedForward(nnx.Module):
    """`ff.net.0` (GEGLU) and `ff.net.2` (Linear); net.1 is dropout (p=0, no params)."""

    def __init__(self, dim: int, dt: Dtypes, rngs: nnx.Rngs | None):
        inner = 4 * dim
        self.net = nnx.Dict(
            {
                "0": GEGLU(dim, inner, dt, rngs),
                "2": Linear(inner, dim, dt, rngs, axes=("mlp", "embed")),
            }
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.net["2"](self.net["0"](x))


class BasicTransformerBlock(nnx.Module):
    """x += attn1(norm1 x); x += attn2(norm2 x, context); x += ff(norm3 x) (LayerNorm eps 1e-5)."""

    def __init__(
        self,
        dim: int,
        context_dim: int,
        num_heads: int,
        upcast: bool,
        dt: Dtypes,
        rngs: nnx.Rngs | None,
    ):
        self.norm1 = LayerNorm(dim, 1e-5, dt)
        self.attn1 = Attention(dim, dim, num_heads, upcast, dt, rngs)
        self.norm2 = LayerNorm(dim, 1e-5, dt)
        self.attn2 = Attention(dim, context_dim, num_heads, upcast, dt, rngs)
        self.norm3 = LayerNorm(dim, 1e-5, dt)
        self.ff = FeedForward(dim, dt, rngs)

    def __call__(self, x_BTC: jax.Array, context_BSD: jax.Array) -> jax.Array:
        x_BTC = x_BTC + self.attn1(self.norm1(x_BTC))
        x_BTC = x_BTC + self.attn2(self.norm2(x_BTC), context_BSD)
        return x_BTC + self.ff(self.norm3(x_BTC))


class Transformer2DModel(nnx.Module):
    """GroupNorm (eps 1e-6) -> proj_in (1x1 conv, or linear for SD 2.x) -> transformer blocks
    over the H*W tokens -> proj_out -> + residual."""

    def __init__(
        self,
        channels: int,
        num_heads: int,
        depth: int,
        cfg: UNetConfig,
        dt: Dtypes,
        rngs: nnx.Rngs | None,
    ):
        self.linear = cfg.use_linear_projection
        self.norm = GroupNorm(cfg.norm_num_groups, channels, 1e-6, dt)
        if self.linear:
            self.proj_in = Linear(channels, channels, dt, rngs)
            self.proj_out = Linear(channels, channels, dt, rngs, axes=("mlp", "embed"))
        else:
            self.proj_in = Conv2d(channels, channels, 1, dt, rngs)
            self.proj_out = Conv2d(
                channels, channels, 1, dt, rngs, axes=(None, None, "mlp", "embed")
            )
        self.transformer_blocks = nnx.List(
            [
                BasicTransformerBlock(
                    channels, cfg.cross_attention_dim, num_heads, cfg.upcast_attention, dt, rngs
                )
                for _ in range(depth)
            ]
        )

    def __call__(self, x_BHWC: jax.Array, context_BSD: jax.Array) -> jax.Array:
        b, h, w, c = x_BHWC.shape
        y = self.norm(x_BHWC)
        # A 1x1 conv and a linear layer on [B, H*W, C] are the same map; only the weight shapes
        # differ, so both layouts are applied on the flattened tokens.
        y = self.proj_in(y.reshape(b, h * w, c) if self.linear else y).reshape(b, h * w, c)
        for block in self.transformer_blocks:
            y = block(y, context_BSD)
        y = self.proj_out(y) if self.linear else self.proj_out(y.reshape(b, h, w, c))
        return y.reshape(b, h, w, c) + x_BHWC.astype(y.dtype)


class Downsample2D(nnx.Module):
    def __init__(self, channels: int, dt: Dtypes, rngs: nnx.Rngs | None, *, vae: bool = False):
        # The VAE encoder pads (0, 1, 0, 1) then convolves with padding 0; the UNet uses padding 1.
        self.conv = Conv2d(
            channels, channels, 3, dt, rngs, stride=2, padding=0 if vae else 1, pad_right_bottom=vae
        )

    def __call__(self, x_BHWC: jax.Array) -> jax.Array:
        return self.conv(x_BHWC)


class Upsample2D(nnx.Module):
    def __init__(self, channels: int, dt: Dtypes, rngs: nnx.Rngs | None):
        self.conv = Conv2d(channels, channels, 3, dt, rngs, padding=1)

    def __call__(self, x_BHWC: jax.Array) -> jax.Array:
        x = jnp.repeat(jnp.repeat(x_BHWC, 2, axis=1), 2, axis=2)  # nearest-neighbour x2
        return self.conv(x)


class DownBlock(nnx.Module):
    """CrossAttnDownBlock2D (with `attentions`) or DownBlock2D."""

    def __init__(
        self,
        i: int,
        n_in: int,
        n_out: int,
        temb: int,
        cfg: UNetConfig,
        dt: Dtypes,
        rngs: nnx.Rngs | None,
    ):
        cross = cfg.down_block_types[i] == "CrossAttnDownBlock2D"
        groups, eps = cfg.norm_num_groups, cfg.norm_eps
        self.resnets = nnx.List(
            [
                ResnetBlock2D(n_in if j == 0 else n_out, n_out, temb, groups, eps, dt, rngs)
                for j in range(cfg.layers_per_block)
            ]
        )
        self.attentions = (
            nnx.List(
                [
                    Transformer2DModel(
                        n_out, cfg.num_heads[i], cfg.transformer_layers_per_block[i], cfg, dt, rngs
                    )
                    for _ in range(cfg.layers_per_block)
                ]
            )
            if cross
            else None
        )
        last = i == len(cfg.block_out_channels) - 1
        self.downsamplers = None if last else nnx.List([Downsample2D(n_out, dt, rngs)])

    def __call__(self, x, temb, context) -> tuple[jax.Array, list[jax.Array]]:
        skips = []
        for j, resnet in enumerate(self.resnets):
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[j](x, context)
            skips.append(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
            skips.append(x)
        return x, skips


class UpBlock(nnx.Module):
    """CrossAttnUpBlock2D (with `attentions`) or UpBlock2D: layers_per_block + 1 resnets, each on
    the concatenation of the running activation and one skip connection."""

    def __init__(
        self,
        i: int,
        prev: int,
        n_out: int,
        skip_in: int,
        temb: int,
        cfg: UNetConfig,
        dt: Dtypes,
        rngs: nnx.Rngs | None,
    ):
        n = len(cfg.block_out_channels)
        cross = cfg.up_block_types[i] == "CrossAttnUpBlock2D"
        rev = n - 1 - i  # index into the per-block (down-order) lists
        num = cfg.layers_per_block + 1
        groups, eps = cfg.norm_num_groups, cfg.norm_eps
        resnets = []
        for j in range(num):
            skip = skip_in if j == num - 1 else n_out
            res_in = prev if j == 0 else n_out
            resnets.append(ResnetBlock2D(res_in + skip, n_out, temb, groups, eps, dt, rngs))
        self.resnets = nnx.List(resnets)
        self.attentions = (
            nnx.List(
                [
                    Transformer2DModel(
                        n_out,
                        cfg.num_heads[rev],
                        cfg.transformer_layers_per_block[rev],
                        cfg,
                        dt,
                        rngs,
                    )
                    for _ in range(num)
                ]
            )
            if cross
            else None
        )
        self.upsamplers = None if i == n - 1 else nnx.List([Upsample2D(n_out, dt, rngs)])

    def __call__(self, x, skips: list[jax.Array], temb, context) -> jax.Array:
        for j, resnet in enumerate(self.resnets):
            skip = skips.pop()
            x = resnet(jnp.concatenate([x, skip.astype(x.dtype)], axis=-1), temb)
            if self.attentions is not None:
                x = self.attentions[j](x, context)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


class MidBlock(nnx.Module):
    """UNetMidBlock2DCrossAttn: resnet, then (attention, resnet) pairs."""

    def __init__(
        self, channels: int, temb: int, cfg: UNetConfig, dt: Dtypes, rngs: nnx.Rngs | None
    ):
        groups, eps = cfg.norm_num_groups, cfg.norm_eps
        self.resnets = nnx.List(
            [ResnetBlock2D(channels, channels, temb, groups, eps, dt, rngs) for _ in range(2)]
        )
        self.attentions = nnx.List(
            [
                Transformer2DModel(
                    channels, cfg.num_heads[-1], cfg.transformer_layers_per_block[-1], cfg, dt, rngs
                )
            ]
        )

    def __call__(self, x, temb, context) -> jax.Array:
        x = self.resnets[0](x, temb)
        return self.resnets[1](self.attentions[0](x, context), temb)


class UNet2DConditionModel(nnx.Module):
    """`unet(sample_BCHW, timesteps, encoder_hidden_states_BSD) -> noise prediction [B, C, H, W]`.

    `timesteps` is a scalar or a [B] vector. H and W must be divisible by 2**(num_blocks - 1).
    """

    def __init__(
        self,
        config: UNetConfig,
        rngs: nnx.Rngs | None = None,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
    ):
        self.config = config
        dt = Dtypes(dtype, param_dtype)
        self.dtype = dtype
        ch = config.block_out_channels
        temb = 4 * ch[0]
        self.conv_in = Conv2d(config.in_channels, ch[0], 3, dt, rngs, padding=1)
        self.time_embedding = TimestepEmbedding(ch[0], temb, dt, rngs)
        self.down_blocks = nnx.List(
            [DownBlock(i, ch[max(i - 1, 0)], ch[i], temb, config, dt, rngs) for i in range(len(ch))]
        )
        self.mid_block = MidBlock(ch[-1], temb, config, dt, rngs)
        rev = ch[::-1]
        self.up_blocks = nnx.List(
            [
                UpBlock(
                    i,
                    rev[max(i - 1, 0)],
                    rev[i],
                    rev[min(i + 1, len(ch) - 1)],
                    temb,
                    config,
                    dt,
                    rngs,
                )
                for i in range(len(ch))
            ]
        )
        self.conv_norm_out = GroupNorm(config.norm_num_groups, ch[0], config.norm_eps, dt)
        self.conv_out = Conv2d(ch[0], config.out_channels, 3, dt, rngs, padding=1)

    def __call__(
        self, sample_BCHW: jax.Array, timesteps: jax.Array, encoder_hidden_states_BSD: jax.Array
    ) -> jax.Array:
        cfg = self.config
        b, _, h, w = sample_BCHW.shape
        factor = 2 ** (len(cfg.block_out_channels) - 1)
        if h % factor or w % factor:
            raise ValueError(f"UNet input H, W = {h}, {w} must be divisible by {factor}.")
        t_B = jnp.broadcast_to(jnp.asarray(timesteps), (b,))
        t_emb = timestep_embedding(
            t_B, cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift
        )
        temb = self.time_embedding(t_emb.astype(self.dtype))
        context = encoder_hidden_states_BSD.astype(self.dtype)
        x = self.conv_in(jnp.transpose(sample_BCHW, (0, 2, 3, 1)))
        skips = [x]
        for block in self.down_blocks:
            x, block_skips = block(x, temb, context)
            skips.extend(block_skips)
        x = self.mid_block(x, temb, context)
        for block in self.up_blocks:
            x = block(x, skips, temb, context)
        x = self.conv_out(jax.nn.silu(self.conv_norm_out(x)))
        return jnp.transpose(x, (0, 3, 1, 2))
