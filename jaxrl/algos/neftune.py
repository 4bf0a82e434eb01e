"""NEFTune (https://arxiv.org/abs/2310.05914), HF's `neftune_noise_alpha`, for the offline
trainers: which forwards get embedding noise, from which key, with which magnitude.

transformers hooks the model's input embeddings while the model is in training mode: every
training forward adds `U(-m, m)` noise, `m = alpha / sqrt(T * D)`, with `T` the padded length
of that forward's batch and `D` the hidden size; evaluation, prediction and generation run in
eval mode and get none. Here a trainer runs its training loss inside `training_noise`, and its
`apply_model` passes the policy it builds for those same params through `noisy_policy`, whose
forwards add the noise (`jaxrl.models.layers.embedding_noise`). A reference model (built from
other params) and the eval/predict steps (no `training_noise`) stay clean. The key is the
micro-batch's key of the jitted step, so runs and resumes are reproducible.

`T` is the length TRL's collator pads each device's share of the micro-batch to (its longest
row, or all its tokens in one row for best-fit packed SFT, TRL's padding-free mode), rounded up
to `pad_to_multiple_of` (`jaxrl.data.collate.trl_padded_lengths`), not jaxrl's one static row
length: the same noise magnitude as TRL with the same per-device batches. This file holds no
model code and no loss.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.algos.forward_view import ForwardView, view_for
from jaxrl.data.collate import trl_padded_lengths
from jaxrl.models.layers import embedding_noise

# Folded into a micro-batch's key for its noise (LoRA dropout uses another stream).
NOISE_STREAM = 0x4E4546


@dataclasses.dataclass
class _Request:
    params: Any  # the trained params: only a policy built from this object gets noise
    key: jax.Array
    alpha: float
    example_mask_B: jax.Array
    per_device: int
    multiple_of: int | None
    calls: int = 0  # forwards so far, each with its own key


_REQUEST: contextvars.ContextVar[_Request | None] = contextvars.ContextVar(
    "neftune_request", default=None
)


@contextlib.contextmanager
def training_noise(
    params: Any,
    key: jax.Array,
    alpha: float,
    example_mask_B: jax.Array,
    per_device: int,
    multiple_of: int | None = None,
) -> Iterator[None]:
    """Inside the block (a training loss being traced), policies built by `noisy_policy` from
    `params` add NEFTune noise to their token embeddings; `example_mask_B` marks the micro-batch's
    real examples, `per_device` examples share a device (`per_device_train_batch_size`)."""
    token = _REQUEST.set(_Request(params, key, alpha, example_mask_B, per_device, multiple_of))
    try:
        yield
    finally:
        _REQUEST.reset(token)


def noisy_policy(model: Any, params: Any) -> Any:
    """`model` (built from `params`), or inside `training_noise` for these params a view of it
    whose forwards add NEFTune noise."""
    return view_for(model, params, _REQUEST.get(), _NoisyForward)


class _NoisyForward(ForwardView):
    """A model whose forwards run inside `embedding_noise` (see `noisy_policy`)."""

    def _forward(self, method: Any, args: tuple, kwargs: dict) -> Any:
        names = ("input_ids_BT", "attention_mask", "positions", "segment_ids")
        bound = dict(zip(names, args, strict=False)) | kwargs
        input_ids = bound["input_ids_BT"]
        positions, segment_ids = bound.get("positions"), bound.get("segment_ids")
        r = self._request
        key = self._next_key()
        with embedding_noise(key, r.alpha, self._row_lengths(input_ids, positions, segment_ids)):
            return method(*args, **kwargs)

    def _row_lengths(self, input_ids_RT, positions_RT, segment_ids_RT) -> jax.Array:
        """TRL's padded length for each of the forward's rows `[R]`: its `R = K x B` rows are
        `K` blocks of the micro-batch's `B` examples (DPO and reward run chosen rows, then
        rejected rows)."""
        r = self._request
        rows, t = input_ids_RT.shape
        b = r.example_mask_B.shape[0]
        if positions_RT is None or rows % b:  # an unknown layout: its static length
            return jnp.full((rows,), t, jnp.int32)
        k = rows // b
        real_RT = (r.example_mask_B > 0).astype(jnp.int32)[None, :, None]
        if segment_ids_RT is not None:
            real_RT = real_RT * (segment_ids_RT > 0).reshape(k, b, t)
        else:
            real_RT = jnp.broadcast_to(real_RT, (k, b, t))
        lengths_B = trl_padded_lengths(
            positions_RT.reshape(k, b, t),
            real_RT,
            r.per_device,
            r.multiple_of,
            padding_free=segment_ids_RT is not None,
        )
        # A row with no real token (an empty padding-free row) gets finite noise.
        return jnp.tile(jnp.maximum(lengths_B, 1), k)
