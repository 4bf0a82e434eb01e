"""Packing tokenized documents into rows of at most `seq_length` tokens.

Best-fit-decreasing rows (`pack_bfd`, TRL's `"bfd"` / `"bfd_split"`) carry `segment_ids` (1..n
for the documents in the row, 0 is reserved for padding added later by the collator) and
`positions` that restart at 0 for every document, so attention stays within a document and no
document predicts the next one's first token (TRL's padding-free packing with FlashAttention).
Wrapped rows (`pack_wrapped`, TRL's `"wrapped"`) are cuts of one concatenated token stream and,
as in TRL, each row is one ordinary causal sequence: they carry neither column, and the collator
gives them positions 0..L-1 and a single segment. Rows are left unpadded here;
`collate.collate_sft` pads them to the run's static length.
"""

import bisect
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from typing import Literal

import datasets

Columns = Mapping[str, Sequence[Sequence[int]]]


def _as_columns(data: datasets.Dataset | Columns, columns: Sequence[str] | None) -> dict:
    names = (
        list(columns)
        if columns is not None
        else list(data.column_names if isinstance(data, datasets.Dataset) else data.keys())
    )
    if not names:
        raise ValueError("Packing needs at least one per-token column such as 'input_ids'.")
    out = {name: list(data[name]) for name in names}
    lengths = [len(x) for x in out[names[0]]]
    for name in names[1:]:
        if [len(x) for x in out[name]] != lengths:
            raise ValueError(
                f"Packing needs per-token columns of equal lengths; '{name}' differs from '{names[0]}'."
            )
    return out


def _rows_from_bins(cols: dict, bins: list[list[tuple[int, int, int]]]) -> datasets.Dataset:
    """Build packed rows; each bin holds (doc index, start, stop) fragments in order."""
    out: dict[str, list] = {name: [] for name in cols}
    out["positions"] = []
    out["segment_ids"] = []
    for fragments in bins:
        for name, values in cols.items():
            out[name].append([t for i, a, b in fragments for t in values[i][a:b]])
        out["positions"].append([p for _, a, b in fragments for p in range(b - a)])
        out["segment_ids"].append(
            [k for k, (_, a, b) in enumerate(fragments, start=1) for _ in range(b - a)]
        )
    return datasets.Dataset.from_dict(out)


def pack_bfd(
    data: datasets.Dataset | Columns,
    seq_length: int,
    *,
    columns: Sequence[str] | None = None,
    on_seq_length_overflow: Literal["truncate", "split"] = "truncate",
) -> datasets.Dataset:
    """Best-fit-decreasing packing (TRL `packing_strategy="bfd"` / `"bfd_split"`).

    Documents are sorted by length (longest first, ties in input order) and each goes into the open
    row with the least free space that still fits it (first-opened among equals), else a new row.
    Documents longer than `seq_length` are, as in TRL, truncated to their first `seq_length` tokens
    (`"truncate"`, TRL's `"bfd"`) or cut into `seq_length`-token pieces that are packed as separate
    documents (`"split"`, TRL's `"bfd_split"`). Empty documents are dropped.

    Returns a dataset with the packed `columns` (default: all) plus `positions` and `segment_ids`.
    """
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}.")
    if on_seq_length_overflow not in ("truncate", "split"):
        raise ValueError(
            f"on_seq_length_overflow must be 'truncate' or 'split', got {on_seq_length_overflow!r}."
        )
    cols = _as_columns(data, columns)
    first = next(iter(cols.values()))
    docs: list[tuple[int, int, int]] = []  # (doc index, start, stop)
    for i, values in enumerate(first):
        n = len(values)
        if on_seq_length_overflow == "truncate":
            if n:
                docs.append((i, 0, min(n, seq_length)))
        else:
            docs.extend((i, a, min(a + seq_length, n)) for a in range(0, n, seq_length))
    order = sorted(range(len(docs)), key=lambda j: -(docs[j][2] - docs[j][1]))  # stable

    bins: list[list[tuple[int, int, int]]] = []
    space_to_bins: dict[int, deque[int]] = defaultdict(deque)
    open_spaces: list[int] = []  # sorted free-space values that have at least one row
    for j in order:
        doc = docs[j]
        length = doc[2] - doc[1]
        k = bisect.bisect_left(open_spaces, length)
        if k < len(open_spaces):
            space = open_spaces[k]
            b = space_to_bins[space].popleft()
            if not space_to_bins[space]:
                open_spaces.pop(k)
        else:
            space, b = seq_length, len(bins)
            bins.append([])
        bins[b].append(doc)
        left = space - length
        if left > 0:
            if not space_to_bins[left]:
                bisect.insort(open_spaces, left)
            space_to_bins[left].append(b)
    return _rows_from_bins(cols, bins)


def pack_wrapped(
    data: datasets.Dataset | Columns,
    seq_length: int,
    *,
    columns: Sequence[str] | None = None,
) -> datasets.Dataset:
    """Concatenate all documents in order and cut the stream every `seq_length` tokens.

    TRL's `packing_strategy="wrapped"` (classic constant-length packing): no token is dropped,
    documents may be split across rows and only the last row may be shorter than `seq_length`.
    As in TRL, a row is one ordinary causal sequence: the returned dataset holds only the packed
    `columns` (default: all), with no `segment_ids` or `positions`, so `collate.collate_sft`
    gives each row positions 0..L-1 and one segment. Attention therefore crosses the document
    boundaries inside a row, and the first token of a document is a trained target (when its
    mask says so), predicted from the end of the document before it. The first token of a row,
    including the continuation of a document cut at the previous row's end, has nothing before
    it in the row and is never a target.
    """
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}.")
    cols = _as_columns(data, columns)
    out = {}
    for name, values in cols.items():
        stream = [t for v in values for t in v]
        out[name] = [stream[a : a + seq_length] for a in range(0, len(stream), seq_length)]
    return datasets.Dataset.from_dict(out)
