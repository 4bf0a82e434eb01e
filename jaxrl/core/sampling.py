"""Token choice of the KV-cache sampler, as transformers' `generate` chooses: logits processors
(repetition penalty, `min_new_tokens`, suppressed ids, temperature, top-k, top-p, min-p) and the
draw or argmax, on `[B, V]` logits of one decode step.

Pure array functions: `config` is a `jaxrl.generation.GenerationConfig` read for its fields
only. No model, no cache, no host work (the loop that calls these is `jaxrl.generation`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def filter_top_k_top_p(scaled_BV: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """transformers' TopK then TopP warpers: filtered logits are -inf.

    Top-k keeps every logit >= the k-th largest; top-p keeps the most likely tokens until their
    probability (renormalised after top-k) reaches `top_p`, always at least one.
    """
    vocab = scaled_BV.shape[-1]
    if 0 < top_k < vocab:
        kth_B1 = jax.lax.top_k(scaled_BV, top_k)[0][:, -1:]
        scaled_BV = jnp.where(scaled_BV < kth_B1, -jnp.inf, scaled_BV)
    if top_p < 1.0:
        sorted_BV = jax.lax.top_k(scaled_BV, vocab)[0]  # descending
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass of the more likely tokens
        n_keep_B1 = jnp.maximum(jnp.sum(before_BV < top_p, axis=-1, keepdims=True), 1)
        cutoff_B1 = jnp.take_along_axis(sorted_BV, n_keep_B1 - 1, axis=-1)
        scaled_BV = jnp.where(scaled_BV < cutoff_B1, -jnp.inf, scaled_BV)
    return scaled_BV


def sample_categorical(rng: jax.Array, logits_BV: jax.Array, block: int = 64) -> jax.Array:
    """One token per row from softmax(logits) by inverting the CDF with one uniform per row
    (Gumbel-max would draw B x V random numbers: on CPU the sampler's costliest op).

    `rng`: one key (the rows' uniforms drawn together) or [B] keys, one per row (each row's
    uniform from its own key: the draw then depends on the row's key only, not on its place in
    the batch).

    The CDF is inverted in two levels, over blocks of `block` tokens and then within the chosen
    block, so no prefix sum runs over the whole vocabulary (XLA:CPU's cumsum over V was most of
    the sampling time)."""
    batch, vocab = logits_BV.shape
    n_blocks = -(-vocab // block)
    probs_BV = jax.nn.softmax(logits_BV, axis=-1)
    probs_BNK = jnp.pad(probs_BV, ((0, 0), (0, n_blocks * block - vocab)))
    probs_BNK = probs_BNK.reshape(batch, n_blocks, block)
    cdf_BN = jnp.cumsum(jnp.sum(probs_BNK, axis=-1), axis=-1)
    if rng.shape == (batch,):
        u_B1 = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(rng)[:, None]
    else:
        u_B1 = jax.random.uniform(rng, (batch, 1), jnp.float32)
    u_B1 = u_B1 * cdf_BN[:, -1:]
    # The first block whose CDF exceeds u, then the first token of it whose CDF (from the
    # block's start) exceeds what is left of u; zero-probability tokens never are, and rounding
    # cannot push the pick past the block's last token of nonzero probability.
    j_B = jnp.minimum(jnp.sum(cdf_BN <= u_B1, axis=-1), n_blocks - 1)
    below_B1 = jnp.where(
        j_B[:, None] > 0, jnp.take_along_axis(cdf_BN, jnp.maximum(j_B - 1, 0)[:, None], 1), 0.0
    )
    inner_BK = jnp.take_along_axis(probs_BNK, j_B[:, None, None], axis=1)[:, 0]
    inner_cdf_BK = jnp.cumsum(inner_BK, axis=-1)
    last_B = jnp.max(jnp.where(inner_BK > 0, jnp.arange(block), 0), axis=-1)
    i_B = jnp.minimum(jnp.sum(inner_cdf_BK <= u_B1 - below_B1, axis=-1), last_B)
    return j_B * block + i_B


def token_presence(ids_BL: jax.Array, mask_BL: jax.Array, vocab: int) -> jax.Array:
    """[B, vocab] bool: which ids occur at the unmasked positions of each row (ids outside
    [0, vocab) are ignored, as transformers ignores ids beyond the logits' vocabulary)."""
    batch = ids_BL.shape[0]
    valid_BL = mask_BL.astype(bool) & (ids_BL >= 0) & (ids_BL < vocab)
    # Masked and out-of-range positions all write into one extra column, dropped afterwards.
    cols_BL = jnp.where(valid_BL, ids_BL, vocab)
    seen_BV = jnp.zeros((batch, vocab + 1), bool).at[jnp.arange(batch)[:, None], cols_BL].set(True)
    return seen_BV[:, :vocab]


def mark_seen(seen_BV: jax.Array, tokens_B: jax.Array) -> jax.Array:
    """`seen_BV` with each row's new token added."""
    return seen_BV.at[jnp.arange(seen_BV.shape[0]), tokens_B].set(True)


def apply_repetition_penalty(logits_BV: jax.Array, seen_BV: jax.Array, penalty: float) -> jax.Array:
    """transformers' RepetitionPenaltyLogitsProcessor: the logits of seen ids are divided by
    `penalty` when >= 0 and multiplied by it when < 0 (so > 1 always makes them less likely)."""
    penalised_BV = jnp.where(logits_BV < 0, logits_BV * penalty, logits_BV / penalty)
    return jnp.where(seen_BV, penalised_BV, logits_BV)


def filter_min_p(scaled_BV: jax.Array, min_p: float) -> jax.Array:
    """transformers' MinPLogitsWarper: -inf for tokens whose probability is below `min_p` times
    the most likely token's (which, min_p being <= 1, always stays)."""
    probs_BV = jax.nn.softmax(scaled_BV, axis=-1)
    threshold_B1 = min_p * jnp.max(probs_BV, axis=-1, keepdims=True)
    return jnp.where(probs_BV < threshold_B1, -jnp.inf, scaled_BV)


def process_logits(
    logits_BV: jax.Array,
    step: jax.Array | int,
    config: Any,
    seen_BV: jax.Array | None = None,
) -> jax.Array:
    """The float32 logits completion token `step` is drawn from (sampling) or argmax'ed from
    (greedy), as transformers' `generate` processes them: repetition penalty (needs `seen_BV`,
    the ids of each row's prompt and completion so far), then the `min_new_tokens` ban of
    EOS/stop ids, then (sampling only) temperature, top-k, top-p, min-p.

    The temperature is applied before the ban here (transformers: after): -inf / T is -inf, so
    the result is the same bit for bit, and without a penalty `logits / T` is the very array
    the log-probs come from."""
    x_BV = logits_BV.astype(jnp.float32)
    if config.suppress_token_ids:
        x_BV = x_BV.at[:, jnp.asarray(config.suppress_token_ids, jnp.int32)].set(-jnp.inf)
    if config.repetition_penalty != 1.0:
        if seen_BV is None:
            raise ValueError("repetition_penalty != 1 needs the seen-token mask seen_BV.")
        x_BV = apply_repetition_penalty(x_BV, seen_BV, config.repetition_penalty)
    if config.do_sample:
        x_BV = x_BV / config.temperature
    if config.min_new_tokens > 0 and config.stop_ids:
        stop_ids = jnp.asarray(config.stop_ids, dtype=jnp.int32)
        too_early = jnp.reshape(jnp.asarray(step) < config.min_new_tokens, (-1, 1))
        banned_V = jnp.zeros(x_BV.shape[-1], bool).at[stop_ids].set(True)
        x_BV = jnp.where(banned_V[None, :] & too_early, -jnp.inf, x_BV)
    if config.do_sample:
        x_BV = filter_top_k_top_p(x_BV, config.top_k, config.top_p)
        if config.min_p:  # None or 0.0: nothing is below the threshold
            x_BV = filter_min_p(x_BV, config.min_p)
    return x_BV


def row_keys(rng: jax.Array, rows_B: jax.Array, steps_B: jax.Array) -> jax.Array:
    """[B] keys: row r's completion token t is drawn with `fold_in(fold_in(rng, r), t)`, so a
    row's tokens depend on the seed and the row's index in the generation batch only (not on
    the decode slot it runs in, its neighbours, or the mesh)."""
    steps_B = jnp.broadcast_to(steps_B, rows_B.shape)
    return jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(rng, r), t))(
        rows_B, steps_B
    )


def choose_tokens(
    logits_BV: jax.Array,
    keys_B: jax.Array,
    step: jax.Array,
    config: Any,
    seen_BV: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Completion token `step` (a scalar, or [B]: each row's own) of every row and its
    log-prob, drawn with each row's key `keys_B` (`row_keys`; see the module docstring)."""
    scaled_BV = logits_BV.astype(jnp.float32)
    if config.do_sample:
        scaled_BV = scaled_BV / config.temperature
    logprobs_BV = jax.nn.log_softmax(scaled_BV, axis=-1)
    processed_BV = process_logits(logits_BV, step, config, seen_BV)
    if config.do_sample:
        tokens_B = sample_categorical(keys_B, processed_BV)
    else:
        tokens_B = jnp.argmax(processed_BV, axis=-1)
    tokens_B = tokens_B.astype(jnp.int32)
    return tokens_B, jnp.take_along_axis(logprobs_BV, tokens_B[:, None], axis=-1)[:, 0]


def push_recent(recent_BW: jax.Array, tokens_B: jax.Array) -> jax.Array:
    """The last W tokens of each row with `tokens_B` appended (the oldest drops out)."""
    return jnp.concatenate([recent_BW[:, 1:], tokens_B[:, None].astype(recent_BW.dtype)], axis=1)


def stop_sequence_hits(recent_BW: jax.Array, sequences_SW: jax.Array) -> jax.Array:
    """[B] whether each row's last tokens end with one of the stop sequences: `sequences_SW`
    holds them right-aligned, -1 left of a shorter one (matching anything)."""
    same_BSW = (recent_BW[:, None, :] == sequences_SW[None]) | (sequences_SW[None] < 0)
    return jnp.any(jnp.all(same_BSW, axis=-1), axis=-1)


def advance_stop_strings(
    states_BK: jax.Array, tokens_B: jax.Array, next_KVQ: jax.Array, lengths_K: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Each stop string's automaton state after each row's new token
    (`jaxrl.data.stop_strings`), and [B] whether a string ended inside that token."""
    k_K = jnp.arange(next_KVQ.shape[0])
    tokens_B = jnp.clip(tokens_B, 0, next_KVQ.shape[1] - 1)
    states_BK = next_KVQ[k_K[None, :], tokens_B[:, None], states_BK]
    hit_BK = states_BK >= lengths_K[None, :]
    return jnp.where(hit_BK, 0, states_BK), jnp.any(hit_BK, axis=-1)
