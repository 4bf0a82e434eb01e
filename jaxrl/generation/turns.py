"""Multi-turn sampling that keeps each row's KV cache between turns (the tool-calling loop).

`TurnSession(sampler, params, config)`: `first(prompts, seed, group_size)` samples the first
turn of every row (the static engine, whose state is kept); `next(rows, ids, seed)` continues
the given rows from their caches: `ids[i]` is row `rows[i]`'s whole sequence so far (its prompt,
the completion sampled so far, then new tokens such as a tool result), of which only the new
tokens are run through the model (a per-row chunk written at each row's own cache index), then
the rows decode in the continuous engine's per-row loop until each ends (its own budget: the
config's `max_new_tokens` less what its completion already holds).

Row `rows[i]`'s token t of a continued turn is drawn with `row_keys(seed, i, t)`, the key a
fresh sampler call on the `ids` rows (in that order) would use, so a continued turn samples what
re-prefilling the whole conversation samples, without re-running it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.core.logprobs import unembed_logits
from jaxrl.core.sampling import choose_tokens, mark_seen, row_keys, token_presence
from jaxrl.generation import continuous
from jaxrl.generation.config import GenerationConfig
from jaxrl.generation.sampler import Sampler, as_key, bucket_length, left_pad
from jaxrl.generation.steps import SamplerSpec, SamplingState, StopTables, stops_after, traced
from jaxrl.models.kv_cache import CacheView


class TurnSession:
    """One batch of rows sampled turn after turn from one set of params (see the module doc)."""

    def __init__(
        self, sampler: Sampler, params: Any, config: GenerationConfig, tokenizer: Any = None
    ):
        self.sampler, self.params, self.config, self.tokenizer = sampler, params, config, tokenizer
        self.state: SamplingState | None = None
        self.tables: StopTables | None = None
        self.sequences: list[list[int]] = []  # each row's prompt + completion so far
        self.prompt_lengths: list[int] = []
        self.logprobs: list[list[float]] = []  # each row's sampled tokens' log-probs, all turns

    def first(self, prompts: list[list[int]], seed: Any, group_size: int = 1) -> list[list[int]]:
        """The first turn: `group_size` completions of each prompt (rows i*G .. i*G+G-1)."""
        s, config = self.sampler, self.config
        params = self.params if self.params is not None else s.params
        model_config = s._model_config(params)
        ids_BP, mask_BP = left_pad(prompts, None, s.prompt_buckets, config.pad_id)
        s._check_positions(model_config, mask_BP, config)
        rng = as_key(seed)
        tables, stop_BK = s._stop_tables(config, self.tokenizer, model_config, ids_BP, mask_BP)
        self.tables = tables
        rows = len(ids_BP) * group_size
        limits_B = s._place(np.full((rows,), config.max_new_tokens, np.int32))
        state = s._prefill(
            params, s._place(ids_BP), s._place(mask_BP), rng, config, group_size, None,
            limits_B, None if stop_BK is None else s._place(stop_BK), tables,
        )  # fmt: skip
        state, mask_BN = s._decode(params, state, config, tables)
        self.state = state
        tokens, lengths = np.asarray(state.tokens_BN), np.asarray(mask_BN).sum(axis=1)
        logprobs = np.asarray(state.logprobs_BN)
        new = [tokens[r, : lengths[r]].tolist() for r in range(rows)]
        prompts_rows = [list(map(int, p)) for p in prompts for _ in range(group_size)]
        self.prompt_lengths = [len(p) for p in prompts_rows]
        self.sequences = [p + n for p, n in zip(prompts_rows, new, strict=True)]
        self.logprobs = [logprobs[r, : lengths[r]].tolist() for r in range(rows)]
        return new

    def next(self, rows: list[int], ids: list[list[int]], seed: Any) -> list[list[int]]:
        """Continue rows `rows` whose sequences are now `ids` (each extending the row's
        sequence so far); returns each row's new tokens."""
        if self.state is None:
            raise ValueError("Call first() before next().")
        if not rows:
            return []
        s, config = self.sampler, self.config
        params = self.params if self.params is not None else s.params
        n_rows, width = self.state.key_mask_BS.shape
        prompt_len = width - (config.max_new_tokens - 1)
        chunks, write_at, positions, limits = [], [], [], []
        for r, row_ids in zip(rows, ids, strict=True):
            seq = self.sequences[r]
            if list(row_ids[: len(seq)]) != seq or len(row_ids) <= len(seq) - 1:
                raise ValueError(
                    f"Row {r}'s ids do not extend its sequence so far; a continued turn appends "
                    "to the conversation (re-sample the row from its prompt instead)."
                )
            chunks.append([int(t) for t in row_ids[len(seq) - 1 :]])  # the unfed last token on
            # The left-padded prompt ends at slot P: token k of the row sits at P - n + k.
            write_at.append(prompt_len - self.prompt_lengths[r] + len(seq) - 1)
            positions.append(len(seq) - 1)
            limits.append(config.max_new_tokens - (len(row_ids) - self.prompt_lengths[r]))
        if min(limits) < 1:
            raise ValueError(
                "A continued row has no completion budget left (max_new_tokens counts the whole "
                "completion); roll the turn back before continuing it."
            )
        chunk_len = bucket_length(max(map(len, chunks)), None)
        ext_BT = np.full((n_rows, chunk_len), config.pad_id, np.int32)
        ext_len_B = np.zeros((n_rows,), np.int32)
        at_B = np.full((n_rows,), width, np.int32)  # rows not continued write nothing
        pos_B = np.zeros((n_rows,), np.int32)
        limits_B = np.ones((n_rows,), np.int32)
        turn_rows_B = np.zeros((n_rows,), np.int32)
        active_B = np.zeros((n_rows,), bool)
        for i, r in enumerate(rows):
            ext_BT[r, : len(chunks[i])] = chunks[i]
            ext_len_B[r], at_B[r], pos_B[r], limits_B[r] = (
                len(chunks[i]),
                write_at[i],
                positions[i],
                limits[i],
            )
            turn_rows_B[r], active_B[r] = i, True
        full = [self.sequences[r] for r in range(n_rows)]
        for r, row_ids in zip(rows, ids, strict=True):
            full[r] = list(row_ids)
        seen_rows = stop_BK = None
        penalty, strings = config.repetition_penalty != 1.0, self.tables.strings_KVQ is not None
        if penalty or strings:  # both read each row's whole sequence so far
            padded = left_pad(full, None, None, config.pad_id)
            seen_rows = padded if penalty else None
            if strings:
                model_config = s._model_config(params)
                _, stop_BK = s._stop_tables(config, self.tokenizer, model_config, *padded)
        rng = as_key(seed)
        place = s._place
        state = extend_program(
            s._spec, params, self.state, place(ext_BT), place(ext_len_B), place(at_B),
            place(pos_B), place(limits_B), place(turn_rows_B), place(active_B), rng,
            None if seen_rows is None else tuple(map(place, seen_rows)),
            None if stop_BK is None else place(stop_BK), config, self.tables,
        )  # fmt: skip
        state = continuous.decode_program(
            s._spec, params, state, np.int32(n_rows), config, self.tables
        )
        self.state = state
        tokens, lengths = np.asarray(state.tokens_BN), np.asarray(state.lengths_B)
        logprobs = np.asarray(state.logprobs_BN)
        new = []
        for r, row_ids in zip(rows, ids, strict=True):
            new.append(tokens[r, : lengths[r]].tolist())
            self.sequences[r] = list(map(int, row_ids)) + new[-1]
            self.logprobs[r] = self.logprobs[r] + logprobs[r, : lengths[r]].tolist()
        return new


def continued_rows(session: TurnSession, ids: list[list[int]]) -> list[int] | None:
    """For each of `ids` (in row order, as the tool loop passes its active rows), the next row
    of `session` whose sequence it extends, or None when some has none."""
    rows, r = [], 0
    for row_ids in ids:
        while r < len(session.sequences):
            seq = session.sequences[r]
            r += 1
            if len(row_ids) >= len(seq) and list(row_ids[: len(seq)]) == seq:
                rows.append(r - 1)
                break
        else:
            return None
    return rows


def extend_body(
    spec: SamplerSpec,
    params: Any,
    state: SamplingState,
    ext_BT: jax.Array,
    ext_len_B: jax.Array,
    at_B: jax.Array,
    pos_B: jax.Array,
    limits_B: jax.Array,
    turn_rows_B: jax.Array,
    active_B: jax.Array,
    rng: jax.Array,
    seen_rows: tuple[jax.Array, jax.Array] | None,
    stop_BK: jax.Array | None,
    config: GenerationConfig,
    tables: StopTables,
) -> SamplingState:
    """Run each continued row's new tokens at its own cache index, choose its first token of
    the turn, and set the state up for the continuous decode loop."""
    model = nnx.merge(spec.graphdef, params)
    n_rows, chunk_len = ext_BT.shape
    positions_BT = pos_B[:, None] + jnp.arange(chunk_len, dtype=jnp.int32)[None, :]
    view = CacheView(at_B, state.key_mask_BS)
    h_BTD, cache = model.cached_hidden_states(ext_BT, positions_BT, state.cache, view)
    last_BD = jnp.take_along_axis(h_BTD, jnp.maximum(ext_len_B - 1, 0)[:, None, None], 1)[:, 0]
    logits_BV = unembed_logits(last_BD, model.unembed_weight(), model.config.final_logit_softcap)
    seen_BV = None
    if seen_rows is not None:
        seen_BV = token_presence(*seen_rows, logits_BV.shape[-1])
    step = jnp.zeros((), jnp.int32)
    tokens_B, logprobs_B = choose_tokens(
        logits_BV, row_keys(rng, turn_rows_B, step), step, config, seen_BV
    )
    n_new = config.max_new_tokens
    tokens_B = jnp.where(active_B, tokens_B, config.pad_id)
    lengths_B = active_B.astype(jnp.int32)
    recent_BW = None
    if state.recent_BW is not None:
        recent_BW = jnp.full_like(state.recent_BW, -2)
    ends_B, recent_BW, stop_BK = stops_after(
        tokens_B, lengths_B, limits_B, recent_BW, stop_BK,
        jnp.asarray(config.stop_ids, jnp.int32), tables,
    )  # fmt: skip
    return state.replace(
        tokens_BN=jnp.full((n_rows, n_new), config.pad_id, jnp.int32).at[:, 0].set(tokens_B),
        logprobs_BN=jnp.zeros((n_rows, n_new), jnp.float32)
        .at[:, 0]
        .set(jnp.where(active_B, logprobs_B, 0.0)),
        done_B=~active_B | ends_B,
        lengths_B=lengths_B,
        positions_B=pos_B + ext_len_B,
        cache=cache,
        rng=rng,
        limits_B=limits_B,
        seen_BV=None if seen_BV is None else mark_seen(seen_BV, tokens_B),
        recent_BW=recent_BW,
        stop_BK=stop_BK,
        rows_B=turn_rows_B,
        base_B=at_B + ext_len_B,
    )


@functools.partial(jax.jit, static_argnums=(0, 13), donate_argnums=(2,))
def extend_program(
    spec, params, state, ext_BT, ext_len_B, at_B, pos_B, limits_B, turn_rows_B, active_B, rng,
    seen_rows, stop_BK, config, tables,
):  # fmt: skip
    args = (params, state, ext_BT, ext_len_B, at_B, pos_B, limits_B, turn_rows_B, active_B, rng)
    return traced(spec, extend_body, *args, seen_rows, stop_BK, config, tables)
