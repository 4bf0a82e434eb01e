"""The continuous engine: a fixed number of decode slots and a queue of generation rows.

A row that ends frees its slot; the next waiting row takes it (its prompt prefilled into that
slot's cache rows) while the other slots keep decoding. Decode steps are spent on rows that
still run, so a long-tailed batch (most completions short, a few at the cap) costs about its
useful tokens rather than rows x the longest completion, and the cache holds `slots` rows
whatever the size of the generation batch.

Programs (jitted, a few shapes per call: slots, the prompt bucket P, the refill chunk):
- `start`: the empty slots (every slot free) and the output buffers [R, N].
- `refill`: take `chunk` free slots (lowest index first), copy their finished rows into the
  outputs, prefill the next rows' prompts (each prompt once for the rows of its group in this
  refill: with `chunk` a multiple of `group_size` a group shares one prefill) and place them
  in the slots with their first token.
- `decode`: one `lax.while_loop`, one token per running slot per step, until at least `need`
  slots are free (the next refill's rows) or every slot is.
- `harvest`: copy every slot's row into the outputs (at the end).

The host loop only dispatches (refill, decode, refill, ...): how many rows each refill takes is
known in advance, so nothing is read back until the outputs are.

A slot's cache has the static engine's layout for its row (the prompt left-padded to P, then
the completion), each slot writing at its own index (`CacheView.index` [B]), and row r's token
t is drawn with `row_keys(rng, r, t)`: a row's completion is the static engine's, whatever slot
it lands in and whoever its neighbours are.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.core.logprobs import unembed_logits
from jaxrl.core.sampling import choose_tokens, mark_seen, row_keys, token_presence
from jaxrl.generation.config import GenerationConfig
from jaxrl.generation.steps import SamplerSpec, SamplingState, StopTables, stops_after, traced
from jaxrl.models.config import ModelConfig
from jaxrl.models.kv_cache import CacheView, cache_shardings, init_cache
from jaxrl.models.masks import default_positions

# Slots the CPU default keeps for batches up to this many rows (one slot per row: the static
# batch); beyond it a quarter of the rows.
CPU_FULL_WIDTH = 64


@flax.struct.dataclass
class Outputs:
    """The finished rows, in generation-row order: ids [R, N] (pad after the end), log-probs
    and lengths."""

    tokens_RN: jax.Array
    logprobs_RN: jax.Array
    lengths_R: jax.Array


class Schedule(NamedTuple):
    """How the rows are fed to the slots: `chunk` rows per refill (the last one fewer), each
    refill prefilling `width` prompts."""

    slots: int
    chunk: int
    width: int


def cache_bytes_per_row(model_config: ModelConfig, length: int) -> int:
    """Bytes of one decode slot's KV cache over `length` positions."""
    itemsize = jnp.dtype(model_config.dtype).itemsize
    per_layer = 2 * model_config.num_kv_heads * length * model_config.head_dim * itemsize
    return per_layer * model_config.num_layers


def default_slots(rows: int, multiple: int, bytes_per_row: int) -> int:
    """The slot count when none is given. On CPU, where a decode step costs in proportion to
    its rows, batches of up to `CPU_FULL_WIDTH` rows get a slot each and larger ones a quarter
    of their rows (a long tail then costs about its useful tokens). On an accelerator, where a
    wider step costs little more, as many slots as the rows need and half the free device
    memory holds. Rounded up to a multiple of the mesh's data-parallel size."""
    if jax.default_backend() == "cpu":
        slots = rows if rows <= CPU_FULL_WIDTH else max(CPU_FULL_WIDTH, -(-rows // 4))
    else:
        devices = jax.local_devices()
        stats = devices[0].memory_stats() or {}
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        fit = int(0.5 * free * len(devices) / max(bytes_per_row, 1)) if free > 0 else rows
        slots = max(1, min(rows, fit))
    return -(-slots // multiple) * multiple


def schedule(rows: int, group_size: int, slots: int) -> Schedule:
    """The refill chunk and prefill width for `rows` rows of `group_size` over `slots` slots.

    All rows fit: one refill of all of them (the static batch). Otherwise about an eighth of
    the slots per refill, rounded to whole groups when a group fits, so that a group's rows
    share one prefill and slots wait little for a refill."""
    if slots >= rows:
        chunk = rows
    elif group_size > slots:
        chunk = slots
    else:
        chunk = group_size * max(1, (slots // 8) // group_size)
    starts = range(0, rows, chunk)
    width = max((min(q + chunk, rows) - 1) // group_size - q // group_size + 1 for q in starts)
    return Schedule(slots, chunk, width)


def generate(
    spec: SamplerSpec,
    params: Any,
    prompt_ids_nP: jax.Array,
    prompt_mask_nP: jax.Array,
    rng: jax.Array,
    config: GenerationConfig,
    group_size: int,
    pixel_values: jax.Array | None,
    limits_R: jax.Array,
    stop_nK: jax.Array | None,
    tables: StopTables,
    slots: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(completion ids [R, N], log-probs [R, N], completion mask [R, N]) of the R = n x
    group_size rows, row i * group_size + g being prompt i's g-th sample."""
    n, prompt_len = prompt_ids_nP.shape
    rows = n * group_size
    plan = schedule(rows, group_size, slots)
    recent_width = 0 if tables.sequences_SW is None else tables.sequences_SW.shape[1]
    n_strings = 0 if stop_nK is None else stop_nK.shape[1]
    state, outputs = start_program(
        spec, params, rng, config, plan.slots, prompt_len, rows, recent_width, n_strings
    )
    taken = 0
    while taken < rows:
        m = min(plan.chunk, rows - taken)
        state, outputs = refill_program(
            spec, params, state, outputs, prompt_ids_nP, prompt_mask_nP, pixel_values,
            stop_nK, limits_R, np.int32(taken), np.int32(m), config, group_size, plan.chunk,
            plan.width, tables,
        )  # fmt: skip
        taken += m
        # Free slots the next refill needs; after the last one, all of them (every row done).
        need = min(plan.chunk, rows - taken) if taken < rows else plan.slots
        state = decode_program(spec, params, state, np.int32(need), config, tables)
    outputs = harvest_program(state, outputs)
    mask_RN = (jnp.arange(config.max_new_tokens)[None, :] < outputs.lengths_R[:, None]).astype(
        jnp.int32
    )
    return outputs.tokens_RN, outputs.logprobs_RN, mask_RN


def _slot_axis(model_config: ModelConfig) -> int:
    return 1 if model_config.scan_layers else 0


def start_body(
    spec: SamplerSpec,
    params: Any,
    rng: jax.Array,
    config: GenerationConfig,
    slots: int,
    prompt_len: int,
    rows: int,
    recent_width: int,
    n_strings: int,
) -> tuple[SamplingState, Outputs]:
    model = nnx.merge(spec.graphdef, params)
    n_new = config.max_new_tokens
    length = prompt_len + n_new - 1
    state = SamplingState(
        step=jnp.zeros((), jnp.int32),
        tokens_BN=jnp.full((slots, n_new), config.pad_id, jnp.int32),
        logprobs_BN=jnp.zeros((slots, n_new), jnp.float32),
        done_B=jnp.ones((slots,), bool),  # every slot free
        lengths_B=jnp.zeros((slots,), jnp.int32),
        positions_B=jnp.zeros((slots,), jnp.int32),
        key_mask_BS=jnp.ones((slots, length), bool),
        cache=init_cache(model.config, slots, length, spec.mesh, spec.rules),
        rng=rng,
        limits_B=jnp.ones((slots,), jnp.int32),
        seen_BV=(
            jnp.zeros((slots, model.config.vocab_size), bool)
            if config.repetition_penalty != 1.0
            else None
        ),
        recent_BW=jnp.full((slots, recent_width), -2, jnp.int32) if recent_width else None,
        stop_BK=jnp.zeros((slots, n_strings), jnp.int32) if n_strings else None,
        rows_B=jnp.full((slots,), -1, jnp.int32),
    )
    outputs = Outputs(
        tokens_RN=jnp.full((rows, n_new), config.pad_id, jnp.int32),
        logprobs_RN=jnp.zeros((rows, n_new), jnp.float32),
        lengths_R=jnp.zeros((rows,), jnp.int32),
    )
    return state, outputs


def harvest(state: SamplingState, outputs: Outputs, slots_C: jax.Array) -> Outputs:
    """`outputs` with the rows held by `slots_C` copied in (slots past the end, or that never
    held a row, write nothing)."""
    n_slots = state.done_B.shape[0]
    rows_C = jnp.take(state.rows_B, slots_C, mode="fill", fill_value=-1)
    rows_C = jnp.where(rows_C < 0, outputs.lengths_R.shape[0], rows_C)  # dropped below
    slots_C = jnp.minimum(slots_C, n_slots - 1)
    return Outputs(
        tokens_RN=outputs.tokens_RN.at[rows_C].set(state.tokens_BN[slots_C], mode="drop"),
        logprobs_RN=outputs.logprobs_RN.at[rows_C].set(state.logprobs_BN[slots_C], mode="drop"),
        lengths_R=outputs.lengths_R.at[rows_C].set(state.lengths_B[slots_C], mode="drop"),
    )


def refill_body(
    spec: SamplerSpec,
    params: Any,
    state: SamplingState,
    outputs: Outputs,
    prompt_ids_nP: jax.Array,
    prompt_mask_nP: jax.Array,
    pixel_values: jax.Array | None,
    stop_nK: jax.Array | None,
    limits_R: jax.Array,
    taken: jax.Array,
    m: jax.Array,
    config: GenerationConfig,
    group_size: int,
    chunk: int,
    width: int,
    tables: StopTables,
) -> tuple[SamplingState, Outputs]:
    model = nnx.merge(spec.graphdef, params)
    n_slots = state.done_B.shape[0]
    n_prompts, prompt_len = prompt_ids_nP.shape
    n_rows = limits_R.shape[0]
    # The first `chunk` free slots: their finished rows go to the outputs, the next m rows in.
    free_C = jnp.nonzero(state.done_B, size=chunk, fill_value=n_slots)[0]
    outputs = harvest(state, outputs, free_C)
    j_C = jnp.arange(chunk, dtype=jnp.int32)
    rows_C = jnp.minimum(taken + j_C, n_rows - 1)
    slots_C = jnp.where(j_C < m, free_C, n_slots)  # past the end: not written
    # One prefill per prompt of these rows (a group's rows share theirs).
    first = taken // group_size
    prompts_W = jnp.minimum(first + jnp.arange(width), n_prompts - 1)
    ids_WP, mask_WP = prompt_ids_nP[prompts_W], prompt_mask_nP[prompts_W]
    cache_W = init_cache(model.config, width, prompt_len)
    positions_WP = default_positions(mask_WP, None, prompt_len)
    view = CacheView(jnp.zeros((), jnp.int32), mask_WP.astype(bool), prefill=True)
    if pixel_values is None:
        h_WPD, cache_W = model.cached_hidden_states(ids_WP, positions_WP, cache_W, view)
    else:
        h_WPD, cache_W = model.cached_hidden_states(
            ids_WP, positions_WP, cache_W, view, pixel_values=pixel_values[prompts_W]
        )
    logits_WV = unembed_logits(
        h_WPD[:, -1], model.unembed_weight(), model.config.final_logit_softcap
    )
    w_C = jnp.clip(rows_C // group_size - first, 0, width - 1)
    seen_CV = None
    if state.seen_BV is not None:
        seen_CV = token_presence(ids_WP[w_C], mask_WP[w_C], logits_WV.shape[-1])
    step = jnp.zeros((), jnp.int32)
    tokens_C, logprobs_C = choose_tokens(
        logits_WV[w_C], row_keys(state.rng, rows_C, step), step, config, seen_CV
    )
    lengths_C = jnp.ones((chunk,), jnp.int32)
    limits_C = limits_R[rows_C].astype(jnp.int32)
    recent_CW = None if state.recent_BW is None else jnp.full_like(state.recent_BW[:chunk], -2)
    stop_CK = None if stop_nK is None else stop_nK[prompts_W][w_C].astype(jnp.int32)
    done_C, recent_CW, stop_CK = stops_after(
        tokens_C, lengths_C, limits_C, recent_CW, stop_CK,
        jnp.asarray(config.stop_ids, jnp.int32), tables,
    )  # fmt: skip
    axis = _slot_axis(model.config)

    def put(full: jax.Array, part: jax.Array) -> jax.Array:  # part's slot rows w_C into slots_C
        index = (slice(None),) * axis + (slots_C, slice(None), slice(0, prompt_len))
        return full.at[index].set(jnp.take(part, w_C, axis=axis), mode="drop")

    cache = jax.tree.map(put, state.cache, cache_W)
    if spec.mesh is not None:
        cache = jax.lax.with_sharding_constraint(
            cache,
            cache_shardings(
                model.config, n_slots, state.key_mask_BS.shape[1], spec.mesh, spec.rules
            ),
        )
    n_new = config.max_new_tokens
    first_BN = jnp.full((chunk, n_new), config.pad_id, jnp.int32).at[:, 0].set(tokens_C)

    def set_rows(x: jax.Array | None, value: jax.Array | None) -> jax.Array | None:
        return None if x is None else x.at[slots_C].set(value.astype(x.dtype), mode="drop")

    state = state.replace(
        tokens_BN=set_rows(state.tokens_BN, first_BN),
        logprobs_BN=set_rows(state.logprobs_BN, jnp.zeros((chunk, n_new)).at[:, 0].set(logprobs_C)),
        done_B=set_rows(state.done_B, done_C),
        lengths_B=set_rows(state.lengths_B, lengths_C),
        positions_B=set_rows(state.positions_B, jnp.sum(mask_WP[w_C], axis=1)),
        key_mask_BS=state.key_mask_BS.at[slots_C, :prompt_len].set(
            mask_WP[w_C].astype(bool), mode="drop"
        ),
        cache=cache,
        limits_B=set_rows(state.limits_B, limits_C),
        seen_BV=set_rows(state.seen_BV, None if seen_CV is None else mark_seen(seen_CV, tokens_C)),
        recent_BW=set_rows(state.recent_BW, recent_CW),
        stop_BK=set_rows(state.stop_BK, stop_CK),
        rows_B=set_rows(state.rows_B, rows_C),
    )
    return state, outputs


def decode_body(
    spec: SamplerSpec,
    params: Any,
    state: SamplingState,
    need: jax.Array,
    config: GenerationConfig,
    tables: StopTables,
) -> SamplingState:
    model = nnx.merge(spec.graphdef, params)
    unembed_DV = model.unembed_weight()
    n_slots, length = state.key_mask_BS.shape
    n_new = config.max_new_tokens
    prompt_len = length - (n_new - 1)
    stop_ids = jnp.asarray(config.stop_ids, jnp.int32)
    slots_B = jnp.arange(n_slots)

    def running(s: SamplingState) -> jax.Array:
        return (jnp.sum(s.done_B) < need) & ~jnp.all(s.done_B)

    def one_token(s: SamplingState) -> SamplingState:
        active_B = ~s.done_B
        last_B1 = jnp.take_along_axis(s.tokens_BN, jnp.maximum(s.lengths_B - 1, 0)[:, None], 1)
        # A running row feeds its last token at its own slot; a free one writes nothing.
        base_B = prompt_len if s.base_B is None else s.base_B
        index_B = jnp.where(active_B, base_B + s.lengths_B - 1, length)
        view = CacheView(index_B, s.key_mask_BS)
        h_B1D, cache = model.cached_hidden_states(last_B1, s.positions_B[:, None], s.cache, view)
        logits_BV = unembed_logits(h_B1D[:, 0], unembed_DV, model.config.final_logit_softcap)
        keys_B = row_keys(s.rng, jnp.maximum(s.rows_B, 0), s.lengths_B)
        tokens_B, logprobs_B = choose_tokens(logits_BV, keys_B, s.lengths_B, config, s.seen_BV)
        tokens_B = jnp.where(active_B, tokens_B, config.pad_id)
        logprobs_B = jnp.where(active_B, logprobs_B, 0.0)
        at_B = jnp.where(active_B, s.lengths_B, n_new)  # free slots: dropped
        lengths_B = s.lengths_B + active_B
        ends_B, recent_BW, stop_BK = stops_after(
            tokens_B, lengths_B, s.limits_B, s.recent_BW, s.stop_BK, stop_ids, tables
        )
        return s.replace(
            tokens_BN=s.tokens_BN.at[slots_B, at_B].set(tokens_B, mode="drop"),
            logprobs_BN=s.logprobs_BN.at[slots_B, at_B].set(logprobs_B, mode="drop"),
            done_B=s.done_B | ends_B,
            lengths_B=lengths_B,
            positions_B=s.positions_B + active_B,
            cache=cache,
            seen_BV=None if s.seen_BV is None else mark_seen(s.seen_BV, tokens_B),
            recent_BW=recent_BW,
            stop_BK=stop_BK,
        )

    return jax.lax.while_loop(running, one_token, state)


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 6, 7, 8))
def start_program(spec, params, rng, config, slots, prompt_len, rows, recent_width, n_strings):
    args = (params, rng, config, slots, prompt_len, rows, recent_width, n_strings)
    return traced(spec, start_body, *args)


@functools.partial(jax.jit, static_argnums=(0, 11, 12, 13, 14), donate_argnums=(2, 3))
def refill_program(
    spec, params, state, outputs, prompt_ids_nP, prompt_mask_nP, pixel_values, stop_nK,
    limits_R, taken, m, config, group_size, chunk, width, tables,
):  # fmt: skip
    args = (params, state, outputs, prompt_ids_nP, prompt_mask_nP, pixel_values, stop_nK)
    rest = (limits_R, taken, m, config, group_size, chunk, width, tables)
    return traced(spec, refill_body, *args, *rest)


# The state (KV cache included) is updated in place by the loop: donate it.
@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=(2,))
def decode_program(spec, params, state, need, config, tables):
    return traced(spec, decode_body, params, state, need, config, tables)


@functools.partial(jax.jit, donate_argnums=(1,))
def harvest_program(state: SamplingState, outputs: Outputs) -> Outputs:
    return harvest(state, outputs, jnp.arange(state.done_B.shape[0]))
