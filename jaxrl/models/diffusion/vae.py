"""Stable Diffusion's `AutoencoderKL` (encoder, decoder, quant convs) in Flax NNX with diffusers'
module names: `encode` gives the latent distribution's mean and log-variance, `decode` the image.

GroupNorm eps is 1e-6 throughout (diffusers' VAE); the mid-block attention is single-headed with
biased q/k/v/out projections. NCHW at the boundary, NHWC inside.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.diffusion.nn import Conv2d, Dtypes, GroupNorm, Linear, multi_head_attention
from jaxrl.models.diffusion.unet import Downsample2D, ResnetBlock2D, Upsample2D

EPS = 1e-6
REQUIRED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "act_fn": ("silu",),
    "use_quant_conv": (True,),
    "use_post_quant_conv": (True,),
    "mid_block_add_attention": (True,),
    "shift_factor": (None,),
    "latents_mean": (None,),
    "latents_std": (None,),
}


@dataclasses.dataclass(frozen=True)
class VAEConfig:
    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    latent_channels: int = 4
    norm_num_groups: int = 32
    scaling_factor: float = 0.18215
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_diffusers(cls, raw: Mapping[str, Any]) -> VAEConfig:
        for key, allowed in REQUIRED_DEFAULTS.items():
            if raw.get(key, allowed[0]) not in allowed:
                raise ValueError(
                    f"VAE config {key}={raw[key]!r} is not supported by jaxrl's AutoencoderKL "
                    f"(only {allowed[0]!r})."
                )
        for key, want in (
            ("down_block_types", "DownEncoderBlock2D"),
            ("up_block_types", "UpDecoderBlock2D"),
        ):
            bad = [t for t in raw.get(key, [want]) if t != want]
            if bad:
                raise ValueError(f"VAE {key} {bad} are not supported; only {want!r}.")
        return cls(
            in_channels=raw.get("in_channels", 3),
            out_channels=raw.get("out_channels", 3),
            block_out_channels=tuple(raw.get("block_out_channels", (64,))),
            layers_per_block=raw.get("layers_per_block", 1),
            latent_channels=raw.get("latent_channels", 4),
            norm_num_groups=raw.get("norm_num_groups", 32),
            scaling_factor=raw.get("scaling_factor", 0.18215),
            raw=dict(raw),
        )


class AttentionBlock(nnx.Module):
    """Single-head self-attention over H*W with a GroupNorm in front and a residual."""

    def __init__(self, channels: int, groups: int, dt: Dtypes, rngs: nnx.Rngs | None):
        self.group_norm = GroupNorm(groups, channels, EPS, dt)
        self.to_q = Linear(channels, channels, dt, rngs, axes=("embed", "heads"))
        self.to_k = Linear(channels, channels, dt, rngs, axes=("embed", "heads"))
        self.to_v = Linear(channels, channels, dt, rngs, axes=("embed", "heads"))
        self.to_out = nnx.List([Linear(channels, channels, dt, rngs, axes=("heads", "embed"))])

    def __call__(self, x_BHWC: jax.Array) -> jax.Array:
        b, h, w, c = x_BHWC.shape
        y = self.group_norm(x_BHWC).reshape(b, h * w, c)
        y = multi_head_attention(self.to_q(y), self.to_k(y), self.to_v(y), 1)
        return self.to_out[0](y).reshape(b, h, w, c) + x_BHWC.astype(y.dtype)


class MidBlock(nnx.Module):
    def __init__(self, channels: int, groups: int, dt: Dtypes, rngs: nnx.Rngs | None):
        self.resnets = nnx.List(
            [ResnetBlock2D(channels, channels, None, groups, EPS, dt, rngs) for _ in range(2)]
        )
        self.attentions = nnx.List([AttentionBlock(channels, groups, dt, rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.resnets[1](self.attentions[0](self.resnets[0](x, None)), None)


class EncoderBlock(nnx.Module):
    def __init__(
        self,
        n_in: int,
        n_out: int,
        num: int,
        down: bool,
        groups: int,
        dt: Dtypes,
        rngs: nnx.Rngs | None,
    ):
        self.resnets = nnx.List(
            [
                ResnetBlock2D(n_in if j == 0 else n_out, n_out, None, groups, EPS, dt, rngs)
                for j in range(num)
            ]
        )
        self.downsamplers = nnx.List([Downsample2D(n_out, dt, rngs, vae=True)]) if down else None

    def __call__(self, x: jax.Array) -> jax.Array:
        for resnet in self.resnets:
            x = resnet(x, None)
        return self.downsamplers[0](x) if self.downsamplers is not None else x


class DecoderBlock(nnx.Module):
    def __init__(
        self,
        n_in: int,
        n_out: int,
        num: int,
        up: bool,
        groups: int,
        dt: Dtypes,
        rngs: nnx.Rngs | None,
    ):
        self.resnets = nnx.List(
            [
                ResnetBlock2D(n_in if j == 0 else n_out, n_out, None, groups, EPS, dt, rngs)
                for j in range(num)
            ]
        )
        self.upsamplers = nnx.List([Upsample2D(n_out, dt, rngs)]) if up else None

    def __call__(self, x: jax.Array) -> jax.Array:
        for resnet in self.resnets:
            x = resnet(x, None)
        return self.upsamplers[0](x) if self.upsamplers is not None else x


class Encoder(nnx.Module):
    def __init__(self, cfg: VAEConfig, dt: Dtypes, rngs: nnx.Rngs | None):
        ch, g = cfg.block_out_channels, cfg.norm_num_groups
        self.conv_in = Conv2d(cfg.in_channels, ch[0], 3, dt, rngs, padding=1)
        self.down_blocks = nnx.List(
            [
                EncoderBlock(
                    ch[max(i - 1, 0)], ch[i], cfg.layers_per_block, i < len(ch) - 1, g, dt, rngs
                )
                for i in range(len(ch))
            ]
        )
        self.mid_block = MidBlock(ch[-1], g, dt, rngs)
        self.conv_norm_out = GroupNorm(g, ch[-1], EPS, dt)
        self.conv_out = Conv2d(ch[-1], 2 * cfg.latent_channels, 3, dt, rngs, padding=1)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


class Decoder(nnx.Module):
    def __init__(self, cfg: VAEConfig, dt: Dtypes, rngs: nnx.Rngs | None):
        rev, g = cfg.block_out_channels[::-1], cfg.norm_num_groups
        self.conv_in = Conv2d(cfg.latent_channels, rev[0], 3, dt, rngs, padding=1)
        self.mid_block = MidBlock(rev[0], g, dt, rngs)
        self.up_blocks = nnx.List(
            [
                DecoderBlock(
                    rev[max(i - 1, 0)],
                    rev[i],
                    cfg.layers_per_block + 1,
                    i < len(rev) - 1,
                    g,
                    dt,
                    rngs,
                )
                for i in range(len(rev))
            ]
        )
        self.conv_norm_out = GroupNorm(g, rev[-1], EPS, dt)
        self.conv_out = Conv2d(rev[-1], cfg.out_channels, 3, dt, rngs, padding=1)

    def __call__(self, z: jax.Array) -> jax.Array:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


class AutoencoderKL(nnx.Module):
    """`encode(images_BCHW) -> (mean, logvar)` of the latent Gaussian (logvar clipped to
    [-30, 20] as diffusers); `decode(latents_BCHW) -> images_BCHW` (in [-1, 1] scale). Latents
    here are unscaled: multiply by `config.scaling_factor` for the UNet, as diffusers does."""

    def __init__(
        self,
        config: VAEConfig,
        rngs: nnx.Rngs | None = None,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
    ):
        self.config = config
        dt = Dtypes(dtype, param_dtype)
        lat = config.latent_channels
        self.encoder = Encoder(config, dt, rngs)
        self.decoder = Decoder(config, dt, rngs)
        self.quant_conv = Conv2d(2 * lat, 2 * lat, 1, dt, rngs)
        self.post_quant_conv = Conv2d(lat, lat, 1, dt, rngs)

    def encode(self, images_BCHW: jax.Array) -> tuple[jax.Array, jax.Array]:
        moments = self.quant_conv(self.encoder(jnp.transpose(images_BCHW, (0, 2, 3, 1))))
        mean, logvar = jnp.split(jnp.transpose(moments, (0, 3, 1, 2)), 2, axis=1)
        return mean, jnp.clip(logvar, -30.0, 20.0)

    def decode(self, latents_BCHW: jax.Array) -> jax.Array:
        z = self.post_quant_conv(jnp.transpose(latents_BCHW, (0, 2, 3, 1)))
        return jnp.transpose(self.decoder(z), (0, 3, 1, 2))
