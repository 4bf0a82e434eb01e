"""DPO-family losses against golden numbers from an independent float64 numpy transcription of
TRL 1.16 `DPOTrainer._compute_loss` (and TRL <= 0.2x for cDPO, bco baseline, reference_free)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses import (
    LOSS_TYPES,
    dpo_loss,
    dpo_multi_loss,
    running_moments_init,
    running_moments_update,
)

BETA = 0.3


def logsig(x):
    return -np.logaddexp(0.0, -x)


def sig(x):
    return 1.0 / (1.0 + np.exp(-x))


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    b = 6
    return {
        "pc": rng.normal(-20, 4, b),
        "pr": rng.normal(-22, 4, b),
        "rc": rng.normal(-21, 4, b),
        "rr": rng.normal(-21, 4, b),
        "lc": rng.integers(3, 30, b).astype(np.float64),
        "lr": rng.integers(3, 30, b).astype(np.float64),
    }


def reference_loss(loss_type, d, ls=0.0, tau=0.05, bco_delta=0.0, f="reverse_kl", alpha_coef=0.5):
    """TRL's per-sequence loss, written from its formulas in numpy float64."""
    pc, pr, rc, rr, lc, lr = (d[k] for k in ("pc", "pr", "rc", "rr", "lc", "lr"))
    cl, rl = pc - rc, pr - rr
    if f == "reverse_kl":
        cs, rs = cl, rl
    elif f == "forward_kl":
        cs, rs = 1 - np.exp(-cl), 1 - np.exp(-rl)
    elif f == "js_divergence":
        cs, rs = np.log(2) + logsig(cl), np.log(2) + logsig(rl)
    else:
        cs = (np.exp((alpha_coef - 1) * cl) - 1) / (alpha_coef - 1)
        rs = (np.exp((alpha_coef - 1) * rl) - 1) / (alpha_coef - 1)
    z = BETA * (cs - rs)
    if loss_type == "sigmoid":
        return -logsig(z)  # TRL 1.16 ignores label_smoothing for sigmoid
    if loss_type == "hinge":
        return np.maximum(0, 1 - z)
    if loss_type == "ipo":
        return (cs / lc - rs / lr - 1 / (2 * BETA)) ** 2
    if loss_type == "exo_pair":
        return sig(z) * (logsig(z) - np.log1p(-ls)) + sig(-z) * (logsig(-z) - np.log(ls))
    if loss_type == "nca_pair":
        return -logsig(BETA * cl) - 0.5 * logsig(-BETA * cl) - 0.5 * logsig(-BETA * rl)
    if loss_type == "robust":
        return (-(1 - ls) * logsig(z) + ls * logsig(-z)) / (1 - 2 * ls)
    if loss_type == "bco_pair":
        return -logsig(BETA * cl - bco_delta) - logsig(-(BETA * rl - bco_delta))
    if loss_type == "sppo_hard":
        return (cl - 0.5 / BETA) ** 2 + (rl + 0.5 / BETA) ** 2
    if loss_type == "aot":
        dd = np.sort(pc - pr) - np.sort(rc - rr)
        return -logsig(BETA * dd) * (1 - ls) - logsig(-BETA * dd) * ls
    if loss_type == "aot_unpaired":
        dd = np.sort(cl) - np.sort(rl)
        return -logsig(BETA * dd) * (1 - ls) - logsig(-BETA * dd) * ls
    if loss_type == "apo_zero":
        return 1 - sig(BETA * cl) + sig(BETA * rl)
    if loss_type == "apo_down":
        return sig(BETA * cl) + 1 - sig(BETA * (cl - rl))
    if loss_type == "discopop":
        m = sig(z / tau)
        return -logsig(z) * (1 - m) + np.exp(-z) * m
    if loss_type == "sft":
        return np.full_like(pc, -pc.sum() / lc.sum())
    if loss_type == "sigmoid_norm":
        return -logsig(BETA * (cs / lc - rs / lr))
    raise AssertionError(loss_type)


def call(loss_type, d, **kw):
    args = [jnp.asarray(d[k], jnp.float32) for k in ("pc", "pr", "rc", "rr")]
    lengths = {"chosen_lengths": jnp.asarray(d["lc"]), "rejected_lengths": jnp.asarray(d["lr"])}
    return dpo_loss(*args, beta=BETA, loss_type=loss_type, **lengths, **kw)


@pytest.mark.parametrize(
    "loss_type,ls",
    [(t, 0.0) for t in LOSS_TYPES if t != "exo_pair"]
    + [
        ("sigmoid", 0.1),
        ("robust", 0.2),
        ("exo_pair", 1e-3),
        ("exo_pair", 0.2),
        ("aot", 0.1),
        ("aot_unpaired", 0.1),
    ],
)
def test_loss_matches_trl_formula(batch, loss_type, ls):
    losses, chosen_rewards, rejected_rewards = call(loss_type, batch, label_smoothing=ls)
    np.testing.assert_allclose(
        losses, reference_loss(loss_type, batch, ls=ls), rtol=2e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        chosen_rewards, BETA * (batch["pc"] - batch["rc"]), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        rejected_rewards, BETA * (batch["pr"] - batch["rr"]), rtol=1e-5, atol=1e-5
    )


def test_default_is_plain_dpo_sigmoid(batch):
    args = [jnp.asarray(batch[k], jnp.float32) for k in ("pc", "pr", "rc", "rr")]
    losses, _, _ = dpo_loss(*args)
    z = 0.1 * ((batch["pc"] - batch["rc"]) - (batch["pr"] - batch["rr"]))
    np.testing.assert_allclose(losses, -logsig(z), rtol=1e-5)


@pytest.mark.parametrize("f", ["forward_kl", "js_divergence", "alpha_divergence"])
def test_f_divergence_scores(batch, f):
    small = {k: (v / 20 if k in ("pc", "pr", "rc", "rr") else v) for k, v in batch.items()}
    for loss_type in ("sigmoid", "ipo"):
        losses, _, _ = call(loss_type, small, f_divergence_type=f)
        np.testing.assert_allclose(
            losses, reference_loss(loss_type, small, f=f), rtol=2e-5, atol=1e-6
        )


def test_discopop_tau(batch):
    losses, _, _ = call("discopop", batch, discopop_tau=0.5)
    np.testing.assert_allclose(losses, reference_loss("discopop", batch, tau=0.5), rtol=2e-5)


def test_rewards_are_detached_and_loss_has_gradient(batch):
    args = [jnp.asarray(batch[k], jnp.float32) for k in ("pc", "pr", "rc", "rr")]

    def rewards_sum(pc):
        _, cr, rr = dpo_loss(pc, *args[1:])
        return cr.sum() + rr.sum()

    def loss_mean(pc):
        return dpo_loss(pc, *args[1:])[0].mean()

    assert float(jnp.abs(jax.grad(rewards_sum)(args[0])).sum()) == 0.0
    z = 0.1 * ((batch["pc"] - batch["rc"]) - (batch["pr"] - batch["rr"]))
    # d/dpc of -logsig(beta * z) / B = -beta * sigmoid(-z) / B
    np.testing.assert_allclose(jax.grad(loss_mean)(args[0]), -0.1 * sig(-z) / len(z), rtol=1e-5)


def test_reference_free_treats_ref_logps_as_zero(batch):
    free = call("sigmoid", batch, reference_free=True)
    zero = {**batch, "rc": np.zeros_like(batch["rc"]), "rr": np.zeros_like(batch["rr"])}
    explicit = call("sigmoid", zero)
    chex.assert_trees_all_close(free, explicit, rtol=1e-6)
    np.testing.assert_allclose(free[1], BETA * batch["pc"], rtol=1e-5)


def test_multi_loss_weights(batch):
    args = [jnp.asarray(batch[k], jnp.float32) for k in ("pc", "pr", "rc", "rr")]
    lengths = {
        "chosen_lengths": jnp.asarray(batch["lc"]),
        "rejected_lengths": jnp.asarray(batch["lr"]),
    }
    # MPO-style combination, TRL: loss = sum_k w_k * mean(loss_k)
    losses, cr, _ = dpo_multi_loss(
        *args,
        loss_types=["sigmoid", "bco_pair", "sft"],
        loss_weights=[0.8, 0.2, 1.0],
        beta=BETA,
        **lengths,
    )
    expected = (
        0.8 * reference_loss("sigmoid", batch).mean()
        + 0.2 * reference_loss("bco_pair", batch).mean()
        + reference_loss("sft", batch).mean()
    )
    np.testing.assert_allclose(losses.mean(), expected, rtol=1e-5)
    np.testing.assert_allclose(cr, BETA * (batch["pc"] - batch["rc"]), rtol=1e-5)
    unweighted, _, _ = dpo_multi_loss(*args, loss_types=["sigmoid", "hinge"], beta=BETA)
    np.testing.assert_allclose(
        unweighted, reference_loss("sigmoid", batch) + reference_loss("hinge", batch), rtol=1e-5
    )


class TorchStyleRunningMoments:
    """TRL <= 0.2x `RunningMoments.update` transcribed with python floats."""

    def __init__(self):
        self.mean, self.std, self.var, self.count = 0.0, 1.0, 1.0, 1e-24

    def update(self, xs):
        xs_count = xs.size
        xs_mean, xs_var = float(xs.mean()), float(xs.var())
        delta = xs_mean - self.mean
        tot = self.count + xs_count
        old_sum = self.var * self.count + delta**2 * self.count * xs_count / tot
        self.mean += delta * xs_count / tot
        new_var = (old_sum + xs_var * xs_count) / tot
        with np.errstate(divide="ignore", invalid="ignore"):  # like torch: inf/nan after 1 sample
            self.std = float(np.sqrt(np.float64(new_var * tot) / np.float64(tot - 1)))
        self.var = new_var
        self.count = tot


def test_bco_pair_with_running_mean_baseline(batch):
    rng = np.random.default_rng(1)
    state, ref = running_moments_init(), TorchStyleRunningMoments()
    update = jax.jit(running_moments_update)
    for step in range(4):
        d = {k: v + rng.normal(0, 2, v.shape) for k, v in batch.items()}
        rewards = BETA * np.concatenate([d["pc"] - d["rc"], d["pr"] - d["rr"]])
        # TRL updated the moments with the scalar batch mean before computing the loss.
        ref.update(np.array([rewards.mean()]))
        state = update(state, jnp.asarray(rewards.mean(), jnp.float32)[None])
        losses, _, _ = call("bco_pair", d, bco_delta=state.mean)
        np.testing.assert_allclose(
            losses, reference_loss("bco_pair", d, bco_delta=ref.mean), rtol=1e-4, atol=1e-5
        )
        np.testing.assert_allclose(float(state.mean), ref.mean, rtol=1e-5, atol=1e-6)
        if step > 0:  # after one scalar sample both give inf/nan std (n - 1 == 0)
            np.testing.assert_allclose(float(state.std), ref.std, rtol=1e-4, atol=1e-6)
    vec = np.array([1.0, 2.0, 4.0, 8.0])
    ref_vec = TorchStyleRunningMoments()
    ref_vec.update(vec)
    ref_vec.update(vec * 3)
    state = running_moments_update(
        running_moments_update(running_moments_init(), jnp.asarray(vec)), jnp.asarray(vec * 3)
    )
    np.testing.assert_allclose(
        [state.mean, state.var, state.std], [ref_vec.mean, ref_vec.var, ref_vec.std], rtol=1e-5
    )


def test_jit_with_static_loss_type(batch):
    args = [jnp.asarray(batch[k], jnp.float32) for k in ("pc", "pr", "rc", "rr")]
    fn = jax.jit(functools.partial(dpo_loss, loss_type="aot", beta=BETA))
    np.testing.assert_allclose(fn(*args)[0], reference_loss("aot", batch), rtol=2e-5, atol=1e-5)


def test_user_errors_name_the_fix(batch):
    args = [jnp.asarray(batch[k], jnp.float32) for k in ("pc", "pr", "rc", "rr")]
    with pytest.raises(ValueError, match="valid loss types are .*'sigmoid'.*'discopop'"):
        dpo_loss(*args, loss_type="sigmod")
    with pytest.raises(ValueError, match="label_smoothing > 0"):
        dpo_loss(*args, loss_type="exo_pair")
    with pytest.raises(ValueError, match="chosen_lengths and rejected_lengths"):
        dpo_loss(*args, loss_type="ipo")
    with pytest.raises(ValueError, match="f_divergence_type='reverse_kl'"):
        dpo_loss(*args, loss_type="bco_pair", f_divergence_type="forward_kl")
    with pytest.raises(ValueError, match="one weight per loss type"):
        dpo_multi_loss(*args, loss_types=["sigmoid", "hinge"], loss_weights=[1.0])


def test_label_smoothing_without_a_reader_warns():
    """TRL 1.16 reads `label_smoothing` in robust/exo_pair/aot only; with sigmoid it changes
    nothing (checked in test_loss_matches_trl_formula), and jaxrl says so instead of staying
    silent."""
    import warnings

    from jaxrl import DPOConfig
    from jaxrl.trainers.dpo import DPOTrainer

    with pytest.warns(UserWarning, match="label_smoothing=0.1 has no effect"):
        DPOTrainer._validate(DPOConfig(output_dir="unused", label_smoothing=0.1), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DPOTrainer._validate(
            DPOConfig(output_dir="unused", label_smoothing=0.1, loss_type=["sigmoid", "robust"]),
            None,
        )
