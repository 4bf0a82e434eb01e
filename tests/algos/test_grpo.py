"""algos.grpo: the GRPO loss function of one micro-batch (tiny model, no trainer) against a
NumPy hand computation of TRL's `_compute_loss`: every loss type at both importance-sampling
levels with the k3 KL term and clipping, the generation-batch token normaliser, top-entropy
masking, the entropy bonus and its adaptive controller, and the loss-unit counts."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algos import grpo
from jaxrl.trainers.grpo_config import GRPOConfig
from tests.algos.tiny_lm import TinyLM, np_logprobs_and_entropy, rollout_batch, tiny_params

TEMPERATURE = 0.9


def _apply(params, state):
    del state
    return TinyLM(params)


def _config(**kw) -> GRPOConfig:
    defaults = dict(
        output_dir="unused", temperature=TEMPERATURE, logprob_chunk_size=2, epsilon=0.2,
        epsilon_high=0.28, beta=0.04, max_completion_length=6,
    )  # fmt: skip
    return GRPOConfig(**{**defaults, **kw})


def _micro_batch(seed: int = 0, *, training: bool = True) -> tuple[dict, dict]:
    """A micro-batch with old/ref log-probs far enough from the policy's to clip, and the
    policy's own log-probs and entropies (NumPy, float64)."""
    params = tiny_params(seed)
    batch = rollout_batch(seed)
    logp, entropy = np_logprobs_and_entropy(params, batch, temperature=TEMPERATURE)
    rng = np.random.default_rng(seed + 100)
    mb = {
        **batch,
        "advantages": np.array([1.2, -0.7, 0.4, -1.5], np.float32),
        "old_logps": (logp + rng.uniform(-0.5, 0.5, logp.shape)).astype(np.float32),
        "ref_logps": (logp + rng.uniform(-0.3, 0.3, logp.shape)).astype(np.float32),
    }
    if training:  # the generation batch's loss tokens (one copy per row)
        mb["num_items_in_batch"] = np.full(4, 20.0, np.float32)
    return params, {"mb": mb, "logp": logp, "entropy": entropy}


def _np_grpo(c: GRPOConfig, logp, mb, *, keep=None, steps_per_generation=1):
    """TRL 1.16 `_compute_loss` by hand: `(loss_sum, count, mean k3 KL)` in the step's units."""
    m = mb["completion_mask"].astype(np.float64)
    old, ref = mb["old_logps"].astype(np.float64), mb["ref_logps"].astype(np.float64)
    A = mb["advantages"].astype(np.float64)[:, None]
    log_ratio = logp - old
    if c.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / np.maximum(m.sum(-1), 1))[:, None]
    r = np.exp(log_ratio)
    lo, hi = 1 - c.epsilon, 1 + c.epsilon_high
    lt = c.loss_type
    if lt == "cispo":
        per = -np.minimum(r, c.epsilon_high) * A * logp
    elif lt == "sapo":
        tau = np.where(A > 0, c.sapo_temperature_pos, c.sapo_temperature_neg)
        per = -(4 / tau) / (1 + np.exp(-tau * (r - 1))) * A
    elif lt == "vespo":
        log_w = np.clip((np.clip(logp - old, -20, 20) * m).sum(-1, keepdims=True), np.log(1e-8), 20)
        k = np.where(A >= 0, c.vespo_k_pos, c.vespo_k_neg)
        lam = np.where(A >= 0, c.vespo_lambda_pos, c.vespo_lambda_neg)
        per = -np.exp(lam + k * log_w - lam * np.exp(log_w)) * A * logp
    else:
        per = -np.minimum(r * A, np.clip(r, lo, hi) * A)
    if keep is not None:
        per = per * keep
    d = ref - logp
    kl = (np.exp(d) - d - 1) * r
    per = np.broadcast_to(per + c.beta * kl, m.shape)
    rows = len(m)
    if lt in ("grpo", "sapo"):
        loss, count = ((per * m).sum(-1) / np.maximum(m.sum(-1), 1)).sum(), rows
    elif lt == "luspo":
        loss, count = (per * m).sum(), rows
    elif lt == "dr_grpo":
        loss, count = (per * m).sum() / c.max_completion_length, rows
    elif lt == "bnpo":
        loss, count = (per * m).sum() / m.sum(), 1
    else:  # dapo, cispo, vespo: the generation batch's tokens / steps_per_generation
        loss, count = (per * m).sum(), mb["num_items_in_batch"][0] / steps_per_generation
    return loss, count, (kl * m).sum() / m.sum()


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(
    "loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
)
def test_loss_per_loss_type_with_kl_and_clipping_matches_hand_computation(loss_type, level):
    params, d = _micro_batch()
    c = _config(loss_type=loss_type, importance_sampling_level=level)
    loss_fn = grpo.make_loss(c, _apply, steps_per_generation=2)
    loss, (aux, extras) = jax.jit(loss_fn)(params, None, d["mb"], None, {"kept": 1})
    want, count, kl = _np_grpo(c, d["logp"], d["mb"], steps_per_generation=2)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(float(aux["count"]["loss"]), count, rtol=1e-6)
    got_kl = float(aux["sum"]["kl"] / aux["count"]["kl"])
    np.testing.assert_allclose(got_kl, kl, rtol=2e-5)
    assert extras == {"kept": 1}
    if loss_type in ("grpo", "dapo") and level == "token":  # the micro-batch does clip
        r = np.exp(d["logp"] - d["mb"]["old_logps"])
        m = d["mb"]["completion_mask"] > 0
        assert ((r < 0.8) & m).any() and ((r > 1.28) & m).any()
        assert float(aux["sum"]["clip_ratio/region_mean"]) > 0


def test_eval_batch_normalises_by_its_own_tokens():
    """No `num_items_in_batch` (an eval batch): `dapo` counts the batch's active tokens."""
    params, d = _micro_batch(1, training=False)
    loss_fn = grpo.make_loss(_config(loss_type="dapo"), _apply, steps_per_generation=4)
    _, (aux, _) = loss_fn(params, None, d["mb"], None, {})
    assert float(aux["count"]["loss"]) == float(d["mb"]["completion_mask"].sum())


def test_on_policy_without_old_logps_is_ratio_one():
    params, d = _micro_batch(2)
    mb = {k: v for k, v in d["mb"].items() if k != "old_logps"}
    c = _config(loss_type="grpo", beta=0.0)
    loss, _ = grpo.make_loss(c, _apply, steps_per_generation=1)(params, None, mb, None, {})
    m = mb["completion_mask"]
    want = -(mb["advantages"] * (m.sum(-1) / m.sum(-1))).sum()  # ratio 1: -A per sequence
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)


def test_top_entropy_quantile_masks_the_low_entropy_tokens():
    params, d = _micro_batch(3)
    c = _config(loss_type="dapo", top_entropy_quantile=0.5)
    loss, _ = grpo.make_loss(c, _apply, steps_per_generation=1)(params, None, d["mb"], None, {})
    m = d["mb"]["completion_mask"] > 0
    threshold = np.quantile(d["entropy"][m], 0.5)
    keep = ((d["entropy"] >= threshold) & m).astype(np.float64)
    assert 0 < keep.sum() < m.sum()
    want, _, _ = _np_grpo(c, d["logp"], d["mb"], keep=keep)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5)
    unmasked, _, _ = _np_grpo(c, d["logp"], d["mb"])
    assert abs(unmasked - want) > 1e-3


def test_fixed_entropy_bonus_subtracts_coef_times_mean_entropy():
    params, d = _micro_batch(4)
    c = _config(loss_type="grpo", entropy_coef=0.3, gradient_accumulation_steps=2)
    loss_fn = grpo.make_loss(c, _apply, steps_per_generation=2)
    loss, (aux, _) = loss_fn(params, None, d["mb"], None, {})
    m = d["mb"]["completion_mask"]
    H = (d["entropy"] * m).sum() / m.sum()
    policy, count, _ = _np_grpo(c, d["logp"], d["mb"])
    np.testing.assert_allclose(float(loss), policy - 0.3 * H * count, rtol=2e-5)
    np.testing.assert_allclose(float(aux["sum"]["policy_loss"]), policy, rtol=2e-5)
    assert float(aux["sum"]["entropy_coef"]) == pytest.approx(0.3)
    # Evaluation: the bonus applies, the coefficient is not logged.
    eval_mb = {k: v for k, v in d["mb"].items() if k != "num_items_in_batch"}
    eval_loss, (eval_aux, _) = loss_fn(params, None, eval_mb, None, {})
    np.testing.assert_allclose(float(eval_loss), policy - 0.3 * H * count, rtol=2e-5)
    assert "entropy_coef" not in eval_aux["sum"]


def test_adaptive_entropy_controller_moves_once_per_optimizer_step():
    """Two micro-batches of one step: the first only fills the window; the second moves the
    coefficient by `entropy_coef_delta` from the step's token-weighted entropy and resets it."""
    c = _config(
        loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.1, entropy_coef_delta=0.02,
        entropy_target=100.0, gradient_accumulation_steps=2,
    )  # fmt: skip
    extras = grpo.init_extras(c)
    assert float(extras["entropy_control"]["last_world_entropy"]) == np.inf
    make = grpo.make_loss(c, _apply, steps_per_generation=2)

    @jax.jit
    def loss_fn(params, state_extras, mb, extras):  # the state holds the step's first extras
        return make(params, SimpleNamespace(extras=state_extras), mb, None, extras)

    sums, counts = [], []
    state_extras = extras
    for i, seed in enumerate((5, 6)):
        params, d = _micro_batch(seed)
        loss, (aux, extras) = loss_fn(params, state_extras, d["mb"], extras)
        m = d["mb"]["completion_mask"]
        sums.append((d["entropy"] * m).sum())
        counts.append(m.sum())
        # First step: no entropy measured yet (+inf > target), so no bonus.
        policy, _, _ = _np_grpo(c, d["logp"], d["mb"])
        np.testing.assert_allclose(float(loss), policy, rtol=2e-5)
        ctrl = extras["entropy_control"]
        if i == 0:
            assert int(ctrl["micro_steps"]) == 1
            np.testing.assert_allclose(ctrl["window"], [sums[0], counts[0]], rtol=1e-5)
            assert float(aux["count"]["entropy_coef"]) == 0.0
    world = sum(sums) / sum(counts)
    assert int(ctrl["micro_steps"]) == 0
    np.testing.assert_array_equal(ctrl["window"], [0.0, 0.0])
    np.testing.assert_allclose(float(ctrl["last_world_entropy"]), world, rtol=1e-5)
    np.testing.assert_allclose(float(ctrl["entropy_coef"]), 0.12, rtol=1e-6)  # world <= target
    assert float(aux["count"]["entropy_coef"]) == 1.0
    np.testing.assert_allclose(float(aux["sum"]["entropy_coef"]), 0.12, rtol=1e-6)
    # The next step applies the moved coefficient (its entropy was under the target).
    params, d = _micro_batch(7)
    loss, _ = loss_fn(params, extras, d["mb"], extras)
    m = d["mb"]["completion_mask"]
    policy, count, _ = _np_grpo(c, d["logp"], d["mb"])
    H = (d["entropy"] * m).sum() / m.sum()
    np.testing.assert_allclose(float(loss), policy - 0.12 * H * count, rtol=2e-5)


def test_init_extras_is_empty_without_adaptive_control():
    assert grpo.init_extras(_config()) == {}
    assert not grpo.entropy_bonus_enabled(_config())
    assert grpo.entropy_bonus_enabled(_config(entropy_coef=0.1))
    assert grpo.entropy_bonus_enabled(_config(use_adaptive_entropy=True))


@pytest.mark.parametrize(
    "loss_type, want", [("grpo", 8.0), ("dr_grpo", 8.0), ("bnpo", 2.0), ("dapo", 2 * 20.0 / 4)]
)
def test_loss_units_sum_the_micro_batches_counts(loss_type, want):
    _, d = _micro_batch()
    batch_A = jax.tree.map(lambda x: jnp.stack([x, x]), d["mb"])
    units = grpo.make_loss_units(_config(loss_type=loss_type), steps_per_generation=4)
    assert float(units(batch_A)) == want


def test_token_count_only_for_token_normalised_training_batches():
    _, d = _micro_batch()
    assert float(grpo.token_count(_config(loss_type="dapo"), d["mb"], 4)) == 5.0
    assert grpo.token_count(_config(loss_type="grpo"), d["mb"], 4) is None
    eval_mb = {k: v for k, v in d["mb"].items() if k != "num_items_in_batch"}
    assert grpo.token_count(_config(loss_type="dapo"), eval_mb, 4) is None
