"""algos.dpo: pair log-probs of a tiny model in both batch layouts against numpy (each completion
scored in its own `prompt + completion` row), and the DPO loss against TRL's formulas: sigmoid
rewards `beta * (policy - ref)`, margins and accuracies, several loss types with RPO's `sft`
term, WPO weights, LD-DPO, f-DPO, precomputed and reference-free paths, without a trainer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import DPOConfig
from jaxrl.algos import dpo
from jaxrl.data.collate import collate_preference, collate_preference_shared

from .tiny import PAD, apply_model, greedy, lm, log_softmax, np_logits

T = 12
SIDES = ("chosen", "rejected")


@functools.cache
def _examples() -> list[dict]:
    """Three pairs; the first's chosen completion is the policy's greedy one (argmax hits)."""
    examples = [
        {"prompt_input_ids": [3, 4, 5], "chosen_input_ids": [6, 7, 8], "rejected_input_ids": [9, 1]},
        {"prompt_input_ids": [10, 11], "chosen_input_ids": [12, 13, 14, 1], "rejected_input_ids": [15, 16, 1]},
        {"prompt_input_ids": [17, 18, 19, 20], "chosen_input_ids": [21, 1], "rejected_input_ids": [22, 23, 24]},
    ]  # fmt: skip
    examples[0]["chosen_input_ids"] = greedy(*lm(), examples[0]["prompt_input_ids"], 3)
    return examples


EXAMPLE_MASK = np.array([1.0, 1.0, 0.0], np.float32)  # the third fills a partial batch
REAL = EXAMPLE_MASK > 0
BETA = 0.1


def _batch(layout: str) -> dict:
    """A micro-batch as the trainer collates it: `[B, 2, T]` pairs or `[B, T]` shared rows."""
    if layout == "pairs":
        rows = collate_preference(_examples(), T, PAD)
        b = len(_examples())
        batch = {k: np.stack([v[:b], v[b:]], axis=1) for k, v in rows.items()}
    else:
        batch = collate_preference_shared(_examples(), T, PAD)
    batch["example_mask"] = EXAMPLE_MASK
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _np_tokens(graphdef, params) -> dict[str, list[dict]]:
    """Per side and pair, per completion token: log-prob of the target, mean logit, argmax hit,
    entropy and WPO's `log p - log sum_v p_v^2`, from full logits of the two-row layout built
    here by hand (completion token j of a row is predicted at position len(prompt) + j - 1)."""
    rows = [
        ex["prompt_input_ids"] + ex[f"{side}_input_ids"] for side in SIDES for ex in _examples()
    ]
    ids = np.full((len(rows), T), PAD)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    logits = np_logits(graphdef, params, ids)
    logp = log_softmax(logits)
    out = {side: [] for side in SIDES}
    for i, row in enumerate(rows):
        side, ex = SIDES[i // len(_examples())], _examples()[i % len(_examples())]
        p = len(ex["prompt_input_ids"])
        pos, targets = np.arange(p - 1, len(row) - 1), np.asarray(row[p:])
        lp_TV = logp[i, pos]
        lp = lp_TV[np.arange(len(targets)), targets]
        out[side].append(
            {
                "logp": lp,
                "logits": logits[i, pos].mean(-1),
                "argmax_correct": (logits[i, pos].argmax(-1) == targets).astype(float),
                "entropy": -(np.exp(lp_TV) * lp_TV).sum(-1),
                "wpo": lp - np.log(np.exp(2 * lp_TV).sum(-1)),
            }
        )
    return out


def _sums(tokens: dict, key: str, side: str) -> np.ndarray:
    return np.asarray([t[key].sum() for t in tokens[side]])


def _lengths(side: str) -> np.ndarray:
    return np.asarray([len(ex[f"{side}_input_ids"]) for ex in _examples()], float)


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _pair_logps(graphdef, params, mb, score_span=None, ld_alpha=None) -> dict:
    fn = lambda params, mb: dpo.pair_logps(  # noqa: E731
        nnx.merge(graphdef, params), mb, 4, True, score_span, ld_alpha
    )
    return {k: np.asarray(v) for k, v in jax.jit(fn)(params, mb).items()}


@pytest.mark.parametrize("layout, score_span", [("pairs", None), ("pairs", 8), ("shared", 8)])
def test_pair_logps_match_numpy_in_both_layouts(layout, score_span):
    """Summed completion log-probs, token counts and the per-pair statistic sums of either
    layout (the LM head on the whole row or on an 8-slot span) equal numpy's on full logits."""
    graphdef, params = lm()
    out = _pair_logps(graphdef, params, _batch(layout), score_span)
    tokens = _np_tokens(graphdef, params)
    for side in SIDES:
        np.testing.assert_array_equal(out[f"tokens/{side}"], _lengths(side))
        np.testing.assert_allclose(out[side], _sums(tokens, "logp", side), rtol=1e-5)
        for key in ("logits", "argmax_correct", "entropy", "wpo"):
            want = _sums(tokens, key, side)
            np.testing.assert_allclose(out[f"{key}/{side}"], want, rtol=1e-5, atol=1e-5)


def test_prefix_sharing_equals_the_two_row_layout_with_ld_alpha():
    """One `prompt + chosen + rejected` row per pair gives every per-pair quantity of the two
    rows; LD-DPO (`ld_alpha`) weighs the completion tokens past the shorter completion's length
    by alpha and keeps the plain sum as `nll/*`."""
    graphdef, params = lm()
    pairs = _pair_logps(graphdef, params, _batch("pairs"), ld_alpha=0.5)
    shared = _pair_logps(graphdef, params, _batch("shared"), ld_alpha=0.5)
    assert set(pairs) == set(shared)
    for key in pairs:
        np.testing.assert_allclose(shared[key], pairs[key], rtol=1e-5, atol=1e-5, err_msg=key)
    tokens = _np_tokens(graphdef, params)
    for side in SIDES:
        shorter = np.minimum(_lengths("chosen"), _lengths("rejected")).astype(int)
        logps = [t["logp"] for t in tokens[side]]
        want = [lp[:m].sum() + 0.5 * lp[m:].sum() for lp, m in zip(logps, shorter, strict=True)]
        np.testing.assert_allclose(pairs[side], want, rtol=1e-5)
        np.testing.assert_allclose(pairs[f"nll/{side}"], _sums(tokens, "logp", side), rtol=1e-5)


def _ref_logps(seed: int = 1):
    ref_graphdef, ref_params = lm(seed)
    return lambda state, mb: dpo.reference_logps(
        nnx.merge(ref_graphdef, ref_params), mb, 4, None, None
    )


def _make_loss(tmp_path, *, ref_logps=None, **fields):
    config = DPOConfig(output_dir=str(tmp_path), beta=BETA, logprob_chunk_size=4, **fields)
    return dpo.make_loss(config, apply_model(lm()[0]), ref_logps=ref_logps)


def _loss(tmp_path, mb, *, ref_logps=None, **fields):
    loss_fn = _make_loss(tmp_path, ref_logps=ref_logps, **fields)
    return jax.jit(loss_fn)(lm()[1], None, mb, None, {})


@pytest.mark.parametrize("layout", ["pairs", "shared"])
def test_sigmoid_loss_rewards_margins_accuracies_are_trls(tmp_path, layout):
    """TRL's sigmoid DPO: loss `-logsigmoid(beta * (policy - ref margin))`, rewards
    `beta * (policy - ref)`, margins, accuracies and log-probs summed over the real pairs, with
    per-pair or per-token counts; `num_tokens` counts the prompt once per completion. The
    gradients are those of that formula on full logits (none through the reference)."""
    mb = _batch(layout)
    loss_sum, (aux, _) = _loss(tmp_path, mb, ref_logps=_ref_logps())
    graphdef, params = lm()
    policy, ref = _np_tokens(graphdef, params), _np_tokens(*lm(1))
    pc, pr = _sums(policy, "logp", "chosen"), _sums(policy, "logp", "rejected")
    rc, rr = _sums(ref, "logp", "chosen"), _sums(ref, "logp", "rejected")
    chosen, rejected = BETA * (pc - rc), BETA * (pr - rr)
    np.testing.assert_allclose(loss_sum, -_log_sigmoid(chosen - rejected)[REAL].sum(), rtol=1e-5)
    s = {k: float(v) for k, v in aux["sum"].items()}
    np.testing.assert_allclose(s["rewards/chosen"], chosen[REAL].sum(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(s["rewards/rejected"], rejected[REAL].sum(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(s["rewards/margins"], (chosen - rejected)[REAL].sum(), rtol=1e-4)
    assert s["rewards/accuracies"] == np.sum((chosen > rejected)[REAL])
    np.testing.assert_allclose(s["logps/chosen"], pc[REAL].sum(), rtol=1e-5)
    np.testing.assert_allclose(s["logps/rejected"], pr[REAL].sum(), rtol=1e-5)
    hits = _sums(policy, "argmax_correct", "chosen")[REAL].sum()
    assert hits >= 1  # the greedy completion's
    assert s["mean_token_accuracy"] == hits
    n_c, n_r = _lengths("chosen")[REAL].sum(), _lengths("rejected")[REAL].sum()
    counts = {k: float(v) for k, v in aux["count"].items()}
    assert counts["loss"] == counts["rewards/margins"] == REAL.sum()
    assert (counts["logits/chosen"], counts["entropy"]) == (n_c, n_c + n_r)
    prompts = np.asarray([len(ex["prompt_input_ids"]) for ex in _examples()])[REAL].sum()
    assert float(aux["total"]["num_tokens"]) == 2 * prompts + n_c + n_r

    mask = {side: np.zeros((len(_examples()), T), np.float32) for side in SIDES}
    ids = {side: np.full((len(_examples()), T), PAD) for side in SIDES}
    for b, ex in enumerate(_examples()):
        p = len(ex["prompt_input_ids"])
        for side in SIDES:
            row = ex["prompt_input_ids"] + ex[f"{side}_input_ids"]
            ids[side][b, : len(row)] = row
            mask[side][b, p - 1 : len(row) - 1] = 1.0

    def full_logits_loss(params):
        model = nnx.merge(graphdef, params)
        logps = {}
        for side in SIDES:
            logp_BTV = jax.nn.log_softmax(model(jnp.asarray(ids[side])), axis=-1)
            targets_BT = jnp.pad(jnp.asarray(ids[side])[:, 1:], ((0, 0), (0, 1)))
            logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
            logps[side] = jnp.sum(logp_BT * mask[side], axis=-1)
        margin = (logps["chosen"] - rc) - (logps["rejected"] - rr)
        return jnp.sum(-jax.nn.log_sigmoid(BETA * margin) * EXAMPLE_MASK)

    loss_fn = _make_loss(tmp_path, ref_logps=_ref_logps())
    got = jax.jit(jax.grad(lambda p: loss_fn(p, None, mb, None, {})[0]))(params)
    want = jax.jit(jax.grad(full_logits_loss))(params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def _policy_sums(side: str) -> np.ndarray:
    return _sums(_np_tokens(*lm()), "logp", side)


@pytest.mark.parametrize("reference", ["precomputed", "reference_free"])
def test_precomputed_and_reference_free_references(tmp_path, reference):
    """Precomputed reference log-probs come from the batch (`ref_logps` `[B, 2]`), a
    reference-free loss scores against zeros; neither runs a reference model."""
    mb = _batch("pairs")
    if reference == "precomputed":
        mb["ref_logps"] = jnp.array([[-5.0, -6.0], [-7.0, -3.0], [-9.0, -10.0]])
        rc, rr = np.asarray(mb["ref_logps"]).T
        fields = {"precompute_ref_log_probs": True}
    else:
        rc = rr = np.zeros(len(_examples()))
        fields = {"reference_free": True}
    loss_sum, (aux, _) = _loss(tmp_path, mb, **fields)
    chosen, rejected = BETA * (_policy_sums("chosen") - rc), BETA * (_policy_sums("rejected") - rr)
    np.testing.assert_allclose(loss_sum, -_log_sigmoid(chosen - rejected)[REAL].sum(), rtol=1e-5)
    np.testing.assert_allclose(aux["sum"]["rewards/chosen"], chosen[REAL].sum(), rtol=1e-5)
    np.testing.assert_allclose(aux["sum"]["rewards/rejected"], rejected[REAL].sum(), rtol=1e-5)


def test_make_loss_without_any_reference_is_refused(tmp_path):
    with pytest.raises(ValueError, match="ref_logps"):
        _make_loss(tmp_path)


def test_several_loss_types_with_the_rpo_sft_term(tmp_path):
    """`loss_type=["sigmoid", "ipo", "sft"]` with `loss_weights`: per pair the weighted sigmoid
    and IPO (log-ratios per token) losses, plus the chosen tokens' NLL averaged over the chosen
    tokens of the step (RPO): an eval batch's own, or the step totals the trainer collates in."""
    mb = _batch("pairs")
    fields = {"loss_type": ["sigmoid", "ipo", "sft"], "loss_weights": [1.0, 0.5, 0.2]}
    pc, pr = _policy_sums("chosen"), _policy_sums("rejected")
    ref = _np_tokens(*lm(1))
    rc, rr = _sums(ref, "logp", "chosen"), _sums(ref, "logp", "rejected")
    lc, lr = _lengths("chosen"), _lengths("rejected")
    sigmoid = -_log_sigmoid(BETA * ((pc - rc) - (pr - rr)))
    ipo = ((pc - rc) / lc - (pr - rr) / lr - 1 / (2 * BETA)) ** 2
    pairs = (sigmoid + 0.5 * ipo)[REAL].sum()
    nll = -pc[REAL].sum()

    loss_sum, _ = _loss(tmp_path, mb, ref_logps=_ref_logps(), **fields)
    # the step divides by the pairs: the sft term is then -sum(pc) / chosen tokens
    np.testing.assert_allclose(loss_sum, pairs + 0.2 * nll * REAL.sum() / lc[REAL].sum(), rtol=1e-5)

    step = dict(mb, step_pairs=jnp.full(3, 6.0 / 3), step_chosen_tokens=jnp.full(3, 30.0 / 3))
    loss_sum, _ = _loss(tmp_path, step, ref_logps=_ref_logps(), **fields)
    np.testing.assert_allclose(loss_sum, pairs + 0.2 * nll * 6.0 / 30.0, rtol=1e-5)


def test_wpo_weights_each_pair_by_its_completions_probabilities(tmp_path):
    """WPO (`use_weighting`): each pair's loss times exp(mean over each completion's tokens of
    log p(y_t) - log sum_v p_v^2), chosen and rejected multiplied."""
    tokens = _np_tokens(*lm())
    weights = np.exp(
        _sums(tokens, "wpo", "chosen") / _lengths("chosen")
        + _sums(tokens, "wpo", "rejected") / _lengths("rejected")
    )
    ref = _np_tokens(*lm(1))
    margin = (_sums(tokens, "logp", "chosen") - _sums(ref, "logp", "chosen")) - (
        _sums(tokens, "logp", "rejected") - _sums(ref, "logp", "rejected")
    )
    loss_sum, _ = _loss(tmp_path, _batch("pairs"), ref_logps=_ref_logps(), use_weighting=True)
    want = (-_log_sigmoid(BETA * margin) * weights)[REAL].sum()
    np.testing.assert_allclose(loss_sum, want, rtol=1e-5)


def test_f_dpo_alpha_divergence(tmp_path):
    """f-DPO (Wang et al. 2023) with the alpha divergence: the sigmoid loss on
    f'(u_c) - f'(u_r), f'(u) = (u^(alpha - 1) - 1) / (alpha - 1), u = pi / pi_ref; rewards stay
    `beta * log u`."""
    alpha = 0.5
    ref = _np_tokens(*lm(1))
    uc = _policy_sums("chosen") - _sums(ref, "logp", "chosen")
    ur = _policy_sums("rejected") - _sums(ref, "logp", "rejected")
    f = lambda log_u: (np.exp((alpha - 1) * log_u) - 1) / (alpha - 1)  # noqa: E731
    loss_sum, (aux, _) = _loss(
        tmp_path, _batch("pairs"), ref_logps=_ref_logps(),
        f_divergence_type="alpha_divergence", f_alpha_divergence_coef=alpha,
    )  # fmt: skip
    want = -_log_sigmoid(BETA * (f(uc) - f(ur)))[REAL].sum()
    np.testing.assert_allclose(loss_sum, want, rtol=1e-5)
    np.testing.assert_allclose(aux["sum"]["rewards/chosen"], BETA * uc[REAL].sum(), rtol=1e-4)


def test_shared_rows_unpack_to_the_two_row_layout():
    """Input ids of prefix-shared rows unpack to the two-row layout's rows; the MoE token
    weights count the same tokens in both (a shared prompt twice), as `num_pair_tokens`; the
    loss units are the real pairs."""
    pairs, shared = _batch("pairs"), _batch("shared")
    np.testing.assert_array_equal(
        dpo.shared_rows_input_ids(shared, PAD), dpo.pairs_to_rows(pairs)["input_ids"]
    )
    n = float(dpo.num_pair_tokens(pairs))
    assert n == float(dpo.num_pair_tokens(shared)) == 2 * (3 + 2) + (3 + 4) + (2 + 3)
    assert float(jnp.sum(dpo.pair_token_weights(pairs))) == n
    assert float(jnp.sum(dpo.pair_token_weights(shared))) == n
    assert float(dpo.loss_units({"example_mask": jnp.stack([pairs["example_mask"]] * 2)})) == 4
