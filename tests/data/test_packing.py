"""Packing: same bins as TRL's BFD, rows within bounds, positions restart, documents isolated
(best fit); wrapped rows are cuts of the token stream (see test_wrapped_packing_trl.py)."""

import numpy as np
import pytest
from datasets import Dataset
from trl.data_utils import pack_dataset

from jaxrl.data import collate_sft, pack_bfd, pack_wrapped


def random_docs(n=120, max_len=20, seed=0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(4, 50, size=rng.integers(0, max_len)).tolist() for _ in range(n)]
    return {"input_ids": docs, "loss_mask": [[1] * len(d) for d in docs]}


@pytest.mark.parametrize(("strategy", "overflow"), [("bfd", "truncate"), ("bfd_split", "split")])
def test_bfd_matches_trl_rows(strategy, overflow):
    docs = random_docs()
    ours = pack_bfd(docs, 16, on_seq_length_overflow=overflow)
    theirs = pack_dataset(Dataset.from_dict(docs), 16, strategy)
    assert ours["input_ids"] == theirs["input_ids"]
    assert [np.bincount(s)[1:].tolist() for s in ours["segment_ids"]] == theirs["seq_lengths"]


def test_rows_bounded_and_positions_restart_per_document():
    docs = random_docs(max_len=40)
    for packed in (pack_bfd(docs, 16), pack_bfd(docs, 16, on_seq_length_overflow="split")):
        for ids, seg, pos in zip(
            packed["input_ids"], packed["segment_ids"], packed["positions"], strict=True
        ):
            assert 0 < len(ids) <= 16 and len(seg) == len(pos) == len(ids)
            seg, pos = np.asarray(seg), np.asarray(pos)
            assert seg[0] == 1 and np.all(np.diff(seg) >= 0) and np.all(np.diff(seg) <= 1)
            starts = np.r_[True, seg[1:] != seg[:-1]]
            assert np.all(pos[starts] == 0)
            assert np.all(pos[~starts] == pos[np.flatnonzero(~starts) - 1] + 1)


def test_split_keeps_all_tokens_truncate_drops_overflow():
    docs = {"input_ids": [list(range(10)), [7, 7]]}
    split = pack_bfd(docs, 4, on_seq_length_overflow="split")
    assert sorted(sum(split["input_ids"], [])) == sorted(list(range(10)) + [7, 7])
    assert pack_bfd(docs, 4)["input_ids"] == [[0, 1, 2, 3], [7, 7]]


def test_wrapped_hand_computed():
    # As TRL's wrapped packing: only the cut stream, no segment ids or positions (one causal
    # sequence per row).
    out = pack_wrapped({"input_ids": [[1, 2, 3], [4, 5], [6]]}, 4)
    assert out.to_dict() == {"input_ids": [[1, 2, 3, 4], [5, 6]]}


def test_wrapped_matches_trl_rows():
    docs = random_docs(max_len=40)
    ours = pack_wrapped(docs, 16)
    theirs = pack_dataset(Dataset.from_dict(docs), 16, "wrapped")
    assert ours.column_names == theirs.column_names == ["input_ids", "loss_mask"]
    assert ours["input_ids"] == theirs["input_ids"]
    assert ours["loss_mask"] == theirs["loss_mask"]
    assert all(len(row) == 16 for row in ours["input_ids"][:-1])


def _toy_attention(x_TD, positions_T, segment_ids_T):
    """One causal self-attention layer with learned-free positional encoding, masked to the same
    segment: the contract a model must follow with the collated `segment_ids`/`positions`."""
    pe_TD = np.sin(positions_T[:, None] * (1.0 + np.arange(x_TD.shape[1]))[None] * 0.1)
    h_TD = x_TD + pe_TD
    scores_TT = h_TD @ h_TD.T
    causal = np.tril(np.ones_like(scores_TT, dtype=bool))
    same = segment_ids_T[:, None] == segment_ids_T[None, :]
    scores_TT = np.where(causal & same, scores_TT, -1e30)
    w_TT = np.exp(scores_TT - scores_TT.max(-1, keepdims=True))
    return (w_TT / w_TT.sum(-1, keepdims=True)) @ h_TD


def test_packed_batch_gives_each_document_its_unpacked_output():
    docs = {"input_ids": [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14]]}
    packed = pack_bfd(docs, 8)
    batch = collate_sft(list(packed), seq_len=8, pad_token_id=0)
    emb = np.random.default_rng(0).normal(size=(20, 4))
    for b in range(batch["input_ids"].shape[0]):
        seg = batch["segment_ids"][b]
        out = _toy_attention(emb[batch["input_ids"][b]], batch["positions"][b], seg)
        for s in range(1, seg.max() + 1):
            sel = seg == s
            alone = _toy_attention(
                emb[batch["input_ids"][b][sel]], np.arange(sel.sum()), np.ones(sel.sum())
            )
            np.testing.assert_allclose(out[sel], alone, rtol=1e-12)
        # the last token of a document never predicts the first of the next one
        boundary = np.flatnonzero(seg[1:] != seg[:-1])
        assert np.all(batch["loss_mask"][b][boundary] == 0)
