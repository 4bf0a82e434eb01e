"""Stop strings as a token-level automaton the sampler can run on device (host-only, numpy).

transformers' `StopStringCriteria` semantics: a row stops at the first token after which the
text of the sequence (prompt and completion) contains a stop string that overlaps that last
token, i.e. an occurrence of the string that ends inside the token just generated. Strings may
span several tokens and overhang either end ("st"+"opera" and "las"+"topper" both end "stop").
Texts are compared as bytes for byte-level (GPT-2/Qwen style) and byte-fallback vocabularies
and as strings otherwise, each token read the way transformers reads it.

Here each stop string is a Knuth-Morris-Pratt automaton over characters, lifted to tokens: for
every token id and every state q (how many leading characters of the string the text ends
with), the state after reading the token's text, or `len(string)` when an occurrence ends
inside the token (a hit). Checking every step, the first hit is the first step at which
transformers' criterion holds. The sampler keeps one state per row and string and advances it
with one gather per token (`jaxrl.core.sampling.advance_stop_strings`).

Nothing here is traced; nothing here knows about models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

_PREFIX = "abcdef"  # a plain text before each token, so tokenizers do not strip its leading space


class StopStringTable(NamedTuple):
    """`next_KVQ[k, v, q]`: string k's state after token v from state q (`lengths_K[k]` = hit).
    States run over 0..max length - 1; ids the tokenizer does not know lead to state 0."""

    next_KVQ: np.ndarray
    lengths_K: np.ndarray


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable bytes stand for themselves, the
    others are shifted to 256 + n in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_types(tokenizer: Any) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    found = {type(decoder).__name__}
    try:
        import json

        state = decoder.__getstate__()
        config = json.loads(state if isinstance(state, (str, bytes)) else "{}")
    except (AttributeError, TypeError, ValueError):
        return found

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config)
    return found


def token_texts(tokenizer: Any) -> tuple[dict[int, str | bytes], bool]:
    """Each id's text as transformers' stop-string matching reads it, and whether texts are
    bytes (byte-level or byte-fallback decoders; then stop strings are matched as UTF-8)."""
    types = _decoder_types(tokenizer)
    mode = (
        "byte_fallback"
        if "ByteFallback" in types
        else "byte_level"
        if "ByteLevel" in types
        else None
    )
    alphabet = _byte_level_alphabet() if mode == "byte_level" else {}
    base = [
        tokenizer.convert_ids_to_tokens(i)
        for i in tokenizer(_PREFIX, add_special_tokens=False)["input_ids"]
    ]
    texts: dict[int, str | bytes] = {}
    for token, idx in tokenizer.get_vocab().items():
        text: str | bytes | None = None
        if mode == "byte_level" and all(c in alphabet for c in token):
            text = bytes(alphabet[c] for c in token)
        elif (
            mode == "byte_fallback"
            and len(token) == 6
            and token.startswith("<0x")
            and token.endswith(">")
            and all(c in "0123456789abcdefABCDEF" for c in token[3:5])
        ):
            text = bytes([int(token[3:5], 16)])
        if text is None:
            joined = tokenizer.convert_tokens_to_string([*base, token])
            at = joined.find(_PREFIX)
            # (A vocabulary that cannot spell the prefix: the token's text on its own.)
            text = (
                joined[at + len(_PREFIX) :]
                if at >= 0
                else tokenizer.convert_tokens_to_string([token])
            )
            if mode is not None:
                text = text.encode("utf-8")
        texts[int(idx)] = text
    return texts, mode is not None


def _failure(pattern: Sequence[Any]) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of pattern[:i]."""
    fail = [0] * (len(pattern) + 1)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i + 1] = k
    return fail


def _feed(pattern: Sequence[Any], fail: list[int], q: int, text: Sequence[Any]) -> int:
    """The state after `text` from state q; `len(pattern)` as soon as the pattern completes."""
    n = len(pattern)
    for c in text:
        while q and pattern[q] != c:
            q = fail[q]
        if pattern[q] == c:
            q += 1
        if q == n:
            return n
    return q


def prompt_states(
    table_texts: dict[int, str | bytes], stop_strings: Sequence[str | bytes], rows: Sequence[Any]
) -> np.ndarray:
    """[B, K] each string's state after each row's prompt (its real tokens): the longest prefix
    of the string the prompt's text ends with (a full occurrence inside the prompt is not a
    hit: it does not overlap a generated token)."""
    states = np.zeros((len(rows), len(stop_strings)), np.int32)
    for k, s in enumerate(stop_strings):
        fail = _failure(s)
        for b, row in enumerate(rows):
            q = 0
            for tok in row[-len(s) :] if len(s) else []:
                text = table_texts.get(int(tok), s[:0])
                for c in text:  # as _feed, but continuing past a full match
                    while q and (q == len(s) or s[q] != c):
                        q = fail[q]
                    if s[q] == c:
                        q += 1
            states[b, k] = fail[q] if q == len(s) else q
    return states


def build_table(
    tokenizer: Any, stop_strings: Sequence[str], vocab_size: int
) -> tuple[StopStringTable, dict[int, str | bytes], tuple[str | bytes, ...]]:
    """The automaton of `stop_strings` over a vocabulary of `vocab_size` ids (the model's logits
    width; ids the tokenizer lacks never advance a match), with each id's text and the strings
    in the form they are matched (bytes or str)."""
    if not stop_strings or any(not s for s in stop_strings):
        raise ValueError(f"stop_strings must be non-empty strings, got {list(stop_strings)}.")
    texts, as_bytes = token_texts(tokenizer)
    patterns = tuple(s.encode("utf-8") if as_bytes else s for s in stop_strings)
    width = max(len(p) for p in patterns)
    next_KVQ = np.zeros((len(patterns), vocab_size, width), np.int32)
    for k, pattern in enumerate(patterns):
        fail = _failure(pattern)
        chars = set(pattern)
        for idx, text in texts.items():
            # A token sharing no character with the string resets every state to 0.
            if idx >= vocab_size or not chars.intersection(text):
                continue
            for q in range(len(pattern)):
                next_KVQ[k, idx, q] = _feed(pattern, fail, q, text)
    lengths_K = np.array([len(p) for p in patterns], np.int32)
    return StopStringTable(next_KVQ, lengths_K), texts, patterns
