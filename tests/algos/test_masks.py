"""algos.masks: which masks a collated batch calls the model with, the prefix-tree visibility of
prefix-shared DPO rows, and token counts over the real examples of a partial batch."""

import jax.numpy as jnp
import numpy as np

from jaxrl.algos.masks import model_masks, prefix_tree_mask, weighted_token_count
from jaxrl.data.collate import collate_sft


def test_model_masks_unmasked_for_one_document_per_row_masked_for_packed_rows():
    rows = collate_sft([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}], seq_len=4, pad_token_id=0)
    assert model_masks(rows) == (None, None)
    packed = collate_sft(
        [{"input_ids": [5, 6, 7], "positions": [0, 1, 0], "segment_ids": [1, 1, 2]}],
        seq_len=4,
        pad_token_id=0,
    )
    attention_mask, segment_ids = model_masks({k: jnp.asarray(v) for k, v in packed.items()})
    np.testing.assert_array_equal(attention_mask, [[1, 1, 1, 0]])
    np.testing.assert_array_equal(segment_ids, [[1, 1, 2, 0]])


def test_prefix_tree_mask_hand_computed():
    # prompt (1) 2 tokens, chosen (2) 2, rejected (3) 1, one pad slot
    branch_BT = np.array([[1, 1, 2, 2, 3, 0]])
    p, c, r = (1, 1, 0, 0, 0, 0), (1, 1, 1, 1, 0, 0), (1, 1, 0, 0, 1, 0)
    # A padding query sees the prompt (no branch of its own); its hidden state is never scored.
    want = np.array([[p, p, c, c, r, p]], bool)
    np.testing.assert_array_equal(prefix_tree_mask(branch_BT), want)
    np.testing.assert_array_equal(prefix_tree_mask(jnp.asarray(branch_BT)), want)  # traced too


def test_weighted_token_count_counts_real_examples_only():
    mask_BT = jnp.array([[1, 1, 0], [1, 0, 0], [1, 1, 1]], jnp.float32)
    assert float(weighted_token_count(mask_BT, {})) == 6.0
    mb = {"example_mask": jnp.array([1.0, 1.0, 0.0])}  # the last row fills a partial batch
    assert float(weighted_token_count(mask_BT, mb)) == 3.0
    pairs_B2T = jnp.stack([mask_BT, 2 * mask_BT], axis=1)  # [B, 2, T]: both rows of a pair
    assert float(weighted_token_count(pairs_B2T, mb)) == 9.0
    assert float(weighted_token_count(jnp.array([True, True, True]), mb)) == 2.0  # [B]
