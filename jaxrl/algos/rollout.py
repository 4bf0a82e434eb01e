"""The forward helpers of the online language-model methods (GRPO, RLOO): what a loss or a
scoring pass computes from `prompt + completion` rows.

A rollout batch holds `input_ids`/`attention_mask` `[B, P + C]` (left-padded prompt, then the
completion) and the mask `completion_mask` `[B, C]` (the loss's, times `tool_mask` `[B, C]` when
a rollout called tools: `loss_mask`); image prompts add `pixel_values`. Only
the C positions that predict completion tokens go through the unembedding (`jaxrl.core.logprobs`,
chunked: never a full f32 `[B, T, V]`), divided by `temperature` as TRL.

- `completion_hidden`: those positions' hidden states and the completion tokens.
- `completion_logprobs`: their log-probs (optionally with TRL's statistics, entropy among them).
- `completion_logprobs_and_entropy`: the same plus entropies differentiated through the LM head
  (GRPO's entropy bonus).
- `rollout_token_weights`: the tokens TRL's loss forward attends to (the MoE load-balancing
  loss's average).
- `make_policy_logps`: the body of the jitted scoring pass of the sampling policy's log-probs.
- `make_reference_logps`: the body of the jitted scoring pass of the reference policy (wherever
  it lives in the train state, `jaxrl.algos.reference`).
- `make_buffer_step`: one optimizer step over micro-batches sliced from the generation buffer.

Pure functions of a model and arrays: no sampler, rewards or host loop here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.algos import reference
from jaxrl.core.logprobs import token_logprobs
from jaxrl.models.adapters import disable_adapter


def completion_hidden(model: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The hidden states `[B, C, D]` at the C positions of `prompt + completion` rows that
    predict completion tokens, and those tokens `[B, C]` (see `completion_logprobs`)."""
    ids_BT = batch["input_ids"]
    n_completion = batch["completion_mask"].shape[1]
    n_prompt = ids_BT.shape[1] - n_completion
    if "pixel_values" in batch:
        # Image prompts (Gemma 3): TRL's forward gets the processor's `pixel_values` and
        # `token_type_ids` (1 on the prompt's image tokens, 0 on the completion), so each image's
        # tokens attend to the whole image.
        is_image_BT = ids_BT == model.config.vision.image_token_id
        in_prompt_T = jnp.arange(ids_BT.shape[1]) < n_prompt
        token_type_ids_BT = (is_image_BT & in_prompt_T[None]).astype(jnp.int32)
        h_BTD = model.hidden_states(
            ids_BT, batch["attention_mask"], pixel_values=batch["pixel_values"],
            token_type_ids=token_type_ids_BT,
        )  # fmt: skip
    else:
        h_BTD = model.hidden_states(ids_BT, batch["attention_mask"])
    return h_BTD[:, n_prompt - 1 : n_prompt + n_completion - 1], ids_BT[:, n_prompt:]


def loss_mask(batch: dict[str, jax.Array]) -> jax.Array:
    """`[B, C]`: the completion tokens in the loss, `completion_mask` times `tool_mask` when the
    rollout called tools (TRL: tool-result tokens are in the completion, attended to, and out
    of every loss term, KL, entropy and importance ratio)."""
    mask_BC = batch["completion_mask"]
    if "tool_mask" in batch:
        return mask_BC * batch["tool_mask"].astype(mask_BC.dtype)
    return mask_BC


def rollout_token_weights(batch: dict[str, jax.Array]) -> jax.Array:
    """`[B, P + C]` f32: the tokens of `prompt + completion` rows TRL's loss forward attends to
    (its `attention_mask`, `cat([prompt_mask, completion_mask])`), the tokens the MoE
    load-balancing loss averages over. The completion part is the loss mask, so a completion
    masked out by `mask_truncated_completions` is left out, as in TRL."""
    n_completion = batch["completion_mask"].shape[1]
    n_prompt = batch["input_ids"].shape[1] - n_completion
    prompt_BP = batch["attention_mask"][:, :n_prompt]
    return jnp.concatenate(
        [prompt_BP.astype(jnp.float32), batch["completion_mask"].astype(jnp.float32)], axis=1
    )


def completion_logprobs(
    model: Any,
    batch: dict[str, jax.Array],
    *,
    temperature: float,
    chunk_size: int,
    with_stats: bool = False,
):
    """Log-probs `[B, C]` of the completion tokens of `prompt + completion` rows.

    `batch`: `input_ids`/`attention_mask` `[B, P + C]` (left-padded prompt, then completion) and
    `completion_mask` `[B, C]`. Only the C positions that predict completion tokens go through
    the unembedding, divided by `temperature` as TRL.
    """
    h_BCD, targets_BC = completion_hidden(model, batch)
    return token_logprobs(
        h_BCD,
        model.unembed_weight(),
        targets_BC,
        chunk_size=chunk_size,
        with_stats=with_stats,
        temperature=temperature,
        logit_softcap=model.config.final_logit_softcap,
    )


def completion_logprobs_and_entropy(
    model: Any, batch: dict[str, jax.Array], *, temperature: float, chunk_size: int | None
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """`completion_logprobs(..., with_stats=True)` plus the entropies `[B, C]` with their
    gradient through the LM head, for the entropy bonus: the same forward (hidden states of
    `prompt + completion`, the C positions that predict completion tokens through the
    unembedding divided by `temperature`); the head's backward carries the entropies' gradient
    along with the log-probs' (`token_logprobs(..., entropy_grad=True)`). The returned
    statistics stay under `stop_gradient`."""
    h_BCD, targets_BC = completion_hidden(model, batch)
    logps_BC, stats = token_logprobs(
        h_BCD,
        model.unembed_weight(),
        targets_BC,
        chunk_size=chunk_size,
        with_stats=True,
        temperature=temperature,
        logit_softcap=model.config.final_logit_softcap,
        entropy_grad=True,
    )
    entropies_BC = stats["entropy"]
    return logps_BC, {**stats, "entropy": jax.lax.stop_gradient(entropies_BC)}, entropies_BC


def make_policy_logps(
    config: Any, apply_model: Callable[[Any], Any]
) -> Callable[[Any, dict[str, jax.Array]], jax.Array]:
    """`logps(params, batch) -> [B, C]`: the completion log-probs of the policy `params` (the
    sampling policy's, recomputed when a generation batch serves several iterations, or RLOO's
    KL reward in eval), at `config.temperature` with `config.logprob_chunk_size`.
    `apply_model(params)` binds the params to the model."""
    chunk = config.logprob_chunk_size

    def logps(params, batch):
        model = apply_model(params)
        return completion_logprobs(model, batch, temperature=config.temperature, chunk_size=chunk)

    return logps


def make_reference_logps(
    config: Any, apply_model: Callable[..., Any], *, peft: bool, initial_adapter: bool
) -> Callable[[Any, dict[str, jax.Array]], jax.Array]:
    """`logps(state, batch) -> [B, C]`: completion log-probs of `batch` under the reference, a
    pure function of the train state: the frozen copy (`state.frozen["ref"]`), or with LoRA
    (`peft`) the base without the adapter, or for a model that came with an adapter
    (`initial_adapter`) base + that adapter as loaded. `apply_model(params, state=None)` binds
    params (with LoRA: the adapter over the state's frozen base) to the model."""

    def ref_logps(state, batch):
        def logps(model):
            return completion_logprobs(
                model, batch, temperature=config.temperature, chunk_size=config.logprob_chunk_size
            )

        if not peft:
            return logps(apply_model(state.frozen[reference.REF]))
        if initial_adapter:
            return logps(apply_model(state.frozen[reference.REF_ADAPTER], state))
        adapter = reference.lora_base_adapter(state.params, state.frozen)
        with disable_adapter():  # read when the model is traced: the call must be inside
            return logps(apply_model(adapter, state))

    return ref_logps


def make_buffer_step(
    step: Callable[[Any, dict], Any], steps_per_generation: int
) -> Callable[[Any, dict[str, jax.Array], jax.Array], Any]:
    """`update(state, buffer, slices_A) -> step(state, batch_A)`: the generation buffer's rows
    `[steps_per_generation * b, ...]` viewed as `steps_per_generation` slices of b rows, micro-step
    j of the optimizer step (`step`, a `make_train_step`) taking slice `slices_A[j]`."""
    spg = steps_per_generation

    def update(state, buffer, slices_A):
        # Buffer rows [spg * b, ...] -> [spg, b, ...]; micro-step j takes slice slices_A[j].
        batch_A = jax.tree.map(
            lambda x: x.reshape(spg, x.shape[0] // spg, *x.shape[1:])[slices_A], buffer
        )
        return step(state, batch_A)

    return update


def sampling_correction_metrics(
    train_logps_BC: jax.Array,
    sampling_logps_BC: jax.Array,
    mask_BC: jax.Array,
    *,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> dict[str, jax.Array]:
    """TRL's sampling-correction metrics of a generation batch: how far the sampler's log-probs
    of the completion tokens are from the training forward's on the same rows.

    `sampling/sampling_logp_difference/mean|max`: |train - sampler| over the completion tokens
    (`mask_BC`). `sampling/importance_sampling_ratio/min|mean|max`: TRL's
    `vllm_importance_sampling_mode` ratio exp(train - sampler), per token (`token_*`, over the
    completion tokens) or per sequence (`sequence_*`, the exp of the row's summed difference,
    over all rows), clamped to [clip_min, clip_max] (`*_truncate`) or set to 0 outside it
    (`*_mask`). All 0 when there is no completion token (as TRL)."""
    if mode not in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        raise ValueError(
            f"Unknown importance sampling mode {mode!r}; use token_truncate, token_mask, "
            "sequence_truncate or sequence_mask."
        )
    mask_BC = mask_BC.astype(bool)
    diff_BC = jnp.where(mask_BC, train_logps_BC.astype(jnp.float32) - sampling_logps_BC, 0.0)
    n_tokens = jnp.sum(mask_BC)
    delta_BC = jnp.abs(diff_BC)
    lo = -jnp.inf if clip_min is None else clip_min
    hi = jnp.inf if clip_max is None else clip_max
    if mode.startswith("sequence"):
        ratio_R = jnp.exp(jnp.sum(diff_BC, axis=-1))
        valid_R = jnp.ones_like(ratio_R, dtype=bool)
    else:
        ratio_R, valid_R = jnp.exp(diff_BC).reshape(-1), mask_BC.reshape(-1)
    if mode.endswith("truncate"):
        ratio_R = jnp.clip(ratio_R, lo, hi)
    else:
        ratio_R = jnp.where((ratio_R < lo) | (ratio_R > hi), 0.0, ratio_R)
    n_ratios = jnp.sum(valid_R)

    def guarded(value: jax.Array, count: jax.Array) -> jax.Array:
        return jnp.where(count > 0, value, 0.0)

    return {
        "sampling/sampling_logp_difference/mean": guarded(
            jnp.sum(delta_BC) / jnp.maximum(n_tokens, 1), n_tokens
        ),
        "sampling/sampling_logp_difference/max": guarded(jnp.max(delta_BC), n_tokens),
        "sampling/importance_sampling_ratio/min": guarded(
            jnp.min(jnp.where(valid_R, ratio_R, jnp.inf)), n_ratios
        ),
        "sampling/importance_sampling_ratio/mean": guarded(
            jnp.sum(jnp.where(valid_R, ratio_R, 0.0)) / jnp.maximum(n_ratios, 1), n_ratios
        ),
        "sampling/importance_sampling_ratio/max": guarded(
            jnp.max(jnp.where(valid_R, ratio_R, -jnp.inf)), n_ratios
        ),
    }


_jit_sampling_metrics = jax.jit(
    sampling_correction_metrics, static_argnames=("mode", "clip_min", "clip_max")
)


def rollout_sampling_metrics(
    config: Any, train_logps_BC: jax.Array, sampling_logps_BC: jax.Array, batch: dict
) -> dict[str, jax.Array]:
    """`sampling_correction_metrics` of a rollout batch (its `completion_mask`), with the
    config's TRL `vllm_importance_sampling_mode`/`_clip_min`/`_clip_max` where it has them
    (else TRL's defaults: sequence_mask, None, 3.0)."""
    return _jit_sampling_metrics(
        train_logps_BC,
        sampling_logps_BC,
        batch["completion_mask"],
        mode=getattr(config, "vllm_importance_sampling_mode", "sequence_mask"),
        clip_min=getattr(config, "vllm_importance_sampling_clip_min", None),
        clip_max=getattr(config, "vllm_importance_sampling_clip_max", 3.0),
    )
