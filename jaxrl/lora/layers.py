"""The adapted layers and the trace-time switches they read.

`LoraDense` (a `Dense` plus `scaling * dropout(x) A B`), `LoraRouter` and `LoraExperts` /
`LoraGptOssExperts` (PEFT's `target_parameters` on MoE routers and fused experts) keep their base
module's variables, so checkpoint paths do not move, and add `nnx.LoRAParam`s; `SavedParam` marks
`modules_to_save` params. Dropout and "base without adapter" are context variables read when a
model is traced (`jaxrl.models.adapters`). This file decides no
targets and creates no adapters (`apply.py`), and reads no files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import dropout as model_dropout
from jaxrl.models import gpt_oss, moe
from jaxrl.models.adapters import SavedParam, adapter_disabled, adapter_dropout_key
from jaxrl.models.layers import Dense, param_value

# LoraExperts' adapters, in the order PEFT nests its ParamWrappers (the experts module's
# parameter order: `gate_up_proj` innermost), with their transformers v5 parameter names.
EXPERT_ADAPTERS = ("gate_up", "down")
EXPERT_PARAMETERS = {"gate_up": "gate_up_proj", "down": "down_proj"}


class LoraDropoutId(nnx.Variable):
    """A per-layer integer folded into the dropout key, so every adapted layer (also each layer
    of a scanned stack) draws its own mask."""


# Trainable variables: what `split_lora` puts in the adapter state.
ADAPTER = nnx.Any(nnx.LoRAParam, SavedParam)

# ---------------------------------------------------------------- the adapted layers


class LoraDense(Dense):
    """`Dense` plus a low-rank update: `x W + b + scaling * dropout(x) A B`.

    Holds the base layer's own `kernel`/`bias` variables (frozen; possibly quantized) and the
    adapter `lora_a [layers?, in..., r]`, `lora_b [layers?, r, out...]`. The adapter branch runs
    in the layer's compute dtype.
    """

    def __init__(
        self,
        base: Dense,
        lora_a: nnx.LoRAParam,
        lora_b: nnx.LoRAParam,
        scaling: float,
        dropout: float,
        dropout_id: LoraDropoutId | None,
    ):
        # No Dense.__init__: the base layer's variables are reused, not re-initialised.
        self.n_in, self.dtype, self.kernel, self.bias = (
            base.n_in,
            base.dtype,
            base.kernel,
            base.bias,
        )
        self.lora_a, self.lora_b = lora_a, lora_b
        self.scaling, self.dropout = scaling, dropout
        self.dropout_id = dropout_id

    def __call__(self, x: jax.Array) -> jax.Array:
        y = super().__call__(x)
        if adapter_disabled():
            return y
        h = x.astype(self.dtype)
        key = adapter_dropout_key()
        if self.dropout > 0 and key is not None:
            key = jax.random.fold_in(key, self.dropout_id[...])
            if x.ndim - self.n_in == 2:  # [B, T, in...]: per position, the same at any T
                flat = (*h.shape[:2], math.prod(h.shape[2:]))
                keep = model_dropout.keep_mask(key, self.dropout, flat).reshape(h.shape)
            else:
                keep = jax.random.bernoulli(key, 1.0 - self.dropout, h.shape)
            h = jnp.where(keep, h / (1.0 - self.dropout), 0).astype(self.dtype)
        n_batch = x.ndim - self.n_in
        u = jax.lax.dot_general(
            h,
            self.lora_a[...].astype(self.dtype),
            ((tuple(range(n_batch, x.ndim)), tuple(range(self.n_in))), ((), ())),
        )
        delta = jnp.tensordot(u, self.lora_b[...].astype(self.dtype), axes=1)
        return y + (delta * self.scaling).astype(y.dtype)


class LoraRouter(moe.Router):
    """An MoE router with PEFT's `target_parameters` LoRA on its `gate.weight`: the logits use
    `W + scaling * A B` (`lora_a [layers?, D, r]`, `lora_b [layers?, r, E]`), folded as PEFT's
    `ParamWrapper` folds a 2-D parameter (the update is `D x E`, the size of the router)."""

    def __init__(
        self, base: moe.Router, lora_a: nnx.LoRAParam, lora_b: nnx.LoRAParam, scaling: float
    ):
        # No Router.__init__: the base router's kernel is reused.
        self.dtype, self.kernel = base.dtype, base.kernel
        self.lora_a, self.lora_b, self.scaling = lora_a, lora_b, scaling

    def weight(self) -> jax.Array:
        if adapter_disabled():
            return super().weight()
        folded = folded_weight(self.kernel, self.lora_a[...], self.lora_b[...], self.scaling)
        return folded.astype(self.dtype)


class LoraExperts(moe.Experts):
    """Stacked experts with PEFT's `target_parameters` LoRA on the fused `gate_up_proj` and/or
    `down_proj` (transformers v5's `[E, out, in]` expert tensors): every expert `e` has its own
    `A_e`, `B_e` and its rows get `scaling * (x A_e) B_e`, computed with grouped matmuls on the
    factors inside the dispatch (`moe._dispatch`), so no full-size delta is ever formed.

    `gate_up`: `lora_a [layers?, E, D, r]`, `lora_b [layers?, E, r, 2, F]` (one adapter on the
    fused gate|up projection: both halves share A, as in PEFT). `down`: `lora_a [layers?, E, F,
    r]`, `lora_b [layers?, E, r, D]`. An adapter that is absent is None.
    """

    def __init__(
        self,
        base: moe.Experts,
        adapters: Mapping[str, tuple[nnx.LoRAParam, nnx.LoRAParam, float]],
    ):
        # No Experts.__init__: the base experts' variables are reused.
        self.dtype, self.mesh, self.rules = base.dtype, base.mesh, base.rules
        self.act, self.names = base.act, base.names
        for name in base.names:
            setattr(self, name, getattr(base, name))
        self._set_adapters(adapters)

    def _set_adapters(
        self, adapters: Mapping[str, tuple[nnx.LoRAParam, nnx.LoRAParam, float]]
    ) -> None:
        for kind in EXPERT_ADAPTERS:
            a, b, scaling = adapters.get(kind, (None, None, None))
            setattr(self, f"{kind}_lora_a", a)
            setattr(self, f"{kind}_lora_b", b)
            setattr(self, f"{kind}_scaling", scaling)

    def adapters(self) -> dict[str, tuple[nnx.LoRAParam, nnx.LoRAParam, float]]:
        return {
            kind: (
                getattr(self, f"{kind}_lora_a"),
                getattr(self, f"{kind}_lora_b"),
                getattr(self, f"{kind}_scaling"),
            )
            for kind in EXPERT_ADAPTERS
            if getattr(self, f"{kind}_lora_a") is not None
        }

    def low_rank(self) -> dict[str, tuple[jax.Array, jax.Array, float]]:
        if adapter_disabled():
            return {}
        return {kind: (a[...], b[...], s) for kind, (a, b, s) in self.adapters().items()}


class LoraGptOssExperts(gpt_oss.GptOssExperts):
    """GPT-OSS's experts with PEFT's `target_parameters` LoRA on `gate_up_proj` (`[E, D, 2F]`,
    gate/up interleaved; one rank-r adapter whose `B` columns follow that interleaving in PEFT's
    file, `[E, r, 2, F]` here) and/or `down_proj` (`[E, F, D]`), applied inside the dispatch as
    `LoraExperts` does. Same adapter layout as `LoraExperts` otherwise."""

    def __init__(
        self,
        base: gpt_oss.GptOssExperts,
        adapters: Mapping[str, tuple[nnx.LoRAParam, nnx.LoRAParam, float]],
    ):
        # No GptOssExperts.__init__: the base experts' variables are reused.
        self.dtype, self.alpha, self.limit = base.dtype, base.alpha, base.limit
        self.mesh, self.rules = base.mesh, base.rules
        for name in GPT_OSS_EXPERT_PARAMS:
            setattr(self, name, getattr(base, name))
        self._set_adapters(adapters)

    _set_adapters = LoraExperts._set_adapters
    adapters = LoraExperts.adapters
    low_rank = LoraExperts.low_rank


GPT_OSS_EXPERT_PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
EXPERT_CLASSES = (moe.Experts, gpt_oss.GptOssExperts)
LORA_EXPERT_CLASSES = (LoraExperts, LoraGptOssExperts)


def folded_weight(kernel: nnx.Variable, a: jax.Array, b: jax.Array, scaling: float) -> jax.Array:
    """`W + scaling * A B` in f32 (batched over any leading axes: layers, experts)."""
    delta = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
    return param_value(kernel, jnp.float32) + scaling * delta
