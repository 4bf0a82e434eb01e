"""Collators: fixed shapes, right padding, target/loss-mask alignment, chosen-then-rejected rows."""

import numpy as np
import pytest

from jaxrl.algos.masks import model_masks, prefix_tree_mask
from jaxrl.data import (
    choose_seq_len,
    collate_preference,
    collate_preference_shared,
    collate_reward,
    collate_sft,
)


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
    # One document per row: no segment ids, so the model runs without a mask (`model_masks`).
    assert "segment_ids" not in b and model_masks(b) == (None, None)
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
    mask, seg = model_masks(b)
    assert mask is b["attention_mask"] and seg is b["segment_ids"]


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


def test_collate_preference_shared_layout_hand_computed():
    ex = {"prompt_input_ids": [5, 6], "chosen_input_ids": [7, 1], "rejected_input_ids": [8, 9, 1]}
    b = collate_preference_shared([ex], seq_len=8, pad_token_id=0)
    np.testing.assert_array_equal(b["input_ids"], [[5, 6, 7, 1, 8, 9, 1, 0]])
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 3, 2, 3, 4, 0]])
    np.testing.assert_array_equal(b["branch_ids"], [[1, 1, 2, 2, 3, 3, 3, 0]])
    np.testing.assert_array_equal(b["attention_mask"], [[1, 1, 1, 1, 1, 1, 1, 0]])
    # Slot t scores targets[t] from the hidden state at source_index[t]: the chosen tokens 7, 1
    # from slots 1, 2; the first rejected token 8 from the last prompt token (slot 3 <- 1).
    np.testing.assert_array_equal(b["targets"], [[6, 7, 1, 8, 9, 1, 0, 0]])
    np.testing.assert_array_equal(b["source_index"], [[0, 1, 2, 1, 4, 5, 6, 7]])
    np.testing.assert_array_equal(b["chosen_mask"], [[0, 1, 1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(b["rejected_mask"], [[0, 0, 0, 1, 1, 1, 0, 0]])
    visible = prefix_tree_mask(b["branch_ids"])[0]
    assert visible[5, :2].all() and visible[5, 4:6].all()  # rejected sees prompt + itself
    assert not visible[5, 2:4].any() and not visible[3, 4:].any()  # never the other branch
    assert not visible[:, 7].any()  # nor padding

    # Same scored tokens as the two-row layout, and no prompt: first tokens are not scored.
    rows = collate_preference([ex], seq_len=8, pad_token_id=0)
    assert rows["loss_mask"][0].sum() == b["chosen_mask"].sum()
    assert rows["loss_mask"][1].sum() == b["rejected_mask"].sum()
    no_prompt = collate_preference_shared([{**ex, "prompt_input_ids": []}], 8, 0)
    np.testing.assert_array_equal(no_prompt["chosen_mask"], [[1, 0, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(no_prompt["rejected_mask"], [[0, 0, 1, 1, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match="prompt 2 \\+ chosen 2 \\+ rejected 3"):
        collate_preference_shared([ex], seq_len=6, pad_token_id=0)
