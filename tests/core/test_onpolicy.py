"""core.onpolicy: the rollout forward against full-logit references, and the jitted PPO update
(epochs x backward batches x accumulation scans) against an unrolled Python reference; early
stopping and the ratio_threshold skip."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import transformers
from flax import nnx

from jaxrl import AutoModelForCausalLMWithValueHead
from jaxrl.core import rl
from jaxrl.core.onpolicy import make_ppo_loss_fn, make_ppo_update, make_rollout_forward
from jaxrl.core.state import TrainState

B, L, V = 4, 7, 48


@pytest.fixture(scope="module")
def setup():
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    policy = AutoModelForCausalLMWithValueHead.from_config(cfg, seed=0)
    ref = AutoModelForCausalLMWithValueHead.from_config(cfg, seed=1).pretrained_model
    graphdef, params = nnx.split(policy)
    ref_graphdef, ref_params = nnx.split(ref)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, V, size=(B, L)).astype(np.int32)
    attn = np.ones((B, L), np.int32)
    attn[1, 5:] = 0
    attn[3, 6:] = 0
    mask = np.zeros((B, L - 1), np.float32)
    mask[:, 2:] = attn[:, 3:]
    return dict(
        apply=lambda p: nnx.merge(graphdef, p),
        apply_ref=lambda p: nnx.merge(ref_graphdef, p),
        params=params,
        ref_params=ref_params,
        ids=jnp.asarray(ids),
        attn=jnp.asarray(attn),
        mask=jnp.asarray(mask),
    )


@pytest.fixture(scope="module")
def rollout(setup):
    """The update tests' rollout (the same for each), computed once per module in one program
    (run eagerly, the two models' forwards compiled one program per primitive and shape)."""
    return jax.jit(lambda p, ref_p: _rollout(setup, p, ref_p))(setup["params"], setup["ref_params"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kl", "full"])
def test_rollout_forward_matches_full_logits(setup, kind):
    s = setup
    fwd = jax.jit(make_rollout_forward(s["apply"], s["apply_ref"], kl_kind=kind, chunk_size=4))
    out = fwd(s["params"], s["ref_params"], s["ids"], s["attn"])

    @jax.jit  # the full-logit reference in one program, not one per primitive and shape
    def reference(params, ref_params):
        logits, values = s["apply"](params)(s["ids"], s["attn"])
        ref_logits = s["apply_ref"](ref_params)(s["ids"], s["attn"])
        lp = jax.nn.log_softmax(logits[:, :-1], -1)
        ref_lp = jax.nn.log_softmax(ref_logits[:, :-1], -1)
        take = lambda x: jnp.take_along_axis(x, s["ids"][:, 1:, None], -1)[..., 0]  # noqa: E731
        kl = rl.kl_penalty(lp, ref_lp, "full") if kind == "full" else take(lp) - take(ref_lp)
        return take(lp), take(ref_lp), values[:, :-1], kl

    logprobs, ref_logprobs, values, want_kl = reference(s["params"], s["ref_params"])
    np.testing.assert_allclose(out["logprobs"], logprobs, atol=1e-5)
    np.testing.assert_allclose(out["ref_logprobs"], ref_logprobs, atol=1e-5)
    np.testing.assert_allclose(out["values"], values, atol=1e-6)
    np.testing.assert_allclose(out["kl"], want_kl, atol=1e-5)


def _rollout(s, params, ref_params):
    fwd = make_rollout_forward(s["apply"], s["apply_ref"])(params, ref_params, s["ids"], s["attn"])
    scores = jnp.array([1.0, -0.5, 0.3, 2.0])
    rewards, _ = rl.compute_rewards(scores, fwd["kl"], s["mask"], 0.2)
    values, adv, returns = rl.compute_advantages(
        fwd["values"], rewards, s["mask"], gamma=1, lam=0.95
    )
    return {
        "input_ids": s["ids"],
        "attention_mask": s["attn"],
        "old_logprobs": fwd["logprobs"],
        "values": values,
        "mask": s["mask"],
        "advantages": adv,
        "returns": returns,
    }


LOSS_KW = dict(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)


def _copy(tree):
    return jax.device_put(tree, may_alias=False)  # a copy that compiles no program


@pytest.mark.slow
def test_update_matches_unrolled_reference(setup, rollout):
    s = setup
    tx = optax.sgd(0.5)  # linear in the gradient: compares the accumulation exactly
    perms = jnp.asarray([[2, 0, 3, 1], [1, 3, 0, 2]], jnp.int32)
    loss_fn = make_ppo_loss_fn(s["apply"], ratio_threshold=10.0, **LOSS_KW)
    update = make_ppo_update(
        loss_fn, tx, batch_size=B, mini_batch_size=1, gradient_accumulation_steps=2,
        early_stopping=False, target_kl=1.0,
    )  # fmt: skip
    state = TrainState.create(_copy(s["params"]), tx, seed=0)
    new_state, out = jax.jit(update)(state, rollout, perms)

    # Reference: Python loops; each update's gradient is the mean of the two mini-batch grads.
    @jax.jit
    def mb_loss_and_grad(params, rows):
        def mb_loss(params):
            mb = jax.tree.map(lambda x: x[rows], rollout)
            return loss_fn(params, None, mb, None, None)[0]

        return jax.value_and_grad(mb_loss)(params)

    @jax.jit  # one program, not one per primitive and parameter shape
    def mean_grad_update(params, opt_state, grad_a, grad_b):
        g = jax.tree.map(lambda a, b: (a + b) / 2, grad_a, grad_b)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state

    params, opt_state = _copy(s["params"]), tx.init(s["params"])
    losses = []
    for perm in np.asarray(perms):
        for start in range(0, B, 2):
            pairs = [mb_loss_and_grad(params, perm[start + i : start + i + 1]) for i in range(2)]
            losses += [float(loss) for loss, _ in pairs]
            params, opt_state = mean_grad_update(params, opt_state, *(grad for _, grad in pairs))
    assert int(new_state.step) == 4
    assert out["sum"]["loss/total"].shape == (2, 2, 2)
    np.testing.assert_allclose(np.asarray(out["sum"]["loss/total"]).ravel(), losses, rtol=2e-5)
    chex.assert_trees_all_close(new_state.params, params, rtol=1e-4, atol=1e-6)
    assert np.asarray(out["epoch_ran"]).all()
    assert out["arrays"]["policy/ratio"].shape == (2, 2, 2, 1, L - 1)


@pytest.mark.slow
def test_early_stopping_skips_remaining_epochs(setup, rollout):
    """A KL target every epoch exceeds stops after the first epoch (target -1e9: 1 of 3 ran);
    one no epoch reaches runs all three (1e9). The target is a traced argument of one jitted
    update (it is only compared with the measured KL), so both cases share one program."""
    s = setup
    tx = optax.adam(1e-2)
    loss_fn = make_ppo_loss_fn(s["apply"], ratio_threshold=10.0, **LOSS_KW)

    @jax.jit
    def update(state, rollout, perms, target_kl):
        return make_ppo_update(
            loss_fn, tx, batch_size=B, mini_batch_size=2, gradient_accumulation_steps=1,
            early_stopping=True, target_kl=target_kl,
        )(state, rollout, perms)  # fmt: skip

    perms = jnp.tile(jnp.arange(B, dtype=jnp.int32), (3, 1))
    for target_kl, epochs_run in [(-1e9, 1), (1e9, 3)]:
        state = TrainState.create(_copy(s["params"]), tx, seed=0)
        new_state, out = update(state, rollout, perms, target_kl)
        ran = [True] * epochs_run + [False] * (3 - epochs_run)
        assert np.asarray(out["epoch_ran"]).tolist() == ran, target_kl
        assert int(new_state.step) == 2 * epochs_run, target_kl


def test_ratio_threshold_zeroes_loss_but_optimizer_steps(setup, rollout):
    s = setup
    tx = optax.sgd(1.0)
    loss_fn = make_ppo_loss_fn(s["apply"], ratio_threshold=0.5, **LOSS_KW)  # ratio 1 > 0.5
    traced = []

    def counted_loss_fn(*args):
        traced.append(1)
        return loss_fn(*args)

    update = make_ppo_update(
        counted_loss_fn, tx, batch_size=B, mini_batch_size=B, gradient_accumulation_steps=1,
        early_stopping=False, target_kl=1.0,
    )  # fmt: skip
    state = TrainState.create(_copy(s["params"]), tx, seed=0)
    new_state, out = jax.jit(update)(state, rollout, jnp.arange(B, dtype=jnp.int32)[None])
    # The epoch (forward and backward) is traced once: the early-stopping skip branch takes its
    # output shapes from that trace instead of tracing the epoch again.
    assert len(traced) == 1
    assert int(new_state.step) == 1
    assert float(out["sum"]["ratio_skipped"].sum()) == 1.0
    assert float(out["sum"]["loss/total"].sum()) == 0.0
    chex.assert_trees_all_equal(new_state.params, s["params"], strict=True)
