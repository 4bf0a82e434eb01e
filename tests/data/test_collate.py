"""Collators: fixed shapes, right padding, target/loss-mask alignment, chosen-then-rejected rows."""

import numpy as np
import pytest

from jaxrl.data import choose_seq_len, collate_preference, collate_reward, collate_sft


def test_collate_sft_alignment_hand_computed():
    examples = [
        {"input_ids": [7, 8, 9, 1], "loss_mask": [0, 0, 1, 1]},
        {"input_ids": [5, 1]},
    ]
    b = collate_sft(examples, seq_len=6, pad_token_id=0)
    assert {k: v.shape for k, v in b.items()} == {k: (2, 6) for k in b}
    np.testing.assert_array_equal(b["input_ids"], [[7, 8, 9, 1, 0, 0], [5, 1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(b["targets"], [[8, 9, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    # loss_mask[t] = token t+1 is trained: predicts 9 and <eos> in row 0, <eos> in row 1
    np.testing.assert_array_equal(b["loss_mask"], [[0, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(b["attention_mask"], [[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(b["segment_ids"], b["attention_mask"])
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 3, 0, 0], [0, 1, 0, 0, 0, 0]])
    assert b["input_ids"].dtype == np.int32 and b["loss_mask"].dtype == np.float32


def test_collate_sft_packed_masks_document_boundaries():
    ex = {
        "input_ids": [3, 4, 5, 6],
        "loss_mask": [1, 1, 1, 1],
        "positions": [0, 1, 0, 1],
        "segment_ids": [1, 1, 2, 2],
    }
    b = collate_sft([ex], seq_len=5, pad_token_id=0)
    np.testing.assert_array_equal(b["loss_mask"], [[1, 0, 1, 0, 0]])
    np.testing.assert_array_equal(b["positions"], [[0, 1, 0, 1, 0]])
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 2, 2, 0]])


def test_collate_sft_too_long_is_a_clear_error():
    with pytest.raises(ValueError, match="max_length <= 2"):
        collate_sft([{"input_ids": [1, 2, 3]}], seq_len=2, pad_token_id=0)


def test_collate_preference_rows_and_completion_mask():
    examples = [
        {"prompt_input_ids": [7, 8], "chosen_input_ids": [3, 1], "rejected_input_ids": [4, 4, 1]},
        {"prompt_input_ids": [9], "chosen_input_ids": [5, 1], "rejected_input_ids": [6, 1]},
    ]
    b = collate_preference(examples, seq_len=6, pad_token_id=0)
    np.testing.assert_array_equal(
        b["input_ids"],
        [[7, 8, 3, 1, 0, 0], [9, 5, 1, 0, 0, 0], [7, 8, 4, 4, 1, 0], [9, 6, 1, 0, 0, 0]],
    )
    np.testing.assert_array_equal(
        b["loss_mask"],
        [[0, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]],
    )
    # summing the mask gives each completion's token count (DPO `chosen_lengths`)
    np.testing.assert_array_equal(b["loss_mask"].sum(-1), [2, 2, 3, 2])


def test_collate_reward_rows_and_margin():
    examples = [
        {"chosen_input_ids": [3, 1], "rejected_input_ids": [4, 4, 1], "margin": 2.0},
        {"chosen_input_ids": [5, 1], "rejected_input_ids": [6, 1], "margin": 0.5},
    ]
    b = collate_reward(examples, seq_len=4, pad_token_id=0)
    np.testing.assert_array_equal(
        b["input_ids"], [[3, 1, 0, 0], [5, 1, 0, 0], [4, 4, 1, 0], [6, 1, 0, 0]]
    )
    np.testing.assert_array_equal(b["attention_mask"].sum(-1) - 1, [1, 1, 2, 1])
    np.testing.assert_array_equal(b["margin"], [2.0, 0.5])
    no_margin = collate_reward([{k: v for k, v in examples[0].items() if k != "margin"}], 4, 0)
    np.testing.assert_array_equal(no_margin["margin"], [0.0])


def test_choose_seq_len():
    assert choose_seq_len([3, 17, 9], max_length=1024) == 24
    assert choose_seq_len([3, 17, 9], max_length=20) == 20
    assert choose_seq_len([16], max_length=None, multiple_of=16) == 16
    with pytest.raises(ValueError, match="empty"):
        choose_seq_len([], max_length=8)
