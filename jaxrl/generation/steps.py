"""What both sampling engines trace (`static.py`, `continuous.py`): the decode carry, the stop
tables, the end-of-row test, and the spec their compiled programs are keyed by.

Pure array code: no host work, no model construction.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.core.sampling import advance_stop_strings, push_recent, stop_sequence_hits
from jaxrl.models.kv_cache import Cache


@flax.struct.dataclass
class SamplingState:
    """The decode loop's carry. Static engine: `step` completion tokens have been chosen in
    every row. Continuous engine: one decode slot per row, each `lengths_B` tokens into its own
    completion (`rows_B`: the generation row in each slot, -1 when the slot never held one)."""

    step: jax.Array
    tokens_BN: jax.Array
    logprobs_BN: jax.Array
    done_B: jax.Array
    lengths_B: jax.Array
    positions_B: jax.Array
    key_mask_BS: jax.Array
    cache: Cache
    rng: jax.Array
    # [B]: each row's own max_new_tokens (<= the config's).
    limits_B: jax.Array | None = None
    # [B, V]: ids in each row's prompt or completion so far; None without a repetition penalty.
    seen_BV: jax.Array | None = None
    # [B, W]: each row's last W completion tokens (-2 before the first); None without
    # stop_sequences.
    recent_BW: jax.Array | None = None
    # [B, K]: each stop string's automaton state per row; None without stop_strings.
    stop_BK: jax.Array | None = None
    # [B]: the generation row each slot holds (continuous engine; None in the static one).
    rows_B: jax.Array | None = None
    # [B]: the cache slot of each row's first completion token of this turn (continuous decode;
    # None: the prompt bucket P, every row's completion starting right after its prompt).
    base_B: jax.Array | None = None


class StopTables(NamedTuple):
    """Device arrays of a config's stop sequences and strings (None where it has none)."""

    sequences_SW: jax.Array | None
    strings_KVQ: jax.Array | None
    string_lengths_K: jax.Array | None


NO_STOPS = StopTables(None, None, None)


def stops_after(
    tokens_B: jax.Array,
    lengths_B: jax.Array,
    limits_B: jax.Array,
    recent_BW: jax.Array | None,
    stop_BK: jax.Array | None,
    stop_ids: jax.Array,
    tables: StopTables,
) -> tuple[jax.Array, Any, Any]:
    """(whether each row's new token ends it, the new recent-token window, stop-string states):
    an EOS/stop id, the end of a stop sequence or of a stop string, or the row's own limit
    (`lengths_B` counts the new token)."""
    ends_B = jnp.isin(tokens_B, stop_ids) | (lengths_B >= limits_B)
    if recent_BW is not None:
        recent_BW = push_recent(recent_BW, tokens_B)
        ends_B |= stop_sequence_hits(recent_BW, tables.sequences_SW)
    if stop_BK is not None:
        stop_BK, hit_B = advance_stop_strings(
            stop_BK, tokens_B, tables.strings_KVQ, tables.string_lengths_K
        )
        ends_B |= hit_B
    return ends_B, recent_BW, stop_BK


class SamplerSpec(NamedTuple):
    """What the traced programs depend on besides their arguments: samplers of the same model
    structure, mesh and rules share the compiled programs."""

    graphdef: Any
    mesh: Mesh | None
    rules: Any
    trace_context: Any


def traced(spec: SamplerSpec, body: Any, *args: Any) -> Any:
    """`body(spec, *args)` inside the spec's trace context (e.g. `lora.disable_adapter`)."""
    if spec.trace_context is None:
        return body(spec, *args)
    with spec.trace_context():
        return body(spec, *args)
