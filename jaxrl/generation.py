"""KV-cache sampling for jaxrl's causal LMs (every family of `jaxrl.models`).

Design (after Tunix's sampler):

- `Sampler(graphdef_or_model, mesh=None, rules=None, prompt_buckets=None)` holds no params:
  `sampler(params, prompts, generation_config, seed=...)` takes the params of a train state as
  they are (sharded, never copied), so the same sampler serves every policy update.
- Prompts (a list of token-id lists, or a [B, T] array with an optional padding mask, left or
  right padded) are left-padded on the host to a bucket length P: the next power of two (at least
  16) or the smallest of `prompt_buckets`. Only a few shapes ever reach the compiler.
- Two jitted programs per (batch size, P, config): `prefill` runs the prompt through the model
  with the training attention kernel, fills the KV cache (P + max_new_tokens - 1 slots, created
  sharded by batch and kv heads on the mesh) and samples the first token; `decode` is one
  `lax.while_loop` that feeds one token per step and stops as soon as every row has finished.
  The sampling state, cache included, is donated to `decode`.
- Randomness: the key for completion token t is `fold_in(rng, t)`, so a seed fixes the output.
- Image prompts (an image-text Gemma 3, `pixel_values=`): the prefill merges the images'
  features into the prompt and lets each image's tokens attend within their image both ways
  (the training forward's mask, transformers' first `generate` forward); decoding is the
  text-only loop. Without images both programs are the text-only ones.
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

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.core.logprobs import unembed_logits
from jaxrl.core.sampling import choose_tokens, mark_seen, token_presence
from jaxrl.models.config import ModelConfig
from jaxrl.models.families import family
from jaxrl.models.kv_cache import Cache, CacheView, cache_shardings, init_cache
from jaxrl.models.masks import default_positions
from jaxrl.parallel import Rules, batch_sharding, data_parallel_size, merge_rules

MIN_BUCKET = 16
# transformers GenerationConfig fields that change the output and that we do not implement,
# with the value at which they are inactive.
_UNSUPPORTED_HF_FIELDS = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "stop_strings": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
    "guidance_scale": None,
    "penalty_alpha": None,
    "min_length": 0,
}


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How to generate, with transformers' field names and defaults.

    `max_new_tokens` counts completion tokens (transformers' default budget is `max_length=20`
    tokens in total; here it is 20 new ones). `top_k=0` or `top_p=1.0` turn those filters off;
    temperature, top-k, top-p and min-p apply only with `do_sample=True` (as transformers, which
    only warns when they are set for greedy decoding; here they are ignored then).
    `eos_token_id` may be one id or several; `stop_token_ids` are extra ids that end a
    completion exactly like EOS (vLLM's name). `pad_token_id` fills completions after they end
    (default: the first EOS id, as transformers, else 0).

    `repetition_penalty` (> 0, 1.0 = off; transformers' `RepetitionPenaltyLogitsProcessor`):
    the logit of every id that occurs in the row's prompt (its real tokens, not its padding) or
    among its tokens generated so far is divided by the penalty if it is >= 0 and multiplied
    by it if it is < 0, once per id however often it occurs. It applies before everything
    else, to greedy decoding too. `min_p` (in [0, 1], None = off; transformers'
    `MinPLogitsWarper`): after temperature, top-k and top-p, tokens whose probability
    (renormalised over what those kept) is below `min_p` times the most likely token's are
    dropped. Neither changes the returned log-probs (see the module docstring).

    `suppress_token_ids` (transformers' `SuppressTokensLogitsProcessor`, TRL's
    `suppress_tokens=[image_token_id]` for image-text models): ids never chosen, greedy or
    sampled (their logits are -inf before the draw; the log-probs are left as they are).
    """

    max_new_tokens: int = 20
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    min_p: float | None = None
    suppress_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        eos = self.eos_token_id
        if eos is not None:
            eos = tuple(int(i) for i in eos) if isinstance(eos, Sequence) else int(eos)
            object.__setattr__(self, "eos_token_id", eos)
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        object.__setattr__(
            self, "suppress_token_ids", tuple(int(i) for i in self.suppress_token_ids)
        )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}.")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 when do_sample=True, got {self.temperature}; use "
                "do_sample=False for greedy decoding."
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        penalty = float(self.repetition_penalty)
        if not penalty > 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1.0 = off, above 1 discourages repeating a "
                f"token of the prompt or completion), got {self.repetition_penalty}."
            )
        object.__setattr__(self, "repetition_penalty", penalty)
        if self.min_p is not None:
            min_p = float(self.min_p)
            if not 0.0 <= min_p <= 1.0:
                raise ValueError(f"min_p must be in [0, 1] or None (off), got {self.min_p}.")
            object.__setattr__(self, "min_p", min_p)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a completion: the EOS id(s), then `stop_token_ids`."""
        eos = self.eos_token_id
        eos = () if eos is None else (eos,) if isinstance(eos, int) else eos
        return tuple(dict.fromkeys((*eos, *self.stop_token_ids)))

    @property
    def pad_id(self) -> int:
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.stop_ids[0] if self.stop_ids else 0

    @classmethod
    def from_transformers(cls, hf_config: Any, **overrides: Any) -> GenerationConfig:
        """From a `transformers.GenerationConfig` (unset fields take transformers' defaults).

        Raises on options that change the output but are not implemented here (beam search,
        no_repeat_ngram_size, typical_p, ...), and when neither the config nor `overrides` give
        `max_new_tokens` (a `max_length` budget depends on each prompt's length).
        """
        defaults = type(hf_config)._get_default_generation_params()
        unset = object()

        def field(name: str) -> Any:
            value = getattr(hf_config, name, unset)
            return defaults.get(name) if value is None or value is unset else value

        active = {
            name: field(name)
            for name, off in _UNSUPPORTED_HF_FIELDS.items()
            if field(name) not in (off, None)
        }
        if active:
            raise ValueError(
                f"jaxrl.generation does not implement these generation options: {active}; unset "
                "them (greedy/sampling with temperature, top_k, top_p, min_p, "
                "repetition_penalty, min_new_tokens and EOS/stop ids are supported)."
            )
        values = {
            "max_new_tokens": getattr(hf_config, "max_new_tokens", None),
            "min_new_tokens": getattr(hf_config, "min_new_tokens", None) or 0,
            "do_sample": bool(field("do_sample")),
            "temperature": float(field("temperature")),
            "top_k": int(field("top_k") or 0),
            "top_p": float(field("top_p")),
            "repetition_penalty": float(field("repetition_penalty")),
            "min_p": field("min_p"),
            "eos_token_id": getattr(hf_config, "eos_token_id", None),
            "pad_token_id": getattr(hf_config, "pad_token_id", None),
        }
        values.update(overrides)
        if values["max_new_tokens"] is None:
            raise ValueError(
                "The transformers GenerationConfig sets no max_new_tokens; set it there or pass "
                "max_new_tokens=... to GenerationConfig.from_transformers."
            )
        return cls(**values)


class SampleOutput(NamedTuple):
    """What `Sampler.__call__` returns (device arrays, rows in the order of the prompts)."""

    prompt_ids_BP: jax.Array
    prompt_mask_BP: jax.Array
    completion_ids_BN: jax.Array
    completion_mask_BN: jax.Array
    logprobs_BN: jax.Array


@flax.struct.dataclass
class SamplingState:
    """The decode loop's carry; `step` completion tokens have been chosen so far."""

    step: jax.Array
    tokens_BN: jax.Array
    logprobs_BN: jax.Array
    done_B: jax.Array
    lengths_B: jax.Array
    positions_B: jax.Array
    key_mask_BS: jax.Array
    cache: Cache
    rng: jax.Array
    # [B, V]: ids in each row's prompt or completion so far; None without a repetition penalty.
    seen_BV: jax.Array | None = None


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
    ):
        if isinstance(graphdef_or_model, nnx.Module):
            self.graphdef, self.params = nnx.split(graphdef_or_model)
        else:
            self.graphdef, self.params = graphdef_or_model, None
        self.mesh, self.rules = mesh, rules
        self.prompt_buckets = None if prompt_buckets is None else tuple(sorted(prompt_buckets))
        self._config: ModelConfig | None = None
        # What the traced programs depend on besides their arguments: samplers of the same model
        # structure, mesh and rules share the compiled prefill and decode programs.
        # (`merge_rules`: the rules as hashable tuples, over the defaults as every user reads them.)
        self._spec = _SamplerSpec(self.graphdef, mesh, merge_rules(rules), self._trace_context)

    def _prefill(
        self, params, prompt_ids_BP, prompt_mask_BP, rng, config, group_size=1, pixel_values=None
    ):
        return _prefill_program(
            self._spec, params, prompt_ids_BP, prompt_mask_BP, rng, config, group_size,
            pixel_values,
        )  # fmt: skip

    def _decode(self, params: Any, state: SamplingState, config: GenerationConfig):
        return _decode_program(self._spec, params, state, config)

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
    ) -> SampleOutput:
        """Generate completions for `prompts` (ragged id lists, or [B, T] ids + optional mask).

        `seed`: an int or a JAX PRNG key. `group_size`: completions per prompt (GRPO's
        `num_generations`); each prompt is prefilled once and its KV cache rows are repeated
        before decoding, so the output has B * group_size rows, each prompt's group consecutive.
        `pixel_values` [B, I, C, H, W] (an image-text Gemma 3): prompt b's images in the order
        of its image tokens (rows with fewer pad with anything); the prefill merges their
        features into the prompt as the training forward does, decoding is text-only.
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
        rng = jax.random.key(seed) if isinstance(seed, (int, np.integer)) else seed
        if pixel_values is not None:
            pixel_values = self._check_pixel_values(model_config, ids_BP, pixel_values)
            pixel_values = self._place(pixel_values)
        ids_BP, mask_BP = self._place(ids_BP), self._place(mask_BP)
        # (Text prompts pass pixel_values=None: no leaves, the text-only program.)
        state = self._prefill(params, ids_BP, mask_BP, rng, config, group_size, pixel_values)
        state, completion_mask_BN = self._decode(params, state, config)
        if group_size > 1:
            ids_BP, mask_BP = (jnp.repeat(x, group_size, axis=0) for x in (ids_BP, mask_BP))
        return SampleOutput(ids_BP, mask_BP, state.tokens_BN, completion_mask_BN, state.logprobs_BN)

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


class _SamplerSpec(NamedTuple):
    graphdef: Any
    mesh: Mesh | None
    rules: Any
    trace_context: Any


def _traced(spec: _SamplerSpec, body: Any, *args: Any) -> Any:
    if spec.trace_context is None:
        return body(spec, *args)
    with spec.trace_context():
        return body(spec, *args)


def _prefill_body(
    spec: _SamplerSpec,
    params: Any,
    prompt_ids_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    rng: jax.Array,
    config: GenerationConfig,
    group_size: int = 1,
    pixel_values: jax.Array | None = None,
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
        cache, logits_BV, key_mask_BS, prompt_mask_BP, seen_BV = (
            jax.tree.map(lambda x, a=axis: jnp.repeat(x, group_size, axis=a), tree)
            for tree, axis in (
                (cache, 1 if model.config.scan_layers else 0),
                (logits_BV, 0),
                (key_mask_BS, 0),
                (prompt_mask_BP, 0),
                (seen_BV, 0),
            )
        )
        if spec.mesh is not None:
            cache = jax.lax.with_sharding_constraint(
                cache, cache_shardings(model.config, batch, cache_len, spec.mesh, spec.rules)
            )
    if seen_BV is not None and spec.mesh is not None:
        seen_BV = jax.lax.with_sharding_constraint(seen_BV, batch_sharding(spec.mesh, spec.rules))
    step = jnp.zeros((), jnp.int32)
    tokens_B, logprobs_B = choose_tokens(logits_BV, rng, step, config, seen_BV)
    return SamplingState(
        step=step + 1,
        tokens_BN=jnp.full((batch, n_new), config.pad_id, jnp.int32).at[:, 0].set(tokens_B),
        logprobs_BN=jnp.zeros((batch, n_new), jnp.float32).at[:, 0].set(logprobs_B),
        done_B=jnp.isin(tokens_B, jnp.asarray(config.stop_ids, jnp.int32)),
        lengths_B=jnp.ones((batch,), jnp.int32),
        positions_B=jnp.sum(prompt_mask_BP, axis=1).astype(jnp.int32),
        key_mask_BS=key_mask_BS,
        cache=cache,
        rng=rng,
        seen_BV=None if seen_BV is None else mark_seen(seen_BV, tokens_B),
    )


def _decode_body(
    spec: _SamplerSpec, params: Any, state: SamplingState, config: GenerationConfig
) -> tuple[SamplingState, jax.Array]:
    model = nnx.merge(spec.graphdef, params)
    unembed_DV = model.unembed_weight()
    n_new = config.max_new_tokens
    prompt_len = state.key_mask_BS.shape[1] - (n_new - 1)
    stop_ids = jnp.asarray(config.stop_ids, jnp.int32)

    def unfinished(s: SamplingState) -> jax.Array:
        return (s.step < n_new) & ~jnp.all(s.done_B)

    def one_token(s: SamplingState) -> SamplingState:
        last_B1 = jax.lax.dynamic_slice_in_dim(s.tokens_BN, s.step - 1, 1, axis=1)
        view = CacheView(prompt_len + s.step - 1, s.key_mask_BS)
        h_B1D, cache = model.cached_hidden_states(last_B1, s.positions_B[:, None], s.cache, view)
        logits_BV = unembed_logits(h_B1D[:, 0], unembed_DV, model.config.final_logit_softcap)
        tokens_B, logprobs_B = choose_tokens(logits_BV, s.rng, s.step, config, s.seen_BV)
        tokens_B = jnp.where(s.done_B, config.pad_id, tokens_B)
        logprobs_B = jnp.where(s.done_B, 0.0, logprobs_B)
        # (Finished rows add the pad id, as in transformers; their tokens are pad anyway.)
        seen_BV = None if s.seen_BV is None else mark_seen(s.seen_BV, tokens_B)
        return s.replace(
            step=s.step + 1,
            tokens_BN=jax.lax.dynamic_update_slice_in_dim(
                s.tokens_BN, tokens_B[:, None], s.step, axis=1
            ),
            logprobs_BN=jax.lax.dynamic_update_slice_in_dim(
                s.logprobs_BN, logprobs_B[:, None], s.step, axis=1
            ),
            done_B=s.done_B | jnp.isin(tokens_B, stop_ids),
            lengths_B=jnp.where(s.done_B, s.lengths_B, s.lengths_B + 1),
            positions_B=s.positions_B + 1,
            cache=cache,
            seen_BV=seen_BV,
        )

    state = jax.lax.while_loop(unfinished, one_token, state)
    mask_BN = (jnp.arange(n_new)[None, :] < state.lengths_B[:, None]).astype(jnp.int32)
    # The whole final state is returned so every donated buffer (the cache above all) is
    # updated in place by the loop rather than copied into it.
    return state, mask_BN


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _prefill_program(
    spec, params, prompt_ids_BP, prompt_mask_BP, rng, config, group_size, pixel_values
):
    args = (params, prompt_ids_BP, prompt_mask_BP, rng, config, group_size, pixel_values)
    return _traced(spec, _prefill_body, *args)


# The state (KV cache included) is dead after decoding: donate it.
@functools.partial(jax.jit, static_argnums=(0, 3), donate_argnums=(2,))
def _decode_program(spec, params, state, config):
    return _traced(spec, _decode_body, params, state, config)
