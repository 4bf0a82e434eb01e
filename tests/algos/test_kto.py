"""algos.kto: the KTO losses, KL reference point and metrics of a tiny model against TRL 1.16's
formulas computed by hand in numpy (each row's completion log-probs from full logits), the
precomputed-reference path, the KL rows' lack of gradient, and the per-micro-batch metric
averaging TRL logs, without a trainer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import KTOConfig
from jaxrl.algos import kto
from jaxrl.core.step import reduce_aux
from jaxrl.data.kto import collate_unpaired

from .tiny import PAD, apply_model, lm, log_softmax, np_logits

T = 12
BETA = 0.3
# Four rows (the last one fills a partial batch): desirable, undesirable, desirable, fill.
EXAMPLES = [
    {"prompt_ids": [3, 4, 5], "completion_ids": [6, 7, 8], "label": True},
    {"prompt_ids": [10, 11], "completion_ids": [12, 13, 14, 1], "label": False},
    {"prompt_ids": [17, 18, 19, 20], "completion_ids": [21, 1], "label": True},
    {"prompt_ids": [9, 2], "completion_ids": [22, 23, 24], "label": False},
]
for i, ex in enumerate(EXAMPLES):  # TRL's KL rows: each block's completions rotated by one
    ex["KL_completion_ids"] = EXAMPLES[i - 1]["completion_ids"]
EXAMPLE_MASK = np.array([1.0, 1.0, 1.0, 0.0], np.float32)
REAL = EXAMPLE_MASK > 0


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _np_rows(params_seed: int, key: str) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Per row: summed completion log-prob, and per completion token the mean logit and the
    entropy, from the model's float64 full logits of the row `prompt + EXAMPLES[key]`."""
    graphdef, params = lm(params_seed)
    seqs = [ex["prompt_ids"] + ex[key] for ex in EXAMPLES]
    ids = np.full((len(seqs), T), PAD)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
    logits = np_logits(graphdef, params, ids)
    logps, mean_logits, entropies = [], [], []
    for b, ex in enumerate(EXAMPLES):
        p, c = len(ex["prompt_ids"]), len(ex[key])
        pos = np.arange(p - 1, p + c - 1)  # completion token j is predicted at p + j - 1
        lp = log_softmax(logits[b, pos])
        logps.append(lp[np.arange(c), ids[b, pos + 1]].sum())
        mean_logits.append(logits[b, pos].mean(-1))
        entropies.append(-(np.exp(lp) * lp).sum(-1))
    return np.asarray(logps), mean_logits, entropies


def _batch(with_kl: bool = True, precomputed: bool = False) -> dict:
    examples = [dict(ex) for ex in EXAMPLES]
    if precomputed:
        ref, _, _ = _np_rows(1, "completion_ids")
        ref_kl, _, _ = _np_rows(1, "KL_completion_ids")
        for ex, r, k in zip(examples, ref, ref_kl, strict=True):
            ex["ref_logps"], ex["ref_KL_logps"] = r, k
    batch = collate_unpaired(examples, T, PAD, max_length=None, with_kl=with_kl)
    batch["example_mask"] = EXAMPLE_MASK
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _ref_logps(state, mb):
    """The reference: the tiny LM of seed 1."""
    graphdef, params = lm(1)
    return kto.reference_logps(nnx.merge(graphdef, params), mb, 4, "KL_input_ids" in mb)


def _loss_fn(tmp_path, **fields):
    config = KTOConfig(output_dir=str(tmp_path), beta=BETA, logprob_chunk_size=4, **fields)
    return kto.make_loss(config, apply_model(lm()[0]), ref_logps=_ref_logps)


def _call(loss_fn, mb, params=None):
    """`loss_fn` on the policy's params (or `params`), jitted: `(loss_sum, aux)`."""
    fn = jax.jit(lambda p, mb: loss_fn(p, None, mb, jax.random.key(0), {}))
    loss_sum, (aux, _) = fn(lm()[1] if params is None else params, mb)
    return loss_sum, aux


def _run(loss_fn, mb):
    loss_sum, aux = _call(loss_fn, mb)
    return float(loss_sum), reduce_aux(jax.tree.map(lambda x: x[None], aux))


@functools.cache
def _np_reference() -> dict:
    pol, mean_logits, entropies = _np_rows(0, "completion_ids")
    ref, _, _ = _np_rows(1, "completion_ids")
    kl_pol, _, _ = _np_rows(0, "KL_completion_ids")
    kl_ref, _, _ = _np_rows(1, "KL_completion_ids")
    return {
        "pol": pol,
        "ref": ref,
        "kl": max(float(np.mean((kl_pol - kl_ref)[REAL])), 0.0),
        "mean_logits": mean_logits,
        "entropies": entropies,
    }


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.5, 0.4)])
def test_kto_losses_are_trls_formulas(loss_type, weights):
    rng = np.random.default_rng(0)
    logps, ref = rng.normal(-8, 2, size=(2, 6))
    label = np.array([1, 0, 1, 1, 0, 0], bool)
    kl, (dw, uw) = 0.37, weights
    losses, rewards = kto.kto_losses(
        jnp.asarray(logps), jnp.asarray(ref), jnp.asarray(label), kl, beta=BETA,
        loss_type=loss_type, desirable_weight=dw, undesirable_weight=uw,
    )  # fmt: skip
    r = logps - ref
    if loss_type == "kto":  # Eq. (7) of the KTO paper, TRL's kl as the reference point
        want = np.where(
            label, dw * (1 - _sigmoid(BETA * (r - kl))), uw * (1 - _sigmoid(BETA * (kl - r)))
        )
    else:  # APO-zero, unpaired: no reference point
        want = np.where(label, dw * (1 - _sigmoid(BETA * r)), uw * _sigmoid(BETA * r))
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    np.testing.assert_allclose(rewards, BETA * r, rtol=1e-5)


def test_kl_estimate_is_the_clamped_mean_over_real_rows():
    kl_logps = jnp.array([-3.0, -5.0, -1.0, 100.0])
    ref = jnp.array([-4.0, -4.5, -1.5, 0.0])
    w = jnp.asarray(EXAMPLE_MASK)
    assert float(kto.kl_estimate(kl_logps, ref, w)) == pytest.approx((1.0 - 0.5 + 0.5) / 3)
    assert float(kto.kl_estimate(ref, kl_logps, w)) == 0.0  # a negative mean is clamped at 0


@pytest.mark.parametrize("precomputed", [False, True])
def test_loss_and_metrics_match_numpy(tmp_path, precomputed):
    want = _np_reference()
    loss_fn = _loss_fn(tmp_path, precompute_ref_log_probs=precomputed)
    loss_sum, m = _run(loss_fn, _batch(precomputed=precomputed))
    label = np.array([ex["label"] for ex in EXAMPLES])
    r, kl = want["pol"] - want["ref"], want["kl"]
    assert kl > 0  # the reference point is exercised
    losses = np.where(label, 1 - _sigmoid(BETA * (r - kl)), 1 - _sigmoid(BETA * (kl - r)))
    assert loss_sum == pytest.approx(losses[REAL].sum(), rel=1e-5)
    assert float(m["loss"]) == pytest.approx(losses[REAL].mean(), rel=1e-5)
    assert float(m["kl"]) == pytest.approx(kl, rel=1e-4, abs=1e-6)
    chosen, rejected = REAL & label, REAL & ~label
    for side, rows in (("chosen", chosen), ("rejected", rejected)):
        assert float(m[f"rewards/{side}"]) == pytest.approx(BETA * r[rows].mean(), rel=1e-4)
        assert float(m[f"logps/{side}"]) == pytest.approx(want["pol"][rows].mean(), rel=1e-5)
        logits = np.concatenate([want["mean_logits"][b] for b in np.flatnonzero(rows)])
        assert float(m[f"logits/{side}"]) == pytest.approx(logits.mean(), rel=1e-4)
    margin = BETA * (r[chosen].mean() - r[rejected].mean())
    assert float(m["rewards/margins"]) == pytest.approx(margin, rel=1e-4)
    entropy = np.concatenate([want["entropies"][b] for b in np.flatnonzero(REAL)])
    assert float(m["entropy"]) == pytest.approx(entropy.mean(), rel=1e-4)
    real_tokens = sum(len(ex["prompt_ids"]) + len(ex["completion_ids"]) for ex in EXAMPLES[:3])
    assert float(m["num_tokens"]) == real_tokens


def test_apo_zero_unpaired_runs_without_kl_rows(tmp_path):
    want = _np_reference()
    loss_fn = _loss_fn(tmp_path, loss_type="apo_zero_unpaired")
    loss_sum, m = _run(loss_fn, _batch(with_kl=False))
    label = np.array([ex["label"] for ex in EXAMPLES])
    r = want["pol"] - want["ref"]
    losses = np.where(label, 1 - _sigmoid(BETA * r), _sigmoid(BETA * r))
    assert loss_sum == pytest.approx(losses[REAL].sum(), rel=1e-5)
    assert float(m["kl"]) == 0.0


def test_kl_rows_carry_no_gradient(tmp_path):
    """The gradient is that of the row losses with the reference point a constant: TRL runs the
    KL forward without gradient and detaches the estimate."""
    mb = _batch()
    graphdef, params = lm()
    loss_fn = _loss_fn(tmp_path)
    grads = jax.jit(jax.grad(lambda p: loss_fn(p, None, mb, jax.random.key(0), {})[0]))(params)
    ref_B, _ = _ref_logps(None, mb)
    kl = _np_reference()["kl"]

    def constant_kl_loss(p):
        logps_B = kto.completion_logps(nnx.merge(graphdef, p), kto.rows(mb), 4)
        losses_B, _ = kto.kto_losses(logps_B, ref_B, mb["label"], kl, beta=BETA)
        return jnp.sum(losses_B * mb["example_mask"])

    want = jax.jit(jax.grad(constant_kl_loss))(params)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-7), grads, want)


def test_metrics_average_the_micro_batches_that_have_them(tmp_path):
    """Over accumulated micro-batches, each metric is the mean of the per-micro-batch means of
    the micro-batches with such rows (TRL appends one value per micro-batch that has them); a
    step with none of them logs NaN (the loop drops it, TRL logs nothing)."""
    loss_fn = _loss_fn(tmp_path)
    mb = _batch()
    only_chosen = {**mb, "example_mask": jnp.asarray([1.0, 0.0, 1.0, 0.0])}
    auxes, singles = [], []
    for one in (mb, only_chosen):
        _, aux = _call(loss_fn, one)
        auxes.append(aux)
        singles.append(reduce_aux(jax.tree.map(lambda x: x[None], aux)))
    both = reduce_aux(jax.tree.map(lambda *xs: jnp.stack(xs), *auxes))
    for key in ("rewards/chosen", "logps/chosen", "kl", "entropy"):
        want = (float(singles[0][key]) + float(singles[1][key])) / 2
        assert float(both[key]) == pytest.approx(want, rel=1e-5), key
    for key in ("rewards/rejected", "rewards/margins", "logits/rejected"):  # first one only
        assert float(both[key]) == pytest.approx(float(singles[0][key]), rel=1e-5), key
    absent = kto.with_absent_as_nan(singles[1])
    assert np.isnan(absent["rewards/rejected"]) and np.isnan(absent["rewards/margins"])
    assert float(absent["rewards/chosen"]) == pytest.approx(float(singles[1]["rewards/chosen"]))
    assert not any(k.startswith(kto.PRESENT) for k in absent)


def test_make_loss_needs_a_reference(tmp_path):
    config = KTOConfig(output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="ref_logps"):
        kto.make_loss(config, apply_model(lm()[0]))
