"""The static engine: one prefill of the whole batch, then one `lax.while_loop` that decodes
every row in lockstep until the last row is done (rows that finished early ride along).

Every row writes the same cache slot at each step (left-padded prompts), so the write index is
one scalar. Row r's token t is drawn with `row_keys(rng, r, t)`, the key the continuous engine
gives the same row, so both engines return the same completions.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.core.logprobs import unembed_logits
from jaxrl.core.sampling import choose_tokens, mark_seen, row_keys, token_presence
from jaxrl.generation.config import GenerationConfig
from jaxrl.generation.steps import (
    NO_STOPS,
    SamplerSpec,
    SamplingState,
    StopTables,
    stops_after,
    traced,
)
from jaxrl.models.kv_cache import CacheView, cache_shardings, init_cache
from jaxrl.models.masks import default_positions
from jaxrl.parallel import batch_sharding


def prefill_body(
    spec: SamplerSpec,
    params: Any,
    prompt_ids_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    rng: jax.Array,
    config: GenerationConfig,
    group_size: int = 1,
    pixel_values: jax.Array | None = None,
    limits_B: jax.Array | None = None,
    stop_BK: jax.Array | None = None,
    tables: StopTables = NO_STOPS,
) -> SamplingState:
    model = nnx.merge(spec.graphdef, params)
    batch, prompt_len = prompt_ids_BP.shape
    n_new = config.max_new_tokens
    cache_len = prompt_len + n_new - 1  # the last chosen token is never fed back
    cache = init_cache(model.config, batch, cache_len, spec.mesh, spec.rules)
    key_mask_BS = jnp.concatenate(
        [prompt_mask_BP.astype(bool), jnp.ones((batch, n_new - 1), bool)], axis=1
    )
    positions_BP = default_positions(prompt_mask_BP, None, prompt_len)
    view = CacheView(jnp.zeros((), jnp.int32), key_mask_BS, prefill=True)
    if pixel_values is None:  # text prompts: the text-only program, unchanged
        h_BPD, cache = model.cached_hidden_states(prompt_ids_BP, positions_BP, cache, view)
    else:
        h_BPD, cache = model.cached_hidden_states(
            prompt_ids_BP, positions_BP, cache, view, pixel_values=pixel_values
        )
    # Left padding: every row's last prompt token sits in the last slot.
    logits_BV = unembed_logits(
        h_BPD[:, -1], model.unembed_weight(), model.config.final_logit_softcap
    )
    seen_BV = None
    if config.repetition_penalty != 1.0:
        # transformers penalises every id of input_ids but its left padding (generate passes
        # the leading pad count as `prompt_ignore_length`); here padding is always left.
        seen_BV = token_presence(prompt_ids_BP, prompt_mask_BP, logits_BV.shape[-1])
    if group_size > 1:
        # One prefill per prompt; its cache rows serve the whole group (rows i*G .. i*G+G-1).
        batch *= group_size
        cache, logits_BV, key_mask_BS, prompt_mask_BP, seen_BV, stop_BK = (
            jax.tree.map(lambda x, a=axis: jnp.repeat(x, group_size, axis=a), tree)
            for tree, axis in (
                (cache, 1 if model.config.scan_layers else 0),
                (logits_BV, 0),
                (key_mask_BS, 0),
                (prompt_mask_BP, 0),
                (seen_BV, 0),
                (stop_BK, 0),
            )
        )
        if spec.mesh is not None:
            cache = jax.lax.with_sharding_constraint(
                cache, cache_shardings(model.config, batch, cache_len, spec.mesh, spec.rules)
            )
    if seen_BV is not None and spec.mesh is not None:
        seen_BV = jax.lax.with_sharding_constraint(seen_BV, batch_sharding(spec.mesh, spec.rules))
    step = jnp.zeros((), jnp.int32)
    keys_B = row_keys(rng, jnp.arange(batch), step)
    tokens_B, logprobs_B = choose_tokens(logits_BV, keys_B, step, config, seen_BV)
    recent_BW = None
    if tables.sequences_SW is not None:
        recent_BW = jnp.full((batch, tables.sequences_SW.shape[1]), -2, jnp.int32)
    state = SamplingState(
        step=step + 1,
        tokens_BN=jnp.full((batch, n_new), config.pad_id, jnp.int32).at[:, 0].set(tokens_B),
        logprobs_BN=jnp.zeros((batch, n_new), jnp.float32).at[:, 0].set(logprobs_B),
        done_B=jnp.zeros((batch,), bool),
        lengths_B=jnp.ones((batch,), jnp.int32),
        positions_B=jnp.sum(prompt_mask_BP, axis=1).astype(jnp.int32),
        key_mask_BS=key_mask_BS,
        cache=cache,
        rng=rng,
        limits_B=limits_B.astype(jnp.int32),
        seen_BV=None if seen_BV is None else mark_seen(seen_BV, tokens_B),
        recent_BW=recent_BW,
        stop_BK=stop_BK,
    )
    done_B, recent_BW, stop_BK = stops_after(
        tokens_B, state.lengths_B, state.limits_B, recent_BW, stop_BK,
        jnp.asarray(config.stop_ids, jnp.int32), tables,
    )  # fmt: skip
    return state.replace(done_B=done_B, recent_BW=recent_BW, stop_BK=stop_BK)


def decode_body(
    spec: SamplerSpec,
    params: Any,
    state: SamplingState,
    config: GenerationConfig,
    tables: StopTables = NO_STOPS,
) -> tuple[SamplingState, jax.Array]:
    model = nnx.merge(spec.graphdef, params)
    unembed_DV = model.unembed_weight()
    n_new = config.max_new_tokens
    prompt_len = state.key_mask_BS.shape[1] - (n_new - 1)
    stop_ids = jnp.asarray(config.stop_ids, jnp.int32)
    rows_B = jnp.arange(state.tokens_BN.shape[0])

    def unfinished(s: SamplingState) -> jax.Array:
        return (s.step < n_new) & ~jnp.all(s.done_B)

    def one_token(s: SamplingState) -> SamplingState:
        last_B1 = jax.lax.dynamic_slice_in_dim(s.tokens_BN, s.step - 1, 1, axis=1)
        view = CacheView(prompt_len + s.step - 1, s.key_mask_BS)
        h_B1D, cache = model.cached_hidden_states(last_B1, s.positions_B[:, None], s.cache, view)
        logits_BV = unembed_logits(h_B1D[:, 0], unembed_DV, model.config.final_logit_softcap)
        keys_B = row_keys(s.rng, rows_B, s.step)
        tokens_B, logprobs_B = choose_tokens(logits_BV, keys_B, s.step, config, s.seen_BV)
        tokens_B = jnp.where(s.done_B, config.pad_id, tokens_B)
        logprobs_B = jnp.where(s.done_B, 0.0, logprobs_B)
        # (Finished rows add the pad id, as in transformers; their tokens are pad anyway.)
        seen_BV = None if s.seen_BV is None else mark_seen(s.seen_BV, tokens_B)
        lengths_B = jnp.where(s.done_B, s.lengths_B, s.lengths_B + 1)
        ends_B, recent_BW, stop_BK = stops_after(
            tokens_B, lengths_B, s.limits_B, s.recent_BW, s.stop_BK, stop_ids, tables
        )
        return s.replace(
            lengths_B=lengths_B,
            step=s.step + 1,
            tokens_BN=jax.lax.dynamic_update_slice_in_dim(
                s.tokens_BN, tokens_B[:, None], s.step, axis=1
            ),
            logprobs_BN=jax.lax.dynamic_update_slice_in_dim(
                s.logprobs_BN, logprobs_B[:, None], s.step, axis=1
            ),
            done_B=s.done_B | ends_B,
            positions_B=s.positions_B + 1,
            cache=cache,
            seen_BV=seen_BV,
            recent_BW=recent_BW,
            stop_BK=stop_BK,
        )

    state = jax.lax.while_loop(unfinished, one_token, state)
    mask_BN = (jnp.arange(n_new)[None, :] < state.lengths_B[:, None]).astype(jnp.int32)
    # The whole final state is returned so every donated buffer (the cache above all) is
    # updated in place by the loop rather than copied into it.
    return state, mask_BN


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def prefill_program(
    spec, params, prompt_ids_BP, prompt_mask_BP, rng, config, group_size, pixel_values,
    limits_B, stop_BK, tables,
):  # fmt: skip
    args = (params, prompt_ids_BP, prompt_mask_BP, rng, config, group_size, pixel_values)
    return traced(spec, prefill_body, *args, limits_B, stop_BK, tables)


# The state (KV cache included) is dead after decoding: donate it.
@functools.partial(jax.jit, static_argnums=(0, 3), donate_argnums=(2,))
def decode_program(spec, params, state, config, tables):
    return traced(spec, decode_body, params, state, config, tables)
