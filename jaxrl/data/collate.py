"""Collators: lists of tokenized examples -> fixed-shape numpy batches for a jitted step.

Every batch has a shape `[rows, seq_len]` from a small set (`length_buckets`: the run's static
length and a few shorter ones), so the jitted steps compile a bounded number of programs.
Padding is on the right with `pad_token_id` and `attention_mask == 0` (and `segment_ids == 0`).

Only rows packed by best fit (`pack_bfd`) and padding-free rows (`collate_padding_free`: one row
per device holding its examples back to back, TRL's `padding_free=True`) carry `segment_ids`
(1..n per document, 0 on padding).
A batch without them holds one sequence per row followed by padding (one document, or a `wrapped`
cut of several that, as in TRL, is one causal sequence), so causal attention alone is exact at
every real token (no real query ever has a padding key before it), and the trainers call the
model without a mask (`jaxrl.algos.masks.model_masks`). On GPU that lets cuDNN run its causal
kernel instead of reading a `[B, 1, T, S]` bias and writing its gradient; the hidden states of
padding positions change, and none of them is scored or reaches a real token.

Target alignment (shared by every collator that emits `loss_mask`):
    targets[b, t]   = input_ids[b, t + 1]           (last position: pad_token_id)
    loss_mask[b, t] = 1.0 iff input token t + 1 is a trained token of the same segment as t
so `logits[b, t]` is scored against `targets[b, t]` where `loss_mask[b, t] == 1`. The last
position of a row and the last token of each document of a `segment_ids` row therefore never
carry loss.
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

Example = Mapping[str, Any]


def choose_seq_len(
    dataset_lengths: Iterable[int], max_length: int | None, multiple_of: int = 8
) -> int:
    """One static length for the run: the longest example rounded up to `multiple_of`, capped at
    `max_length` (no cap when `max_length` is None)."""
    lengths = list(dataset_lengths)
    if not lengths:
        raise ValueError("choose_seq_len got no example lengths; the dataset is empty.")
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}.")
    longest = max(max(lengths), 1)
    rounded = math.ceil(longest / multiple_of) * multiple_of
    return rounded if max_length is None else min(max_length, rounded)


# `length_buckets="auto"`: powers of two from this length (each rounded up to
# `pad_to_multiple_of`) below the run's static row length, then that length itself. Rows of a
# few hundred tokens or fewer run at one shape, where a step is mostly fixed costs anyway.
AUTO_MIN_BUCKET = 256


def length_buckets(
    static_len: int, spec: str | Sequence[int] | None, multiple_of: int | None = None
) -> tuple[int, ...]:
    """The row lengths batches may be padded to, ascending, the last being `static_len`:
    `spec` "auto" (powers of two from `AUTO_MIN_BUCKET` rounded up to `multiple_of`), a list of
    lengths, or None (`static_len` alone). Lengths at or above `static_len` are dropped."""
    if spec is None:
        return (static_len,)
    if spec == "auto":
        m = multiple_of or 1
        candidates, b = [], AUTO_MIN_BUCKET
        while b < static_len:
            candidates.append(-(-b // m) * m)
            b *= 2
    else:
        candidates = list(spec)
    return tuple(sorted({int(c) for c in candidates if c < static_len})) + (static_len,)


def padding_free_buckets(
    static_len: int, spec: str | Sequence[int] | None, multiple_of: int | None = None
) -> tuple[int, ...]:
    """`length_buckets` for padding-free rows (each a device's examples back to back, at most
    `static_len` tokens): as `length_buckets`, but "auto" adds `1.5 x 2^k` between the powers
    of two. A flattened row's length is a sum of several examples' lengths, so it varies little
    from step to step and the finer grid costs few extra compiles while wasting at most a third
    of a row (a half with powers of two alone)."""
    if spec != "auto":
        return length_buckets(static_len, spec, multiple_of)
    m = multiple_of or 1
    candidates, b = [], AUTO_MIN_BUCKET
    while b < static_len:
        candidates += [b, b + b // 2]
        b *= 2
    rounded = [-(-c // m) * m for c in candidates]
    return length_buckets(static_len, rounded, multiple_of)


def padding_free_longest_row(lengths_by_host: Sequence[Sequence[int]], per_device: int) -> int:
    """The longest padding-free row of a batch: each host's examples (`lengths_by_host`, in
    order) go `per_device` at a time to its devices' rows (`collate_padding_free`)."""
    longest = 0
    for lengths in lengths_by_host:
        x = np.asarray(lengths, np.int64)
        x = np.pad(x, (0, (-len(x)) % per_device))
        longest = max(longest, int(x.reshape(-1, per_device).sum(axis=1).max(initial=0)))
    return longest


def bucket_length(longest: int, buckets: Sequence[int]) -> int:
    """The smallest of `buckets` (ascending) holding a row of `longest` tokens; the largest when
    none does (the collator then names the example that is too long)."""
    for b in buckets:
        if b >= longest:
            return b
    return buckets[-1]


def _rows_to_batch(
    ids_rows: Sequence[Sequence[int]],
    trained_rows: Sequence[Sequence[int]],
    seq_len: int,
    pad_token_id: int,
    positions_rows: Sequence[Sequence[int]] | None = None,
    segment_rows: Sequence[Sequence[int]] | None = None,
) -> dict[str, np.ndarray]:
    n = len(ids_rows)
    input_ids = np.full((n, seq_len), pad_token_id, dtype=np.int32)
    trained = np.zeros((n, seq_len), dtype=bool)
    positions = np.zeros((n, seq_len), dtype=np.int32)
    segment_ids = np.zeros((n, seq_len), dtype=np.int32)
    for b, ids in enumerate(ids_rows):
        length = len(ids)
        if length > seq_len:
            raise ValueError(
                f"An example has {length} tokens but the batch length is {seq_len}. Prepare the "
                f"dataset with max_length <= {seq_len} or pick seq_len with choose_seq_len."
            )
        input_ids[b, :length] = ids
        trained[b, :length] = np.asarray(trained_rows[b], dtype=bool)
        if positions_rows is None:
            positions[b, :length] = np.arange(length)
        else:
            positions[b, :length] = positions_rows[b]
        segment_ids[b, :length] = 1 if segment_rows is None else segment_rows[b]
    targets = np.full_like(input_ids, pad_token_id)
    targets[:, :-1] = input_ids[:, 1:]
    same_doc = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    loss_mask = np.zeros((n, seq_len), dtype=np.float32)
    loss_mask[:, :-1] = trained[:, 1:] & same_doc
    batch = {
        "input_ids": input_ids,
        "targets": targets,
        "attention_mask": (segment_ids > 0).astype(np.int32),
        "positions": positions,
        "loss_mask": loss_mask,
    }
    if segment_rows is not None:  # packed rows; see the module docstring
        batch["segment_ids"] = segment_ids
    return batch


def collate_sft(
    examples: Sequence[Example], seq_len: int, pad_token_id: int
) -> dict[str, np.ndarray]:
    """SFT batch `[B, seq_len]`: `input_ids`, `targets`, `attention_mask`, `positions`,
    `segment_ids` (best-fit packed rows only; int32) and `loss_mask` (float32), aligned as in
    the module docstring.

    Examples carry `input_ids` and optionally `loss_mask` (per input token: 1 = trained; default
    all ones), `positions` and `segment_ids` (best-fit packed rows; default one sequence per row,
    positions 0..L-1).
    """
    ids = [ex["input_ids"] for ex in examples]
    trained = [ex.get("loss_mask", [1] * len(ex["input_ids"])) for ex in examples]
    packed = all("segment_ids" in ex for ex in examples)
    return _rows_to_batch(
        ids,
        trained,
        seq_len,
        pad_token_id,
        positions_rows=[ex["positions"] for ex in examples] if packed else None,
        segment_rows=[ex["segment_ids"] for ex in examples] if packed else None,
    )


def collate_padding_free(
    examples: Sequence[Example],
    per_device: int,
    rows: int,
    seq_len: int,
    pad_token_id: int,
) -> dict[str, np.ndarray]:
    """TRL's padding-free SFT batch `[rows, seq_len]`: row `r` holds examples
    `[r * per_device, (r + 1) * per_device)` (a device's share; rows past the examples stay
    empty) back to back, each its own segment (`segment_ids` 1..n, positions restarting at 0),
    padded at the right. Keys and alignment as `collate_sft`: an example's last token has no
    target (TRL's `labels[position_ids == 0] = -100`) and no example attends to another.
    `examples` are real ones only (an epoch's short last batch leaves rows short or empty);
    `example_mask` `[rows]` is 0 for a row that holds no example (it weighs nothing)."""
    if len(examples) > rows * per_device:
        raise ValueError(
            f"{len(examples)} examples do not fit {rows} padding-free rows of {per_device}."
        )
    ids, trained, positions, segments = [], [], [], []
    for r in range(rows):
        group = examples[r * per_device : (r + 1) * per_device]
        lengths = [len(ex["input_ids"]) for ex in group]
        ids.append([t for ex in group for t in ex["input_ids"]])
        trained.append([t for ex in group for t in ex.get("loss_mask", [1] * len(ex["input_ids"]))])
        positions.append([p for n in lengths for p in range(n)])
        segments.append([k for k, n in enumerate(lengths, start=1) for _ in range(n)])
        if len(ids[-1]) > seq_len:
            raise ValueError(
                f"A padding-free row holds {len(ids[-1])} tokens ({len(group)} examples) but "
                f"the batch length is {seq_len}; pick it with padding_free_longest_row."
            )
    batch = _rows_to_batch(ids, trained, seq_len, pad_token_id, positions, segments)
    batch["example_mask"] = np.asarray([float(bool(row)) for row in ids], np.float32)
    return batch


def collate_preference(
    examples: Sequence[Example], seq_len: int, pad_token_id: int
) -> dict[str, np.ndarray]:
    """DPO batch `[2B, seq_len]`: rows 0..B-1 are `prompt + chosen`, rows B..2B-1 `prompt + rejected`.

    Keys as `collate_sft`; `loss_mask` covers completion targets only (summing
    `log_probs * loss_mask` over a row gives the completion log-prob TRL's DPO uses).
    """
    ids, trained = [], []
    for key in ("chosen_input_ids", "rejected_input_ids"):
        for ex in examples:
            prompt, completion = list(ex["prompt_input_ids"]), list(ex[key])
            ids.append(prompt + completion)
            trained.append([0] * len(prompt) + [1] * len(completion))
    return _rows_to_batch(ids, trained, seq_len, pad_token_id)


def collate_preference_shared(
    examples: Sequence[Example], seq_len: int, pad_token_id: int
) -> dict[str, np.ndarray]:
    """DPO batch with prefix sharing, `[B, seq_len]`: one row `prompt + chosen + rejected` per pair.

    The prompt is run once per pair instead of twice. Keys: `input_ids`, `targets` (the usual
    shift), `attention_mask` (real tokens), `positions` (the rejected branch restarts right after
    the prompt, so each branch sees the positions it has in its own `prompt + completion` row),
    `branch_ids` (0 pad, 1 prompt, 2 chosen, 3 rejected: a query sees earlier keys of its own
    branch and of the prompt, never the other completion), `source_index` (the position whose
    hidden state scores `targets[t]`: `t`, except the slot of the first rejected token, scored
    from the last prompt token) and float32 `chosen_mask` / `rejected_mask` (the scored slots).
    Summing `log_probs * chosen_mask` over a row equals the completion log-prob of the
    `prompt + chosen` row of `collate_preference`.
    """
    n = len(examples)
    input_ids = np.full((n, seq_len), pad_token_id, dtype=np.int32)
    positions = np.zeros((n, seq_len), dtype=np.int32)
    branch_ids = np.zeros((n, seq_len), dtype=np.int32)
    source_index = np.tile(np.arange(seq_len, dtype=np.int32), (n, 1))
    chosen_mask = np.zeros((n, seq_len), dtype=np.float32)
    rejected_mask = np.zeros((n, seq_len), dtype=np.float32)
    for b, ex in enumerate(examples):
        prompt = list(ex["prompt_input_ids"])
        chosen, rejected = list(ex["chosen_input_ids"]), list(ex["rejected_input_ids"])
        p, c, r = len(prompt), len(chosen), len(rejected)
        if p + c + r > seq_len:
            raise ValueError(
                f"A prefix-shared pair has {p + c + r} tokens (prompt {p} + chosen {c} + "
                f"rejected {r}) but the batch length is {seq_len}; pick seq_len from the "
                "longest prompt + chosen + rejected."
            )
        input_ids[b, : p + c + r] = prompt + chosen + rejected
        positions[b, : p + c] = np.arange(p + c)
        positions[b, p + c : p + c + r] = np.arange(p, p + r)
        branch_ids[b, :p] = 1
        branch_ids[b, p : p + c] = 2
        branch_ids[b, p + c : p + c + r] = 3
        if p == 0:  # no token precedes the first completion token: it is not scored
            chosen_mask[b, : max(c - 1, 0)] = 1.0
            rejected_mask[b, c : c + max(r - 1, 0)] = 1.0
            continue
        chosen_mask[b, p - 1 : p + c - 1] = 1.0
        rejected_mask[b, p + c - 1 : p + c + r - 1] = 1.0
        if r:
            source_index[b, p + c - 1] = p - 1
    targets = np.full_like(input_ids, pad_token_id)
    targets[:, :-1] = input_ids[:, 1:]
    return {
        "input_ids": input_ids,
        "targets": targets,
        "attention_mask": (branch_ids > 0).astype(np.int32),
        "positions": positions,
        "branch_ids": branch_ids,
        "source_index": source_index,
        "chosen_mask": chosen_mask,
        "rejected_mask": rejected_mask,
    }


def collate_reward(
    examples: Sequence[Example], seq_len: int, pad_token_id: int
) -> dict[str, np.ndarray]:
    """Reward batch: `[2B, seq_len]` `input_ids`, `attention_mask`, `positions` (chosen rows then
    rejected rows) and `margin` `[B]` float32 (zeros when the data has none).

    The score of a row is read at its last real token, index `attention_mask.sum(-1) - 1`.
    """
    ids = [ex["chosen_input_ids"] for ex in examples] + [
        ex["rejected_input_ids"] for ex in examples
    ]
    batch = _rows_to_batch(ids, [[0] * len(x) for x in ids], seq_len, pad_token_id)
    del batch["targets"], batch["loss_mask"]  # a reward model scores sequences, it has no targets
    batch["margin"] = np.asarray(
        [float(ex.get("margin", 0.0)) for ex in examples], dtype=np.float32
    )
    return batch


def trl_padded_lengths(
    positions_KBT: Any,
    real_KBT: Any,
    per_device: int,
    multiple_of: int | None = None,
    padding_free: bool = False,
) -> Any:
    """Per example `[B]`: the length TRL's collator pads the per-device batch holding it to.

    `positions_KBT` / `real_KBT` hold the `K` rows TRL makes of each of the `B` examples (1 for
    SFT, 2 for a DPO/reward pair: chosen then rejected) as position ids and a 0/1 mask of the
    real tokens of real examples. Device `d` holds examples `[d*per_device, (d+1)*per_device)`
    (the batch axis is split in contiguous blocks). TRL pads each device's rows to their longest
    (the largest position + 1, also for prefix-shared rows whose branches restart after the
    prompt) or, padding-free (best-fit packed SFT rows), flattens them into one row of all their
    tokens; either rounded up to `multiple_of`. Works on numpy and jax arrays."""
    k, b, t = positions_KBT.shape
    group = per_device if b % per_device == 0 else b
    shape = (k, b // group, group, t)
    if padding_free:
        n_G = real_KBT.reshape(shape).sum(axis=(0, 2, 3))
    else:
        n_G = (positions_KBT * real_KBT).reshape(shape).max(axis=(0, 2, 3)) + 1
    m = multiple_of or 1
    return ((n_G + m - 1) // m * m).repeat(group)


def _trl_rows(batch: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """`(input_ids, attention_mask, positions)` of any trainer's collated batch as `[K, B, T]`:
    the `K` rows TRL makes of each example (pairs `[B, 2, T]`: chosen rows, then rejected)."""
    ids, attn, pos = (batch[k] for k in ("input_ids", "attention_mask", "positions"))
    if ids.ndim == 3:
        return tuple(x.transpose(1, 0, 2) for x in (ids, attn, pos))
    return ids[None], attn[None], pos[None]


def trl_example_widths(
    batch: Mapping[str, Any], example_mask_B: Any, per_device: int, multiple_of: int | None
) -> Any:
    """Per example `[B]`: the width TRL's collator pads its device's rows to (their longest,
    rounded up to `multiple_of`; `trl_padded_lengths`), from a collated batch of one row per
    document (not best-fit packed). Rows of weight-0 `example_mask_B` do not count. Works on
    numpy and jax arrays."""
    _, attn, pos = _trl_rows(batch)
    real = (attn > 0) & (example_mask_B > 0)[None, :, None]
    return trl_padded_lengths(pos, real.astype(pos.dtype), per_device, multiple_of)


def trl_input_tokens(
    batch: Mapping[str, np.ndarray],
    example_mask: np.ndarray,
    *,
    mode: str,
    pad_token_id: int,
    per_device: int,
    multiple_of: int | None = None,
) -> int:
    """HF's `num_input_tokens_seen` increment for one collated micro-batch of any trainer's
    layout, counted on the batch as TRL would collate it (per device: dynamic padding, or one
    flattened row when padding-free): `mode="all"` counts every position of TRL's `input_ids`,
    `"non_padding"` its attention mask (padding-free batches have none: then the tokens that are
    not the pad id, as HF counts them). Rows of weight-0 `example_mask` (the fill of a partial
    batch) are left out; prefix-shared DPO rows count as TRL's two rows per pair."""
    real_B = np.asarray(example_mask) > 0
    ids, attn, pos = (np.asarray(x) for x in _trl_rows(batch))
    shared = "branch_ids" in batch  # one row per pair holding the prompt once
    rows_per_example = 2 if shared else ids.shape[0]
    real = (attn > 0) & real_B[None, :, None]
    padding_free = "segment_ids" in batch
    lengths_B = trl_padded_lengths(
        pos, real.astype(np.int64), per_device, multiple_of, padding_free
    )
    if mode == "all":
        if padding_free:  # one flattened row per device, its length shared by its examples
            group = per_device if len(real_B) % per_device == 0 else len(real_B)
            return int(lengths_B[::group].sum())
        return int(rows_per_example * (lengths_B * real_B).sum())
    if padding_free:
        return int((real & (ids != pad_token_id)).sum())
    prompt_again = (np.asarray(batch["branch_ids"]) == 1) & real[0] if shared else 0
    return int(real.sum() + np.sum(prompt_again))
