"""`GenerationConfig`: how the sampler generates, with transformers' field names and defaults
(and `from_transformers`). Host-side values only; nothing here is traced."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

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

    `stop_sequences`: token-id sequences that end a completion once its generated tokens end
    with one (the last token of the sequence is kept, as an EOS is; the prompt is not searched,
    as vLLM matches stops in the output only). `stop_strings` (transformers'
    `StopStringCriteria`, needs the tokenizer: `sampler(..., tokenizer=tok)`): a row stops at the
    token after which the text of prompt + completion contains one of the strings overlapping
    that token; strings may span tokens and overhang them (`jaxrl.data.stop_strings`). Like EOS,
    as in transformers, `min_new_tokens` only bans the EOS/stop ids, so stop sequences and
    strings end a row at any length.
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
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        eos = self.eos_token_id
        if eos is not None:
            eos = tuple(int(i) for i in eos) if isinstance(eos, Sequence) else int(eos)
            object.__setattr__(self, "eos_token_id", eos)
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        object.__setattr__(
            self, "suppress_token_ids", tuple(int(i) for i in self.suppress_token_ids)
        )
        sequences = tuple(tuple(int(i) for i in seq) for seq in self.stop_sequences)
        if any(not seq or min(seq) < 0 for seq in sequences):
            raise ValueError(
                f"stop_sequences must be non-empty sequences of token ids >= 0, got {sequences}."
            )
        object.__setattr__(self, "stop_sequences", sequences)
        strings = self.stop_strings
        strings = (strings,) if isinstance(strings, str) else tuple(strings or ())
        if any(not isinstance(x, str) or not x for x in strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {strings}.")
        object.__setattr__(self, "stop_strings", strings)
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
            "stop_strings": getattr(hf_config, "stop_strings", None) or (),
        }
        values.update(overrides)
        if values["max_new_tokens"] is None:
            raise ValueError(
                "The transformers GenerationConfig sets no max_new_tokens; set it there or pass "
                "max_new_tokens=... to GenerationConfig.from_transformers."
            )
        return cls(**values)
