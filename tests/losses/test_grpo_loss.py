"""GRPO/RLOO losses and advantages against TRL 1.16's own code on identical inputs.

Loss tests call TRL's `_compute_loss` and compare the loss, its gradient w.r.t. the per-token
log-probs and the logged metrics with ours within 1e-5; advantage tests call TRL's
`_generate_and_score_completions` on fixed completions and rewards (see `trl_reference.py`).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from trl_reference import trl_grpo_loss, trl_grpo_scoring, trl_rloo_loss, trl_rloo_scoring

from jaxrl.core.state import TrainState
from jaxrl.core.step import make_train_step
from jaxrl.losses.grpo import (
    LOSS_TYPES,
    grpo_advantages,
    grpo_loss,
    high_entropy_mask,
    resolve_scale_rewards,
    truncated_completions,
)
from jaxrl.losses.rloo import rloo_advantages, rloo_loss, rloo_sequence_kl
from jaxrl.rewards import group_reward_metrics

TOL = dict(rtol=1e-5, atol=1e-5)
B, T, L_MAX = 6, 7, 9
# The ratio cap of cispo is epsilon_high itself; 1.2 makes it bind on these inputs.
EPS_HIGH = {"cispo": 1.2}


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.array([7, 3, 5, 0, 6, 1])  # one fully masked row (a masked truncated completion)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    logps = (-np.abs(rng.normal(size=(B, T))) - 0.05).astype(np.float32)
    old = (logps + 0.35 * rng.normal(size=(B, T))).astype(np.float32)
    ref = (logps + 0.5 * rng.normal(size=(B, T))).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    entropies = np.abs(rng.normal(size=(B, T))).astype(np.float32)
    return logps, old, ref, adv, mask, entropies


def _ours(logps, adv, mask, **kw):
    """Our loss (`loss_sum / count`), its gradient w.r.t. logps and reduced metrics."""

    def f(lp):
        loss_sum, aux = grpo_loss(jnp.asarray(lp), jnp.asarray(adv), jnp.asarray(mask), **kw)
        return loss_sum / aux["count"]["loss"], aux

    (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logps))
    metrics = {k: float(v / aux["count"][k]) for k, v in aux["sum"].items()}
    metrics.update({k: float(v) for k, v in {**aux["min"], **aux["max"]}.items()})
    return float(loss), np.asarray(grad), metrics


def _check_metrics(ours, theirs):
    assert theirs, "TRL logged no metrics"
    for name, value in theirs.items():
        if name == "entropy" and "entropy" not in ours:
            continue
        np.testing.assert_allclose(ours[name], value, err_msg=name, **TOL)


# delta only changes the clipped surrogates; for the other loss types it must be a no-op.
CASES = list(itertools.product(LOSS_TYPES, ["token", "sequence"], [0.0, 0.04], [None, 1.4]))
# Fast tier: every loss type once per level; the whole cross-product runs in the slow tier.
FAST_CASES = [(lt, "token", 0.04, 1.4) for lt in LOSS_TYPES] + [
    (lt, "sequence", 0.0, None) for lt in LOSS_TYPES
]
ALL_CASES = [c if c in FAST_CASES else pytest.param(*c, marks=pytest.mark.slow) for c in CASES]


@pytest.mark.parametrize(("loss_type", "level", "beta", "delta"), ALL_CASES)
def test_grpo_loss_matches_trl(loss_type, level, beta, delta):
    logps, old, ref, adv, mask, entropies = _inputs()
    cfg = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        epsilon=0.2,
        epsilon_high=EPS_HIGH.get(loss_type, 0.28),
        delta=delta,
    )
    t_loss, t_grad, t_metrics = trl_grpo_loss(
        logps,
        adv,
        mask,
        old_logps=old,
        ref_logps=ref if beta else None,
        entropies=entropies,
        max_completion_length=L_MAX,
        **cfg,
    )
    loss, grad, metrics = _ours(
        logps,
        adv,
        mask,
        old_per_token_logps_BT=jnp.asarray(old),
        ref_per_token_logps_BT=jnp.asarray(ref) if beta else None,
        entropies_BT=jnp.asarray(entropies),
        max_completion_length=L_MAX,
        **cfg,
    )
    np.testing.assert_allclose(loss, t_loss, **TOL)
    np.testing.assert_allclose(grad, t_grad, **TOL)
    assert np.abs(t_grad).max() > 1e-3  # the comparison is not vacuous
    _check_metrics(metrics, t_metrics)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_on_policy_and_options_match_trl(loss_type):
    """old log-probs = None (num_iterations=1), top-entropy mask, off-policy masking, no KL
    bias correction."""
    logps, _, ref, adv, mask, entropies = _inputs(1)
    cfg = dict(loss_type=loss_type, beta=0.1, off_policy_mask_threshold=0.0)
    t_loss, t_grad, t_metrics = trl_grpo_loss(
        logps,
        adv,
        mask,
        ref_logps=ref,
        entropies=entropies,
        max_completion_length=L_MAX,
        top_entropy_quantile=0.4,
        use_bias_correction_kl=False,
        **cfg,
    )
    loss, grad, metrics = _ours(
        logps,
        adv,
        mask,
        ref_per_token_logps_BT=jnp.asarray(ref),
        entropy_mask_BT=high_entropy_mask(jnp.asarray(entropies), jnp.asarray(mask), 0.4),
        entropies_BT=jnp.asarray(entropies),
        max_completion_length=L_MAX,
        use_bias_correction_kl=False,
        **cfg,
    )
    np.testing.assert_allclose(loss, t_loss, **TOL)
    np.testing.assert_allclose(grad, t_grad, **TOL)
    _check_metrics(metrics, t_metrics)


@functools.cache
def _steps_with_micro_batches(loss_type, splits, **kw):
    """One jitted program with one real `make_train_step` (SGD, lr 1) per number of micro-batches
    in `splits`, whose params are an offset on the log-probs: each update is minus the gradient
    w.r.t. the log-probs. (The splits' steps in one program compile once instead of once each.)"""
    tx = optax.sgd(1.0)

    def loss_fn(params, state, mb, rng, extras):
        lp = mb["logps"] + params["offset"][mb["rows"]]
        loss_sum, aux = grpo_loss(
            lp,
            mb["adv"],
            mb["mask"],
            old_per_token_logps_BT=mb["old"],
            ref_per_token_logps_BT=mb["ref"],
            loss_type=loss_type,
            **kw,
        )
        return loss_sum, (aux, extras)

    def steps(state, batch):
        out = []
        for num_micro in splits:
            split = {
                k: v.reshape(num_micro, B // num_micro, *v.shape[1:]) for k, v in batch.items()
            }
            new_state, metrics = make_train_step(loss_fn, tx)(state, split)
            out.append((metrics["loss"], -new_state.params["offset"]))
        return out

    return jax.jit(steps)


def _step_with_micro_batches(logps, old, ref, adv, mask, splits, *, loss_type, **kw):
    """`[(loss, minus the update)]`, one optimizer step per number of micro-batches in `splits`."""
    batch = {"logps": logps, "old": old, "ref": ref, "adv": adv, "mask": mask, "rows": np.arange(B)}
    tx = optax.sgd(1.0)
    state = TrainState.create({"offset": jnp.zeros((B, T), jnp.float32)}, tx, seed=0)
    out = _steps_with_micro_batches(loss_type, splits, **kw)(state, batch)
    return [(float(loss), np.asarray(grad)) for loss, grad in out]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_match_one_batch_and_trl_accumulation(loss_type):
    logps, old, ref, adv, mask, _ = _inputs(2)
    cfg = dict(
        loss_type=loss_type,
        beta=0.04,
        epsilon_high=EPS_HIGH.get(loss_type, 0.28),
        delta=1.4,
    )
    num_micro = 3
    # The step on one batch and the step on `num_micro` micro-batches, in one program.
    (one_loss, one_grad), (loss, grad) = _step_with_micro_batches(
        logps, old, ref, adv, mask, (1, num_micro), max_completion_length=L_MAX, **cfg
    )
    # TRL with `num_micro` accumulation steps: the sum of the micro-batch losses.
    size = B // num_micro
    t_loss, t_grads = 0.0, []
    for i in range(num_micro):
        rows = slice(i * size, (i + 1) * size)
        li, gi, _ = trl_grpo_loss(
            logps[rows],
            adv[rows],
            mask[rows],
            old_logps=old[rows],
            ref_logps=ref[rows],
            num_items_in_batch=mask.sum(),
            grad_accum=num_micro,
            max_completion_length=L_MAX,
            **cfg,
        )
        t_loss += li
        t_grads.append(gi)
    np.testing.assert_allclose(loss, t_loss, **TOL)
    np.testing.assert_allclose(grad, np.concatenate(t_grads), **TOL)
    if loss_type == "bnpo":
        # bnpo normalises each micro-batch by its own token count (TRL: "local batch").
        assert abs(loss - one_loss) > 1e-4
    else:
        np.testing.assert_allclose(loss, one_loss, **TOL)
        np.testing.assert_allclose(grad, one_grad, **TOL)


def test_example_mask_drops_padding_rows():
    logps, old, ref, adv, mask, _ = _inputs(3)
    pad = lambda x: np.concatenate([x, x[:2]])  # noqa: E731
    w = np.array([1, 1, 1, 1, 1, 1, 0, 0], np.float32)

    @jax.jit  # every loss type's two losses in one program, not one per primitive and shape
    def losses(logps, old, ref, adv, mask, w):
        out = {}
        for loss_type in LOSS_TYPES:
            kw = dict(loss_type=loss_type, max_completion_length=L_MAX, beta=0.04)
            base = grpo_loss(
                logps[:B],
                adv[:B],
                mask[:B],
                old_per_token_logps_BT=old[:B],
                ref_per_token_logps_BT=ref[:B],
                **kw,
            )
            padded = grpo_loss(
                logps,
                adv,
                mask * w[:, None],
                old_per_token_logps_BT=old,
                ref_per_token_logps_BT=ref,
                example_mask_B=w,
                **kw,
            )
            out[loss_type] = base, padded
        return out

    out = losses(pad(logps), pad(old), pad(ref), pad(adv), pad(mask), w)
    for loss_type, ((base, aux), (padded, paux)) in out.items():
        np.testing.assert_allclose(padded, base, err_msg=loss_type, **TOL)
        np.testing.assert_allclose(paux["count"]["loss"], aux["count"]["loss"], err_msg=loss_type)
        for name in aux["sum"]:
            np.testing.assert_allclose(
                paux["sum"][name], aux["sum"][name], err_msg=f"{loss_type} {name}", **TOL
            )


def test_bad_options_are_rejected():
    logps, _, _, adv, mask, _ = _inputs()
    with pytest.raises(ValueError, match="valid loss types"):
        grpo_loss(logps, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        grpo_loss(logps, adv, mask, importance_sampling_level="batch")
    with pytest.raises(ValueError, match="ref_per_token_logps_BT"):
        grpo_loss(logps, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(logps, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="scale_rewards"):
        resolve_scale_rewards("std")


# --- advantages -------------------------------------------------------------------------


def _rewards():
    rng = np.random.default_rng(4)
    r = rng.normal(size=(12, 2)).astype(np.float32)
    r[0, 1] = np.nan  # one function could not score this completion
    r[5] = np.nan  # nothing could
    r[6:9, 0] = 1.0  # a group with identical first-function rewards
    r[6:9, 1] = 0.5  # zero std in that group
    r[9:12, 0] = np.nan  # a group where only function 1 scores
    r[10:12, 1] = np.nan  # ... and only one completion is scorable at all
    return r


# 12 completions of 4 prompts; ids end in EOS (1), in padding (0) or neither (truncated).
COMPLETION_IDS = [
    [5, 1], [5, 6, 7], [5], [5, 6, 1], [1], [5, 6],
    [5, 6, 7, 1], [6, 0], [7, 7, 7, 7], [1], [5, 1], [6, 6],
]  # fmt: skip


def _completion_mask(ids_list):
    T_max = max(len(ids) for ids in ids_list)
    ids = np.array([ids + [0] * (T_max - len(ids)) for ids in ids_list])
    mask = (np.arange(T_max)[None, :] < np.array([len(x) for x in ids_list])[:, None]).astype(
        np.int32
    )
    return ids, mask


def _ours_scored(ids_list, mask_truncated):
    ids, mask = _completion_mask(ids_list)
    if mask_truncated:
        mask = mask * ~np.asarray(truncated_completions(ids, mask, [1], 0))[:, None]
    return mask


@pytest.mark.parametrize(
    ("scale_rewards", "aggregation", "mask_truncated"),
    [
        ("group", "sum_then_normalize", True),
        ("batch", "sum_then_normalize", False),
        ("none", "sum_then_normalize", False),
        ("group", "normalize_then_sum", True),
    ],
)
def test_grpo_advantages_and_reward_metrics_match_trl(scale_rewards, aggregation, mask_truncated):
    r, w = _rewards(), np.array([1.0, 0.5], np.float32)
    want_adv, want_mask, want_items, want_metrics = trl_grpo_scoring(
        r,
        COMPLETION_IDS,
        num_generations=3,
        reward_weights=w,
        scale_rewards=scale_rewards,
        multi_objective_aggregation=aggregation,
        mask_truncated_completions=mask_truncated,
    )
    adv, zero = grpo_advantages(
        r,
        w,
        num_generations=3,
        scale_rewards=scale_rewards,
        multi_objective_aggregation=aggregation,
    )
    np.testing.assert_allclose(adv, want_adv, **TOL)
    assert adv[5] == 0.0 and np.all(np.isfinite(adv))
    mask = _ours_scored(COMPLETION_IDS, mask_truncated)
    np.testing.assert_array_equal(mask, want_mask)
    assert mask.sum() == want_items
    metrics = group_reward_metrics(r, w, ["f0", "f1"], zero)
    assert set(metrics) == set(want_metrics)
    for name, value in want_metrics.items():
        np.testing.assert_allclose(metrics[name], value, err_msg=name, **TOL)


def test_scale_rewards_aliases():
    r, w = _rewards(), np.ones(2, np.float32)
    for alias, name in ((True, "group"), (False, "none")):
        a1, _ = grpo_advantages(r, w, num_generations=3, scale_rewards=alias)
        a2, _ = grpo_advantages(r, w, num_generations=3, scale_rewards=name)
        np.testing.assert_array_equal(a1, a2)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_rloo_advantages_and_metrics_match_trl(normalize, beta):
    r, w = _rewards(), np.array([1.0, 0.5], np.float32)
    ids, _ = _completion_mask(COMPLETION_IDS)
    old, ref = np.random.default_rng(5).normal(size=(2, *ids.shape)).astype(np.float32)
    clip = (-1.0, 1.0)
    want_adv, want_mask, want_old_logps, want_metrics = trl_rloo_scoring(
        r,
        COMPLETION_IDS,
        old,
        ref,
        num_generations=3,
        reward_weights=w,
        beta=beta,
        reward_clip_range=clip,
        normalize_advantages=normalize,
        mask_truncated_completions=True,
    )
    mask = _ours_scored(COMPLETION_IDS, True)
    np.testing.assert_array_equal(mask, want_mask)
    kl, kl_aux = rloo_sequence_kl(old, ref, mask)
    adv, zero = rloo_advantages(
        r,
        w,
        num_generations=3,
        beta=beta,
        kl_N=kl,
        reward_clip_range=clip,
        normalize_advantages=normalize,
    )
    np.testing.assert_allclose(adv, want_adv, **TOL)
    np.testing.assert_allclose((old * mask).sum(-1), want_old_logps, **TOL)
    metrics = group_reward_metrics(r, w, ["f0", "f1"], zero)
    if beta:
        metrics["kl"] = float(kl_aux["sum"]["kl"] / kl_aux["count"]["kl"])
    assert set(metrics) == set(want_metrics)
    for name, value in want_metrics.items():
        np.testing.assert_allclose(metrics[name], value, err_msg=name, **TOL)


def test_rloo_loss_matches_trl():
    logps, old, _, adv, mask, entropies = _inputs(6)
    old_logps = (old * mask).sum(-1)
    t_loss, t_grad, t_metrics = trl_rloo_loss(
        logps, adv, mask, old_logps, epsilon_high=0.28, entropies=entropies
    )

    def f(lp):
        loss_sum, aux = rloo_loss(
            lp, adv, mask, old_logps_B=old_logps, epsilon_high=0.28, entropies_BT=entropies
        )
        return loss_sum / aux["count"]["loss"], aux

    # One program (run eagerly, one per primitive and shape).
    (loss, aux), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(logps))
    np.testing.assert_allclose(loss, t_loss, **TOL)
    np.testing.assert_allclose(grad, t_grad, **TOL)
    assert np.abs(t_grad).max() > 1e-3
    metrics = {k: float(v / aux["count"][k]) for k, v in aux["sum"].items()}
    metrics.update({k: float(v) for k, v in {**aux["min"], **aux["max"]}.items()})
    _check_metrics(metrics, t_metrics)
    assert t_metrics["clip_ratio/region_mean"] > 0  # the clip path is exercised


def test_truncated_completions():
    ids = jnp.asarray([[5, 6, 1, 0], [5, 6, 7, 8], [5, 0, 0, 0], [0, 0, 0, 0]])
    mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    out = truncated_completions(ids, mask, eos_token_ids=[1], pad_token_id=0)
    np.testing.assert_array_equal(out, [False, True, True, False])
