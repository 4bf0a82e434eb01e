"""algos.sft: the SFT loss of a tiny model against numpy cross-entropy over the completion tokens
(NLL, DFT, HF's label smoothing), its metrics, token counts and loss units, without a trainer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import SFTConfig
from jaxrl.algos import sft
from jaxrl.data.collate import collate_padding_free, collate_sft

from .tiny import PAD, apply_model, greedy, lm, log_softmax, np_logits

T = 16


@functools.cache
def _examples() -> list[dict]:
    """prompt + completion rows, `loss_mask` marking the completion (the trained input tokens);
    the first completion is the model's greedy one (argmax hits: a random one has none)."""
    return [
        {"input_ids": [3, 4, 5, *greedy(*lm(), [3, 4, 5], 4)], "loss_mask": [0, 0, 0, 1, 1, 1, 1]},
        {"input_ids": [10, 11, 12, 13, 14], "loss_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [15, 16, 17, 18, 19, 20, 21, 22, 23], "loss_mask": [0, 1, 1, 1, 1, 0, 0, 1, 1]},
    ]  # fmt: skip


EXAMPLE_MASK = np.array([1.0, 1.0, 0.0], np.float32)  # the third fills a partial batch


def _batch() -> dict:
    batch = collate_sft(_examples(), T, PAD)
    batch["example_mask"] = EXAMPLE_MASK
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _reference(graphdef, params, examples=None, example_mask=EXAMPLE_MASK) -> dict:
    """Per trained token of the real examples, by hand: token t is predicted at position t - 1."""
    examples = examples or _examples()
    ids = np.full((len(examples), T), PAD)
    for b, ex in enumerate(examples):
        ids[b, : len(ex["input_ids"])] = ex["input_ids"]
    logits = np_logits(graphdef, params, ids)
    logp = log_softmax(logits)
    out = {"logp": [], "correct": [], "entropy": [], "uniform_nll": [], "real_tokens": 0}
    for b, ex in enumerate(examples):
        if not example_mask[b]:
            continue
        out["real_tokens"] += len(ex["input_ids"])
        for t in range(1, len(ex["input_ids"])):
            if ex["loss_mask"][t]:
                row, target = logp[b, t - 1], ex["input_ids"][t]
                out["logp"].append(row[target])
                out["correct"].append(float(np.argmax(logits[b, t - 1]) == target))
                out["entropy"].append(-np.sum(np.exp(row) * row))
                out["uniform_nll"].append(-np.mean(row))
    return {k: np.asarray(v) for k, v in out.items()}


def _config(tmp_path, **fields) -> SFTConfig:
    return SFTConfig(output_dir=str(tmp_path), logprob_chunk_size=4, **fields)


@pytest.mark.parametrize("score_span", [None, 8])
def test_loss_is_numpy_cross_entropy_over_completion_tokens(tmp_path, score_span):
    """NLL summed over the completion tokens of the real examples, per-token counts, TRL's
    `mean_token_accuracy` and `entropy` sums and `num_tokens`; the LM head on an 8-position
    span from each row's first completion target gives the same numbers."""
    graphdef, params = lm()
    loss_fn = sft.make_loss(_config(tmp_path), apply_model(graphdef), score_span=score_span)
    loss_sum, (aux, extras) = jax.jit(loss_fn)(params, None, _batch(), None, {"kept": 1.0})
    ref = _reference(graphdef, params)
    n = len(ref["logp"])
    assert n == 4 + 3  # the fill row's tokens are not counted
    assert ref["correct"].sum() >= 1  # the greedy completion's argmax hits
    np.testing.assert_allclose(loss_sum, -ref["logp"].sum(), rtol=1e-5)
    np.testing.assert_allclose(aux["sum"]["loss"], loss_sum)
    assert {k: float(v) for k, v in aux["count"].items()} == dict.fromkeys(
        ("loss", "mean_token_accuracy", "entropy"), n
    )
    np.testing.assert_allclose(aux["sum"]["mean_token_accuracy"], ref["correct"].sum())
    np.testing.assert_allclose(aux["sum"]["entropy"], ref["entropy"].sum(), rtol=1e-5)
    assert float(aux["total"]["num_tokens"]) == ref["real_tokens"] == 7 + 5
    assert float(extras["kept"]) == 1.0  # the step's extras pass through


def test_dft_weighs_each_token_by_its_probability(tmp_path):
    """DFT (TRL `loss_type="dft"`): `-log p * stop_gradient(p)` per completion token."""
    graphdef, params = lm()
    loss_fn = sft.make_loss(_config(tmp_path, loss_type="dft"), apply_model(graphdef))
    loss_sum, _ = jax.jit(loss_fn)(params, None, _batch(), None, {})
    logp = _reference(graphdef, params)["logp"]
    np.testing.assert_allclose(loss_sum, np.sum(-logp * np.exp(logp)), rtol=1e-5)


def test_label_smoothing_is_hf_label_smoother_values_and_gradients(tmp_path):
    """`label_smoothing_factor` eps: HF's LabelSmoother, `(1 - eps) NLL + eps * mean_v(-log p_v)`
    per token; its gradients are those of that formula on full logits (the uniform term is
    differentiated, not a constant)."""
    eps = 0.1
    graphdef, params = lm()
    loss_fn = sft.make_loss(_config(tmp_path, label_smoothing_factor=eps), apply_model(graphdef))
    mb = _batch()
    loss_sum, _ = jax.jit(loss_fn)(params, None, mb, None, {})
    ref = _reference(graphdef, params)
    want = (1 - eps) * -ref["logp"].sum() + eps * ref["uniform_nll"].sum()
    np.testing.assert_allclose(loss_sum, want, rtol=1e-5)

    def full_logits_loss(params):
        logp_BTV = jax.nn.log_softmax(nnx.merge(graphdef, params)(mb["input_ids"]), axis=-1)
        mask_BT = mb["loss_mask"] * mb["example_mask"][:, None]
        nll_BT = -jnp.take_along_axis(logp_BTV, mb["targets"][..., None], axis=-1)[..., 0]
        uniform_BT = -jnp.mean(logp_BTV, axis=-1)
        return jnp.sum(((1 - eps) * nll_BT + eps * uniform_BT) * mask_BT)

    got = jax.jit(jax.grad(lambda p: loss_fn(p, None, mb, None, {})[0]))(params)
    want_grads = jax.jit(jax.grad(full_logits_loss))(params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_padding_free_rows_score_each_example_alone_and_count_trl_widths(tmp_path):
    """Padding-free rows (examples back to back, one row per device): each example's tokens are
    scored as in its own row (segments never attend to each other, positions restart) and
    `num_tokens` is each row's real tokens rounded up to `pad_to_multiple_of` (TRL's width)."""
    graphdef, params = lm()
    examples = [
        {"input_ids": ex["input_ids"][:6], "loss_mask": ex["loss_mask"][:6]} for ex in _examples()
    ]
    rows = collate_padding_free(examples, per_device=2, rows=2, seq_len=T, pad_token_id=PAD)
    mb = {k: jnp.asarray(v) for k, v in rows.items()}
    config = _config(tmp_path, pad_to_multiple_of=8)
    loss_fn = sft.make_loss(config, apply_model(graphdef), padding_free=True)
    loss_sum, (aux, _) = jax.jit(loss_fn)(params, None, mb, None, {})
    ref = _reference(graphdef, params, examples, np.ones(3, np.float32))
    np.testing.assert_allclose(loss_sum, -ref["logp"].sum(), rtol=1e-5)
    assert float(aux["count"]["loss"]) == len(ref["logp"])
    assert float(aux["total"]["num_tokens"]) == 16 + 8  # rows of 11 and 6 real tokens


def test_loss_units_are_trained_tokens_of_real_examples():
    batch = _batch()
    batch_A = {k: jnp.stack([v, v]) for k, v in batch.items()}  # two micro-batches
    assert float(sft.loss_units(batch_A)) == 2 * (4 + 3)
