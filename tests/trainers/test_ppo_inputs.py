"""`jaxrl.trainers.ppo_inputs`: TRL v0.7.2's PPO batches on the host (padding, the response mask
of `batched_forward_pass`, `step()`'s input checks, the prompt dataloader)."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from jaxrl.trainers import ppo_inputs

QUERIES = [np.array([1, 2]), np.array([5])]
RESPONSES = [np.array([3, 4]), np.array([6, 7, 8])]


@pytest.mark.parametrize("side", ["right", "left"])
def test_model_inputs_pad_to_multiple_on_the_padding_side(side):
    out = ppo_inputs.model_inputs(QUERIES, RESPONSES, 0, side, pad_to_multiple_of=8)
    assert out["input_ids"].shape == (2, 8) and out["input_ids"].dtype == np.int32
    real = slice(0, 4) if side == "right" else slice(4, 8)
    np.testing.assert_array_equal(out["input_ids"][:, real], [[1, 2, 3, 4], [5, 6, 7, 8]])
    np.testing.assert_array_equal(out["attention_mask"].sum(1), [4, 4])
    assert not out["input_ids"][:, 4:8 if side == "right" else 0:4].any()


@pytest.mark.parametrize("side", ["right", "left"])
def test_response_mask_marks_positions_predicting_response_tokens(side):
    attn = ppo_inputs.model_inputs(QUERIES, RESPONSES, 0, side, 8)["attention_mask"]
    masks = ppo_inputs.response_mask(QUERIES, RESPONSES, attn, [[1, 0], [0, 1, 1]])
    want = np.zeros((2, 7), np.float32)
    shift = 0 if side == "right" else 4
    want[0, shift + 1] = 1  # row 0: response tokens at 2, 3; the second one masked out
    want[1, shift + 1 : shift + 3] = 1  # row 1: response tokens at 1, 2, 3; the first masked
    np.testing.assert_array_equal(masks, want)


def test_check_step_inputs_as_trl():
    q, r, s, m = ppo_inputs.check_step_inputs(2, QUERIES, RESPONSES, [1.0, np.array([2.0])])
    np.testing.assert_array_equal(s, np.array([1.0, 2.0], np.float32))
    assert m is None and all(x.dtype == np.int64 for x in q + r)
    with pytest.raises(ValueError, match="Batch size"):
        ppo_inputs.check_step_inputs(3, QUERIES, RESPONSES, [1.0, 2.0])
    with pytest.raises(ValueError, match="response mask"):
        ppo_inputs.check_step_inputs(2, QUERIES, RESPONSES, [1.0, 2.0], [[1], [1, 1, 1]])


def test_epoch_loader_yields_full_shuffled_batches_each_epoch():
    rows = datasets.Dataset.from_dict({"query": [str(i) for i in range(10)]})
    loader = ppo_inputs.EpochLoader(ppo_inputs.prompt_batches(rows, batch_size=4, seed=0))
    assert len(loader) == 2  # the last partial batch is dropped
    epochs = [[b["query"] for b in loader] for _ in range(2)]
    assert all(len(b) == 4 for e in epochs for b in e)
    assert epochs[0] != epochs[1]  # a new order each epoch
