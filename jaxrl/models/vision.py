"""Gemma 3's vision side and its image-text forward (`Gemma3ForConditionalGeneration`).

- `SiglipVisionModel`: SigLIP's encoder (patch-embedding convolution as a matmul over
  flattened patches, learned position embeddings, pre-LN layers with biased multi-head
  attention and a gelu-tanh MLP, a final LayerNorm). Its pooling head is never run by Gemma 3
  and is not built (its weights, if any, are copied through on save).
- `Gemma3MultiModalProjector`: average pooling of the patch grid to `mm_tokens_per_image`
  tokens, Gemma's RMSNorm, a projection to the language model's width.
- `Gemma3ForConditionalGeneration`: the Llama-family Gemma 3 language model (`model`, as a
  text-only load has it) plus the two above; image features replace the embeddings of the
  image tokens, and with `token_type_ids` each image's tokens attend to the whole image
  (transformers' training mask), through the attention kernels' key limit.

Attribute names follow transformers v5's module tree (`vision_tower.encoder.layers...`,
`multi_modal_projector...`), so checkpoint keys and PEFT module names map one to one (`hf_keys.py`,
`jaxrl.lora`). This file does no data processing: pixel values come from the processor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.attention import full_attention
from jaxrl.models.config import ModelConfig, VisionConfig
from jaxrl.models.dropout import model_dropout
from jaxrl.models.kv_cache import Cache, CacheView
from jaxrl.models.layers import (
    Dense,
    Embed,
    LayerNorm,
    RMSNorm,
    activation,
    constrain_batch,
    make_param,
    normal_init,
    param_value,
    remat_wrap,
)
from jaxrl.models.llama import LlamaForCausalLM


class PatchEmbedding(nnx.Module):
    """SigLIP's `Conv2d(C, D, kernel=stride=patch)`: `weight` in torch's layout [D, C, p, p]
    (so the checkpoint tensor maps as is), applied as one matmul over flattened patches."""

    def __init__(self, vision: VisionConfig, config: ModelConfig, rngs: nnx.Rngs):
        d, c, p = vision.hidden_size, vision.num_channels, vision.patch_size
        self.patch = p
        self.dtype = config.dtype
        self.weight = make_param(
            rngs, normal_init(config.initializer_range), (d, c, p, p),
            ("embed", None, None, None), config.param_dtype,
        )  # fmt: skip
        self.bias = make_param(
            rngs, jax.nn.initializers.zeros, (d,), ("embed",), config.param_dtype
        )

    def __call__(self, pixels_NCHW: jax.Array) -> jax.Array:
        """[N, C, H, W] -> [N, (H / p) * (W / p), D], patches in row-major order (the conv
        output's `flatten(2)`)."""
        n, c, h, w = pixels_NCHW.shape
        p = self.patch
        x = pixels_NCHW.reshape(n, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5)
        x = x.reshape(n, (h // p) * (w // p), c * p * p).astype(self.dtype)
        kernel_DCPP = param_value(self.weight, self.dtype)  # int8 leaves dequantize here
        kernel = kernel_DCPP.reshape(kernel_DCPP.shape[0], -1)
        y = jnp.matmul(x, kernel.T, preferred_element_type=jnp.float32)
        return (y + param_value(self.bias, jnp.float32)).astype(self.dtype)


class SiglipVisionEmbeddings(nnx.Module):
    def __init__(self, vision: VisionConfig, config: ModelConfig, rngs: nnx.Rngs):
        self.patch_embedding = PatchEmbedding(vision, config, rngs)
        self.position_embedding = Embed(
            vision.patches_per_side**2, vision.hidden_size, "position", config, rngs
        )
        self.image_size = vision.image_size

    def __call__(self, pixels_NCHW: jax.Array) -> jax.Array:
        if pixels_NCHW.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"pixel_values are {pixels_NCHW.shape[-2]} x {pixels_NCHW.shape[-1]} images; this "
                f"vision tower takes {self.image_size} x {self.image_size} (the processor's "
                "resize)."
            )
        patches_NPD = self.patch_embedding(pixels_NCHW)
        positions = self.position_embedding(jnp.arange(patches_NPD.shape[1]))
        return patches_NPD + positions[None]


class SiglipAttention(nnx.Module):
    """Bidirectional multi-head self-attention with biased q/k/v/out projections."""

    def __init__(self, vision: VisionConfig, config: ModelConfig, rngs: nnx.Rngs):
        d, n = vision.hidden_size, vision.num_heads
        h = d // n
        heads = (("embed",), ("heads", "head_dim"))
        self.q_proj = Dense((d,), (n, h), *heads, config, rngs, use_bias=True)
        self.k_proj = Dense((d,), (n, h), *heads, config, rngs, use_bias=True)
        self.v_proj = Dense((d,), (n, h), *heads, config, rngs, use_bias=True)
        self.out_proj = Dense(
            (n, h), (d,), ("heads", "head_dim"), ("embed",), config, rngs, use_bias=True
        )
        self.impl = config.attention_impl

    def __call__(self, x_NPD: jax.Array) -> jax.Array:
        q, k, v = self.q_proj(x_NPD), self.k_proj(x_NPD), self.v_proj(x_NPD)
        return self.out_proj(full_attention(q, k, v, self.impl))


class SiglipMLP(nnx.Module):
    def __init__(self, vision: VisionConfig, config: ModelConfig, rngs: nnx.Rngs):
        d, f = vision.hidden_size, vision.intermediate_size
        self.fc1 = Dense((d,), (f,), ("embed",), ("mlp",), config, rngs, use_bias=True)
        self.fc2 = Dense((f,), (d,), ("mlp",), ("embed",), config, rngs, use_bias=True)
        self.act = activation(vision.hidden_act)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nnx.Module):
    def __init__(self, vision: VisionConfig, config: ModelConfig, rngs: nnx.Rngs):
        d, eps = vision.hidden_size, vision.layer_norm_eps
        self.layer_norm1 = LayerNorm(d, eps, config)
        self.self_attn = SiglipAttention(vision, config, rngs)
        self.layer_norm2 = LayerNorm(d, eps, config)
        self.mlp = SiglipMLP(vision, config, rngs)

    def __call__(self, h_NPD: jax.Array) -> jax.Array:
        h_NPD = h_NPD + self.self_attn(self.layer_norm1(h_NPD))
        return h_NPD + self.mlp(self.layer_norm2(h_NPD))


class SiglipEncoder(nnx.Module):
    """The encoder layers, unrolled (an `nnx.List` under HF's `layers` name) whatever
    `scan_layers` says for the language model; each rematerialised by the model's
    `remat_policy` (transformers checkpoints SigLIP's layers too under gradient checkpointing),
    its output pinned batch-sharded as the language model's layers are."""

    def __init__(self, vision: VisionConfig, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        self.layers = nnx.List(
            [SiglipEncoderLayer(vision, config, rngs) for _ in range(vision.num_layers)]
        )

    def __call__(self, h_NPD: jax.Array) -> jax.Array:
        h_NPD = constrain_batch(h_NPD, self.config)
        for layer in self.layers:
            graphdef, state = nnx.split(layer)

            def run(h, state, graphdef=graphdef):
                return constrain_batch(nnx.merge(graphdef, state)(h), self.config)

            h_NPD = remat_wrap(run, self.config.remat_policy, self.config.activation_offloading)(
                h_NPD, state
            )
        return h_NPD


class SiglipVisionModel(nnx.Module):
    """transformers' `SiglipVisionModel` as Gemma 3 uses it (transformers v5's module tree: no
    `vision_model` level; `hf.py` reads checkpoints that have one): last hidden states, after
    the final LayerNorm."""

    def __init__(self, vision: VisionConfig, config: ModelConfig, rngs: nnx.Rngs):
        self.embeddings = SiglipVisionEmbeddings(vision, config, rngs)
        self.encoder = SiglipEncoder(vision, config, rngs)
        self.post_layernorm = LayerNorm(vision.hidden_size, vision.layer_norm_eps, config)

    def __call__(self, pixels_NCHW: jax.Array) -> jax.Array:
        """[N, C, H, W] -> [N, patches, D]."""
        return self.post_layernorm(self.encoder(self.embeddings(pixels_NCHW)))


class Gemma3MultiModalProjector(nnx.Module):
    """Patch states [N, P, Dv] -> image tokens [N, mm_tokens_per_image, D]: average pooling of
    the patch grid (kernel = stride = patches per side / tokens per side), Gemma's RMSNorm
    (`mm_soft_emb_norm`, eps the vision config's), then `x @ mm_input_projection_weight`
    ([Dv, D], used untransposed as in transformers), in the vision states' dtype."""

    def __init__(self, vision: VisionConfig, config: ModelConfig, rngs: nnx.Rngs):
        self.vision = vision
        self.dtype = config.dtype
        # Zero at init, as transformers' `_init_weights` starts it.
        self.mm_input_projection_weight = make_param(
            rngs, jax.nn.initializers.zeros, (vision.hidden_size, config.hidden_size),
            ("embed", "embed"), config.param_dtype,
        )  # fmt: skip
        self.mm_soft_emb_norm = RMSNorm(
            vision.hidden_size, vision.layer_norm_eps, config.replace(norm_offset=1.0)
        )

    def __call__(self, states_NPD: jax.Array) -> jax.Array:
        v = self.vision
        n, _, d = states_NPD.shape
        side, tokens = v.patches_per_side, v.tokens_per_side
        k = side // tokens
        grid = states_NPD.astype(jnp.float32).reshape(n, tokens, k, tokens, k, d)
        pooled = grid.mean(axis=(2, 4)).astype(states_NPD.dtype).reshape(n, tokens * tokens, d)
        normed = self.mm_soft_emb_norm(pooled)
        w = param_value(self.mm_input_projection_weight, self.dtype)
        # A compute-dtype matmul (bf16 out under autocast), then the vision states' dtype.
        out = jnp.matmul(normed.astype(self.dtype), w, preferred_element_type=self.dtype)
        return out.astype(states_NPD.dtype)


def image_key_limit(token_type_ids_BT: jax.Array) -> jax.Array:
    """[B, T] int32: the last key each query sees. Image tokens (`token_type_ids == 1`) see up
    to the last token of their image (a maximal run of image tokens: transformers'
    `get_block_sequence_ids_for_mask`), other tokens up to themselves."""
    is_image = token_type_ids_BT == 1
    seq_len = is_image.shape[1]
    idx_T = jnp.arange(seq_len, dtype=jnp.int32)
    next_image = jnp.pad(is_image[:, 1:], ((0, 0), (0, 1)))
    run_end_BT = jnp.where(is_image & ~next_image, idx_T, seq_len)
    limit_BT = jax.lax.cummin(run_end_BT, axis=1, reverse=True)
    return jnp.where(is_image, limit_BT, idx_T).astype(jnp.int32)


def merge_image_features(
    h_BTD: jax.Array, is_image_BT: jax.Array, features: jax.Array
) -> jax.Array:
    """`h` with its image positions replaced by image features, in order. `features` is
    `[N, M, D]` (transformers' layout: every image of the batch, filling the batch's image
    positions in row-major order, as `masked_scatter`) or `[B, I, M, D]` (row b's images fill
    row b's image positions; padding images past a row's count are never read)."""
    b, t, d = h_BTD.shape
    if features.ndim == 3:
        flat_KD = features.reshape(-1, d)
        index_BT = (jnp.cumsum(is_image_BT.reshape(-1)) - 1).reshape(b, t)
        gathered_BTD = jnp.take(flat_KD, jnp.clip(index_BT, 0, flat_KD.shape[0] - 1), axis=0)
    else:
        rows_BKD = features.reshape(b, -1, d)
        index_BT = jnp.clip(jnp.cumsum(is_image_BT, axis=1) - 1, 0, rows_BKD.shape[1] - 1)
        gathered_BTD = jnp.take_along_axis(rows_BKD, index_BT[..., None], axis=1)
    return jnp.where(is_image_BT[..., None], gathered_BTD.astype(h_BTD.dtype), h_BTD)


def _check_image_token_count(is_image_BT: jax.Array, pixel_values: jax.Array, tokens: int):
    """transformers' check that image tokens and image features agree, where the values are
    concrete (eager calls; the trainers check their batches on the host)."""
    if isinstance(is_image_BT, jax.core.Tracer) or isinstance(pixel_values, jax.core.Tracer):
        return
    if pixel_values.ndim == 4:
        want, got = pixel_values.shape[0] * tokens, int(jnp.sum(is_image_BT))
        if want != got:
            raise ValueError(
                f"Image features and image tokens do not match, tokens: {got}, features: {want} "
                f"({pixel_values.shape[0]} images x {tokens} tokens each)."
            )
    elif int(jnp.max(jnp.sum(is_image_BT, axis=1))) > pixel_values.shape[1] * tokens:
        raise ValueError(
            f"A row has more image tokens than its {pixel_values.shape[1]} images give "
            f"({tokens} each)."
        )


class Gemma3ForConditionalGeneration(LlamaForCausalLM):
    """`model(input_ids, attention_mask, positions, segment_ids, pixel_values=...,
    token_type_ids=...) -> logits_BTV`; without images it is the text-only Gemma 3 LM.

    `pixel_values`: `[N, C, H, W]` (transformers' layout, the processor's output: the batch's
    images in order) or `[B, I, C, H, W]` (I images per row, in the order of the row's image
    tokens; rows with fewer images pad with any values). `token_type_ids` [B, T] (1 on image
    tokens, the processor's output): each image's tokens attend to the whole image, as
    transformers does in training; without it attention is causal everywhere (transformers'
    generation after the prompt)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        if config.vision is None:
            raise ValueError("Gemma3ForConditionalGeneration needs a config with `vision`.")
        super().__init__(config, rngs)
        self.vision_tower = SiglipVisionModel(config.vision, config, rngs)
        self.multi_modal_projector = Gemma3MultiModalProjector(config.vision, config, rngs)

    def image_features(self, pixel_values: jax.Array) -> jax.Array:
        """[..., C, H, W] images -> [..., mm_tokens_per_image, D] language-model embeddings."""
        lead = pixel_values.shape[:-3]
        flat = pixel_values.reshape(-1, *pixel_values.shape[-3:])
        tokens = self.multi_modal_projector(self.vision_tower(flat))
        return tokens.reshape(*lead, *tokens.shape[1:])

    def embed_with_images(
        self, input_ids_BT: jax.Array, pixel_values: jax.Array | None, image_features=None
    ) -> jax.Array:
        """Token embeddings [B, T, D] with the image tokens' replaced by the features of
        `pixel_values` (or of `image_features`, see `hidden_states`)."""
        vision = self.config.vision
        is_image_BT = input_ids_BT == vision.image_token_id
        ids_BT = input_ids_BT
        if vision.image_token_id >= self.config.vocab_size:  # out of vocabulary: embed pad id 0
            ids_BT = jnp.where(is_image_BT, 0, input_ids_BT)
        h_BTD = self.backbone.embed_tokens(ids_BT)
        if pixel_values is not None:
            if pixel_values.ndim not in (4, 5):
                raise ValueError(
                    f"pixel_values must be [N, C, H, W] or [B, I, C, H, W]; got shape "
                    f"{pixel_values.shape}."
                )
            _check_image_token_count(is_image_BT, pixel_values, vision.mm_tokens_per_image)
            h_BTD = merge_image_features(h_BTD, is_image_BT, self.image_features(pixel_values))
        elif image_features is not None:
            h_BTD = merge_image_features(h_BTD, is_image_BT, image_features)
        return h_BTD

    def cached_hidden_states(
        self,
        input_ids_BT: jax.Array,
        positions_BT: jax.Array,
        cache: Cache,
        view: CacheView,
        pixel_values: jax.Array | None = None,
    ) -> tuple[jax.Array, Cache]:
        """`LlamaForCausalLM.cached_hidden_states`; with `pixel_values` (a prefill: `view.prefill`)
        the prompt's image tokens take the image features and attend within their image both
        ways, as the training forward with `token_type_ids` (transformers' `generate` passes
        them to the first forward only: later tokens attend causally)."""
        if pixel_values is None:
            return super().cached_hidden_states(input_ids_BT, positions_BT, cache, view)
        if not view.prefill:
            raise ValueError("pixel_values go with the prompt's prefill, not a decode step.")
        token_type_ids_BT = (input_ids_BT == self.config.vision.image_token_id).astype(jnp.int32)
        view = view.replace(key_limit_BT=image_key_limit(token_type_ids_BT))
        with model_dropout(None):
            h_BTD = self.embed_with_images(input_ids_BT, pixel_values)
            return self.backbone.cached(
                input_ids_BT, positions_BT, cache, view, inputs_embeds=h_BTD
            )

    def hidden_states(
        self,
        input_ids_BT: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        pixel_values: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        image_features: jax.Array | None = None,
    ) -> jax.Array:
        """`image_features` (instead of `pixel_values`): `image_features(pixel_values)` computed
        beforehand, `[N, M, D]` or `[B, I, M, D]` as `merge_image_features` takes them (rows
        that share images, such as a DPO pair's two rows, run the vision tower once)."""
        if pixel_values is not None and image_features is not None:
            raise ValueError("Give pixel_values or image_features, not both.")
        if pixel_values is None and token_type_ids is None and image_features is None:
            return self.backbone(input_ids_BT, attention_mask, positions, segment_ids)
        h_BTD = self.embed_with_images(input_ids_BT, pixel_values, image_features)
        limit_BT = None if token_type_ids is None else image_key_limit(token_type_ids)
        return self.backbone(
            input_ids_BT, attention_mask, positions, segment_ids,
            inputs_embeds=h_BTD, key_limit_BT=limit_BT,
        )  # fmt: skip
