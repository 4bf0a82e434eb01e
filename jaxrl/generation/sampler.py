"""KV-cache sampling for jaxrl's causal LMs (every family of `jaxrl.models`).

Design (after Tunix's sampler):

- `Sampler(graphdef_or_model, mesh=None, rules=None, prompt_buckets=None, engine=...,
  num_slots=None)` holds no params:
  `sampler(params, prompts, generation_config, seed=...)` takes the params of a train state as
  they are (sharded, never copied), so the same sampler serves every policy update.
- Prompts (a list of token-id lists, or a [B, T] array with an optional padding mask, left or
  right padded) are left-padded on the host to a bucket length P: the next power of two (at least
  16) or the smallest of `prompt_buckets`. Only a few shapes ever reach the compiler.
- Two engines share the model's cached forward and the token choice. `engine="continuous"` (the
  default, `continuous.py`): `num_slots` decode slots and a queue of rows; a row that finishes
  frees its slot for the next waiting row, so long-tailed batches cost their useful tokens and
  the KV cache holds `num_slots` rows (default: `continuous.default_slots`). `engine="static"`
  (`static.py`): one prefill of the batch and one `lax.while_loop` decoding every row in
  lockstep until the last one is done. Each compiles a few programs per (slots or batch size,
  P, config), the cache (P + max_new_tokens - 1 slots per row) created sharded by batch and kv
  heads on the mesh and donated to the decode loop.
- Randomness: row r's completion token t is drawn with `fold_in(fold_in(rng, r), t)`
  (`jaxrl.core.sampling.row_keys`), so a seed fixes the output, and a row's completion does not
  depend on the engine, the slot it ran in, its neighbours or the mesh.
- Image prompts (an image-text Gemma 3, `pixel_values=`): the prefill merges the images'
  features into the prompt and lets each image's tokens attend within their image both ways
  (the training forward's mask, transformers' first `generate` forward); decoding is the
  text-only loop. Without images the prefills are the text-only ones.
- Token choice follows transformers' `generate` (`jaxrl.core.sampling`): the repetition penalty (on
  the float32 logits, for every id in the row's prompt or generated so far), the
  `min_new_tokens` mask of EOS/stop ids while fewer tokens have been generated, the
  `suppress_token_ids` (never chosen), then temperature, top-k, top-p, min-p and a draw
  (sampling) or argmax (greedy). With `repetition_penalty != 1` the decode loop carries a
  [B, V] bool mask of the ids seen so far.

Output (`SampleOutput`, device arrays): the left-padded prompt and its mask [B, P]; completion
ids [B, N] (N = max_new_tokens, pad after a row finished); a completion mask that is 1 up to and
including the first EOS/stop id; and each sampled token's log-prob: log_softmax of the
temperature-scaled logits before the repetition penalty, the min_new_tokens mask and
top-k/top-p/min-p filtering (greedy: of the raw logits), i.e. what a full forward of the model on
the produced sequence gives.

This module does no tokenization and no scoring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.config_checks import GENERATION_ENGINES
from jaxrl.data import stop_strings as stop_strings_lib
from jaxrl.generation import continuous, static
from jaxrl.generation.config import GenerationConfig
from jaxrl.generation.steps import NO_STOPS, SamplerSpec, SamplingState, StopTables
from jaxrl.models.config import ModelConfig
from jaxrl.models.families import family
from jaxrl.parallel import Rules, batch_sharding, data_parallel_size, merge_rules

ENGINES = GENERATION_ENGINES

MIN_BUCKET = 16


class SampleOutput(NamedTuple):
    """What `Sampler.__call__` returns (device arrays, rows in the order of the prompts)."""

    prompt_ids_BP: jax.Array
    prompt_mask_BP: jax.Array
    completion_ids_BN: jax.Array
    completion_mask_BN: jax.Array
    logprobs_BN: jax.Array


def as_key(seed: int | jax.Array) -> jax.Array:
    """A JAX PRNG key from an int seed, or the key given."""
    return jax.random.key(seed) if isinstance(seed, (int, np.integer)) else seed


def bucket_length(longest: int, buckets: Sequence[int] | None) -> int:
    """The padded prompt length for a batch whose longest prompt has `longest` tokens."""
    if buckets is None:
        return max(MIN_BUCKET, 1 << (longest - 1).bit_length())
    fitting = [b for b in sorted(buckets) if b >= longest]
    if not fitting:
        raise ValueError(
            f"The longest prompt has {longest} tokens, more than the largest prompt bucket "
            f"({max(buckets)}); add a larger bucket to prompt_buckets or shorten the prompts."
        )
    return fitting[0]


def left_pad(
    prompts: Any, prompt_mask: Any, buckets: Sequence[int] | None, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Ragged lists, or a padded array with its mask, -> left-padded ids and mask [B, P]."""
    if isinstance(prompts, (list, tuple)) and prompt_mask is None:
        rows = [np.asarray(p, dtype=np.int32).reshape(-1) for p in prompts]
    else:
        ids = np.asarray(prompts, dtype=np.int32)
        if ids.ndim != 2:
            raise ValueError(f"Prompt ids must be [B, T]; got shape {ids.shape}.")
        mask = np.ones_like(ids) if prompt_mask is None else np.asarray(prompt_mask)
        if mask.shape != ids.shape:
            raise ValueError(f"prompt_mask shape {mask.shape} != prompt ids shape {ids.shape}.")
        rows = [row[m.astype(bool)] for row, m in zip(ids, mask, strict=True)]
    if not rows:
        raise ValueError("No prompts given.")
    lengths = np.array([len(r) for r in rows])
    if (lengths == 0).any():
        raise ValueError(
            f"Prompt rows {np.flatnonzero(lengths == 0).tolist()} are empty; every prompt needs "
            "at least one token (e.g. BOS)."
        )
    width = bucket_length(int(lengths.max()), buckets)
    ids_BP = np.full((len(rows), width), pad_id, dtype=np.int32)
    mask_BP = np.zeros((len(rows), width), dtype=np.int32)
    for i, row in enumerate(rows):
        ids_BP[i, width - len(row) :] = row
        mask_BP[i, width - len(row) :] = 1
    return ids_BP, mask_BP


def row_limits(max_new_tokens: Any, n_prompts: int, group_size: int, cap: int) -> np.ndarray:
    """[n_prompts * group_size] int32 per-row limits from None (all `cap`), one int, or one per
    row (or per prompt, shared by its group), each checked to be in [1, cap]."""
    rows = n_prompts * group_size
    if max_new_tokens is None:
        return np.full((rows,), cap, np.int32)
    limits = np.asarray(max_new_tokens, dtype=np.int64).reshape(-1)
    if limits.size == 1:
        limits = np.full((rows,), int(limits[0]))
    elif limits.size == n_prompts and group_size > 1:
        limits = np.repeat(limits, group_size)
    if limits.size != rows:
        raise ValueError(
            f"max_new_tokens has {limits.size} entries; give one per completion row ({rows}) "
            f"or one per prompt ({n_prompts})."
        )
    if limits.min() < 1 or limits.max() > cap:
        raise ValueError(
            f"Per-row max_new_tokens must be in [1, {cap}] (the generation config's "
            f"max_new_tokens caps them); got {limits.min()}..{limits.max()}."
        )
    return limits.astype(np.int32)


class Sampler:
    """Batched sampling from a jaxrl causal LM with a KV cache (see the module docstring).

    `Sampler(model)` or `Sampler(graphdef)`; then `sampler(params, prompts, config, seed=0)`.
    With a model, `params=None` samples from that model's own params.
    `mesh`/`rules`: shard prompts and the cache by batch (and kv heads) on this mesh; the params
    keep whatever sharding they have.
    """

    # A context manager entered while the programs are traced (e.g. `lora.disable_adapter`).
    _trace_context: Any = None

    def __init__(
        self,
        graphdef_or_model: nnx.GraphDef | nnx.Module,
        *,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
        prompt_buckets: Sequence[int] | None = None,
        engine: str = "continuous",
        num_slots: int | None = None,
    ):
        if engine not in ENGINES:
            raise ValueError(
                f"engine must be one of {ENGINES} (the continuous engine refills decode slots "
                f"as rows finish; the static one decodes the batch in lockstep); got {engine!r}."
            )
        if num_slots is not None and num_slots < 1:
            raise ValueError(f"num_slots must be >= 1 (or None for the default); got {num_slots}.")
        self.engine, self.num_slots = engine, num_slots
        if isinstance(graphdef_or_model, nnx.Module):
            self.graphdef, self.params = nnx.split(graphdef_or_model)
        else:
            self.graphdef, self.params = graphdef_or_model, None
        self.mesh, self.rules = mesh, rules
        self.prompt_buckets = None if prompt_buckets is None else tuple(sorted(prompt_buckets))
        self._config: ModelConfig | None = None
        # The last stop-string automaton built (its tokenizer held so that its id stays unique).
        self._stop_cache: dict[str, Any] = {}
        # What the traced programs depend on besides their arguments: samplers of the same model
        # structure, mesh and rules share the compiled prefill and decode programs.
        # (`merge_rules`: the rules as hashable tuples, over the defaults as every user reads them.)
        self._spec = SamplerSpec(self.graphdef, mesh, merge_rules(rules), self._trace_context)

    def _prefill(
        self,
        params,
        prompt_ids_BP,
        prompt_mask_BP,
        rng,
        config,
        group_size=1,
        pixel_values=None,
        limits_B=None,
        stop_BK=None,
        tables=None,
    ):
        if limits_B is None:
            limits_B = jnp.full((len(prompt_ids_BP) * group_size,), config.max_new_tokens)
        tables = tables or NO_STOPS
        return static.prefill_program(
            self._spec,
            params,
            prompt_ids_BP,
            prompt_mask_BP,
            rng,
            config,
            group_size,
            pixel_values,
            limits_B,
            stop_BK,
            tables,
        )

    def _decode(self, params: Any, state: SamplingState, config: GenerationConfig, tables=None):
        return static.decode_program(self._spec, params, state, config, tables or NO_STOPS)

    def __call__(
        self,
        params: Any,
        prompts: Any,
        generation_config: GenerationConfig | None = None,
        *,
        prompt_mask: Any = None,
        seed: int | jax.Array = 0,
        group_size: int = 1,
        pixel_values: Any = None,
        max_new_tokens: Any = None,
        tokenizer: Any = None,
    ) -> SampleOutput:
        """Generate completions for `prompts` (ragged id lists, or [B, T] ids + optional mask).

        `seed`: an int or a JAX PRNG key. `group_size`: completions per prompt (GRPO's
        `num_generations`); each prompt is prefilled once and its KV cache rows are repeated
        before decoding, so the output has B * group_size rows, each prompt's group consecutive.
        `pixel_values` [B, I, C, H, W] (an image-text Gemma 3): prompt b's images in the order
        of its image tokens (rows with fewer pad with anything); the prefill merges their
        features into the prompt as the training forward does, decoding is text-only.
        `max_new_tokens`: each row's own limit (B * group_size ints in [1, the config's], or B
        for a group's rows alike); a row that reaches it ends there, its mask 1 up to it.
        `tokenizer`: the tokenizer whose texts `generation_config.stop_strings` match
        (transformers' `generate(..., tokenizer=)`).
        """
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}.")
        if params is None:
            if self.params is None:
                raise ValueError("This Sampler was built from a graphdef: pass its params.")
            params = self.params
        config = generation_config or GenerationConfig()
        model_config = self._model_config(params)
        ids_BP, mask_BP = left_pad(prompts, prompt_mask, self.prompt_buckets, config.pad_id)
        self._check_positions(model_config, mask_BP, config)
        rng = as_key(seed)
        limits_B = row_limits(max_new_tokens, len(ids_BP), group_size, config.max_new_tokens)
        tables, stop_BK = self._stop_tables(config, tokenizer, model_config, ids_BP, mask_BP)
        if pixel_values is not None:
            pixel_values = self._check_pixel_values(model_config, ids_BP, pixel_values)
            pixel_values = self._place(pixel_values)
        if stop_BK is not None:
            stop_BK = self._place(stop_BK)
        ids_BP, mask_BP = self._place(ids_BP), self._place(mask_BP)
        limits_B = self._place(limits_B)
        # (Text prompts pass pixel_values=None: no leaves, the text-only program.)
        if self.engine == "continuous":
            rows = len(ids_BP) * group_size
            tokens_BN, logprobs_BN, completion_mask_BN = continuous.generate(
                self._spec, params, ids_BP, mask_BP, rng, config, group_size, pixel_values,
                limits_B, stop_BK, tables, self.slots_for(rows, model_config, ids_BP.shape[1], config),
            )  # fmt: skip
            if group_size > 1:
                ids_BP, mask_BP = (jnp.repeat(x, group_size, axis=0) for x in (ids_BP, mask_BP))
            if self.mesh is not None:
                tokens_BN, logprobs_BN, completion_mask_BN = (
                    self._place(x) for x in (tokens_BN, logprobs_BN, completion_mask_BN)
                )
            return SampleOutput(ids_BP, mask_BP, tokens_BN, completion_mask_BN, logprobs_BN)
        state = self._prefill(
            params,
            ids_BP,
            mask_BP,
            rng,
            config,
            group_size,
            pixel_values,
            limits_B,
            stop_BK,
            tables,
        )
        state, completion_mask_BN = self._decode(params, state, config, tables)
        if group_size > 1:
            ids_BP, mask_BP = (jnp.repeat(x, group_size, axis=0) for x in (ids_BP, mask_BP))
        return SampleOutput(ids_BP, mask_BP, state.tokens_BN, completion_mask_BN, state.logprobs_BN)

    def slots_for(
        self, rows: int, model_config: ModelConfig, prompt_len: int, config: GenerationConfig
    ) -> int:
        """The continuous engine's decode slots for `rows` rows: `num_slots` (at most the rows,
        rounded up to the mesh's data-parallel size) or `continuous.default_slots`."""
        multiple = 1 if self.mesh is None else data_parallel_size(self.mesh, self.rules)
        if self.num_slots is not None:
            slots = min(self.num_slots, rows)
            return -(-slots // multiple) * multiple
        length = prompt_len + config.max_new_tokens - 1
        per_row = continuous.cache_bytes_per_row(model_config, length)
        return continuous.default_slots(rows, multiple, per_row)

    def _stop_tables(
        self,
        config: GenerationConfig,
        tokenizer: Any,
        model_config: ModelConfig,
        ids_BP: np.ndarray,
        mask_BP: np.ndarray,
    ) -> tuple[StopTables, np.ndarray | None]:
        """The device tables of `config`'s stop sequences and strings, and each prompt's
        stop-string states [B, K] (None without stop strings)."""
        sequences_SW = None
        if config.stop_sequences:
            width = max(map(len, config.stop_sequences))
            sequences_SW = np.full((len(config.stop_sequences), width), -1, np.int32)
            for i, seq in enumerate(config.stop_sequences):
                sequences_SW[i, width - len(seq) :] = seq
            sequences_SW = jnp.asarray(sequences_SW)
        if not config.stop_strings:
            return StopTables(sequences_SW, None, None), None
        if tokenizer is None:
            raise ValueError(
                f"stop_strings {list(config.stop_strings)} need the tokenizer to match texts: "
                "pass tokenizer=... to the sampler call (as transformers' generate)."
            )
        key = (id(tokenizer), config.stop_strings, model_config.vocab_size)
        if self._stop_cache.get("key") != key:
            table, texts, patterns = stop_strings_lib.build_table(
                tokenizer, config.stop_strings, model_config.vocab_size
            )
            self._stop_cache = {
                "key": key, "tokenizer": tokenizer, "texts": texts, "patterns": patterns,
                "device": (jnp.asarray(table.next_KVQ), jnp.asarray(table.lengths_K)),
            }  # fmt: skip
        cached = self._stop_cache
        rows = [row[m.astype(bool)] for row, m in zip(ids_BP, mask_BP, strict=True)]
        stop_BK = stop_strings_lib.prompt_states(cached["texts"], cached["patterns"], rows)
        return StopTables(sequences_SW, *cached["device"]), stop_BK

    def _model_config(self, params: Any) -> ModelConfig:
        if self._config is None:
            model = nnx.merge(self.graphdef, params)
            if not hasattr(model, "cached_hidden_states"):
                raise ValueError(
                    f"{type(model).__name__} has no KV-cache decode path; sample from a causal "
                    "LM of jaxrl.models (LlamaForCausalLM or GPT2ForCausalLM)."
                )
            self._config = model.config
        return self._config

    @staticmethod
    def _check_pixel_values(
        model_config: ModelConfig, ids_BP: np.ndarray, pixel_values: Any
    ) -> np.ndarray | jax.Array:
        """The prompts' images, checked against the model and the prompts' image tokens."""
        vision = model_config.vision
        if vision is None:
            raise ValueError(
                "pixel_values were given but the model has no vision tower; sample from an "
                "image-text Gemma 3 (Gemma3ForConditionalGeneration, loaded with vision=True)."
            )
        if pixel_values.ndim != 5 or pixel_values.shape[0] != ids_BP.shape[0]:
            raise ValueError(
                "pixel_values must be [B, I, C, H, W] with one row per prompt "
                f"({ids_BP.shape[0]}); got shape {tuple(pixel_values.shape)}."
            )
        tokens = np.sum(ids_BP == vision.image_token_id, axis=1)
        if (tokens > pixel_values.shape[1] * vision.mm_tokens_per_image).any():
            raise ValueError(
                f"A prompt has more image tokens than its {pixel_values.shape[1]} images give "
                f"({vision.mm_tokens_per_image} each)."
            )
        return pixel_values

    @staticmethod
    def _check_positions(
        model_config: ModelConfig, mask_BP: np.ndarray, config: GenerationConfig
    ) -> None:
        longest = int(mask_BP.sum(axis=1).max()) + config.max_new_tokens
        learned = family(model_config.model_type).learned_positions
        if learned and longest > model_config.max_position_embeddings:
            raise ValueError(
                f"Prompt + max_new_tokens reaches {longest} tokens but GPT-2 has only "
                f"{model_config.max_position_embeddings} learned positions; lower "
                "max_new_tokens or truncate the prompts."
            )

    def _place(self, x: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return jnp.asarray(x)
        n_split = data_parallel_size(self.mesh, self.rules)
        if len(x) % n_split:
            raise ValueError(
                f"{len(x)} prompts cannot be split over the mesh's data-parallel size {n_split}; "
                "give a multiple of it (e.g. repeat or pad the prompt list)."
            )
        return jax.device_put(x, batch_sharding(self.mesh, self.rules))
