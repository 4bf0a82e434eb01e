"""algos.ppo: the rollout forward (whole, and in forward batches) and TRL's batched forward pass
against full-logit references; the jitted PPO update (epochs x backward batches x accumulation
scans) against an unrolled Python reference, early stopping and the ratio_threshold skip; the
clipped policy + value loss, the rewards and GAE advantages built from a PPOConfig against NumPy
hand computations; the learning-rate schedule and the LoRA loss's merge with the frozen base."""

from __future__ import annotations

from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import transformers
from flax import nnx

from jaxrl import AutoModelForCausalLMWithValueHead
from jaxrl.algos import ppo
from jaxrl.algos.ppo import make_ppo_loss_fn, make_ppo_update, make_rollout_forward
from jaxrl.core import rl
from jaxrl.core.state import TrainState
from jaxrl.trainers.ppo_config import PPOConfig

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
        graphdef=graphdef,
        ref_graphdef=ref_graphdef,
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


@pytest.mark.slow
def test_rollout_in_forward_batches_equals_one_forward(setup):
    s = setup
    config = PPOConfig(batch_size=B, mini_batch_size=2, kl_penalty="abs")
    got = jax.jit(ppo.make_rollout(config, s["apply"], s["apply_ref"]))(
        s["params"], s["ref_params"], s["ids"], s["attn"]
    )
    whole = jax.jit(make_rollout_forward(s["apply"], s["apply_ref"], kl_kind="abs"))
    want = whole(s["params"], s["ref_params"], s["ids"], s["attn"])
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-5, err_msg=k)
    np.testing.assert_allclose(want["kl"], jnp.abs(want["logprobs"] - want["ref_logprobs"]))


@pytest.mark.slow
def test_batched_forward_of_value_head_model_and_plain_lm(setup):
    s = setup
    logps, logits, values = ppo.batched_forward(
        s["graphdef"], s["params"], s["ids"], s["attn"], True
    )
    full_logits, full_values = jax.jit(lambda p: s["apply"](p)(s["ids"], s["attn"]))(s["params"])
    want = jnp.take_along_axis(
        jax.nn.log_softmax(full_logits[:, :-1], -1), s["ids"][:, 1:, None], -1
    )[..., 0]
    np.testing.assert_allclose(logps, want, atol=1e-5)
    np.testing.assert_allclose(values, full_values[:, :-1], atol=1e-6)
    np.testing.assert_allclose(logits, full_logits[:, :-1], atol=1e-5)
    ref_logps, ref_logits, ref_values = ppo.batched_forward(
        s["ref_graphdef"], s["ref_params"], s["ids"], s["attn"], False
    )
    assert ref_logits is None and ref_values is None
    ref_full = jax.jit(lambda p: s["apply_ref"](p)(s["ids"], s["attn"]))(s["ref_params"])
    ref_want = jnp.take_along_axis(
        jax.nn.log_softmax(ref_full[:, :-1], -1), s["ids"][:, 1:, None], -1
    )[..., 0]
    np.testing.assert_allclose(ref_logps, ref_want, atol=1e-5)


# ------------------------------------------------------------------ hand computations (NumPy)
class _TablePolicy:
    """A value-head policy whose per-token log-probs, values and entropies are its params."""

    def __init__(self, params):
        self.p = params

    def token_logprobs_and_values(self, ids, attn, chunk_size=None, with_entropy=False):
        assert with_entropy
        return self.p["logp"], self.p["v"], self.p["ent"]


def _table(seed=0, b=2, t=5):
    """Rollout rows and a policy table whose ratios and value predictions leave both clip
    ranges on some tokens."""
    rng = np.random.default_rng(seed)
    old = rng.uniform(-3, -1, (b, t)).astype(np.float32)
    values = rng.normal(size=(b, t)).astype(np.float32)
    mask = np.ones((b, t), np.float32)
    mask[0, :2] = 0
    mask[1, 4:] = 0
    mb = {
        "input_ids": np.zeros((b, t + 1), np.int32),
        "attention_mask": np.ones((b, t + 1), np.int32),
        "old_logprobs": old,
        "values": values,
        "mask": mask,
        "advantages": rng.normal(size=(b, t)).astype(np.float32),
        "returns": rng.normal(size=(b, t)).astype(np.float32),
    }
    params = {
        "logp": jnp.asarray(old + rng.uniform(-0.6, 0.6, (b, t)), jnp.float32),
        "v": jnp.asarray(values + rng.uniform(-0.6, 0.6, (b, t)), jnp.float32),
        "ent": jnp.asarray(rng.uniform(0, 2, (b, t)), jnp.float32),
    }
    return params, mb


def _np_ppo(logp, vpred, mb, c):
    """TRL v0.7.2 `loss` by hand: `(pg_loss, vf_loss, pg_clipfrac, vf_clipfrac)`."""
    m = mb["mask"].astype(np.float64)
    mean = lambda x: (x * m).sum() / m.sum()  # noqa: E731
    old, v, A, R = (
        mb[k].astype(np.float64) for k in ("old_logprobs", "values", "advantages", "returns")
    )
    logp, vpred = np.asarray(logp, np.float64), np.asarray(vpred, np.float64)
    vclip = np.clip(vpred, v - c.cliprange_value, v + c.cliprange_value)
    vf1, vf2 = (vpred - R) ** 2, (vclip - R) ** 2
    r = np.exp(logp - old)
    pg1, pg2 = -A * r, -A * np.clip(r, 1 - c.cliprange, 1 + c.cliprange)
    return (
        mean(np.maximum(pg1, pg2)),
        0.5 * mean(np.maximum(vf1, vf2)),
        mean(pg2 > pg1),
        mean(vf2 > vf1),
    )


def test_loss_is_the_clipped_policy_plus_clipped_value_loss():
    params, mb = _table()
    c = PPOConfig(cliprange=0.2, cliprange_value=0.3, vf_coef=0.25)
    loss, (aux, extras) = ppo.make_loss(c, _TablePolicy)(params, None, mb, None, "extras")
    pg, vf, pg_clipfrac, vf_clipfrac = _np_ppo(params["logp"], params["v"], mb, c)
    assert 0 < pg_clipfrac < 1 and 0 < vf_clipfrac < 1  # both clips act on some tokens
    np.testing.assert_allclose(float(loss), pg + 0.25 * vf, rtol=1e-5)
    np.testing.assert_allclose(float(aux["sum"]["loss/policy"]), pg, rtol=1e-5)
    np.testing.assert_allclose(float(aux["sum"]["loss/value"]), vf, rtol=1e-5)
    np.testing.assert_allclose(float(aux["sum"]["policy/clipfrac"]), pg_clipfrac, rtol=1e-6)
    np.testing.assert_allclose(float(aux["sum"]["val/clipfrac"]), vf_clipfrac, rtol=1e-6)
    m = mb["mask"]
    want_entropy = float((np.asarray(params["ent"]) * m).sum() / m.sum())
    np.testing.assert_allclose(float(aux["sum"]["policy/entropy"]), want_entropy, rtol=1e-6)
    assert float(aux["count"]["loss"]) == 1.0 and extras == "extras"
    assert aux["arrays"]["policy/ratio"].shape == mb["mask"].shape


def test_lora_loss_merges_the_frozen_base_and_differentiates_only_the_trained_params():
    params, mb = _table(1)
    c = PPOConfig()
    trained = nnx.State({"logp": params["logp"], "v": params["v"]})
    state = SimpleNamespace(frozen={"base": nnx.State({"ent": params["ent"]})})
    peft_loss = ppo.make_loss(c, _TablePolicy, peft=True)
    loss, (aux, _) = peft_loss(trained, state, mb, None, None)
    want, (want_aux, _) = ppo.make_loss(c, _TablePolicy)(params, None, mb, None, None)
    assert float(loss) == float(want)
    assert float(aux["sum"]["policy/entropy"]) == float(want_aux["sum"]["policy/entropy"])
    grads = jax.grad(lambda p: peft_loss(p, state, mb, None, None)[0])(trained)
    assert set(grads.keys()) == {"logp", "v"}
    assert float(jnp.abs(grads["logp"]).sum()) > 0


def test_policy_and_value_loss_takes_the_entropy_from_the_logits():
    params, mb = _table(2)
    c = PPOConfig(cliprange=0.15, cliprange_value=0.2, vf_coef=0.5)
    logits = np.random.default_rng(3).normal(size=(*mb["mask"].shape, 6)).astype(np.float32)
    pg, vf, stats = ppo.policy_and_value_loss(
        c, mb["old_logprobs"], mb["values"], logits, params["v"], params["logp"], mb["mask"],
        mb["advantages"], mb["returns"],
    )  # fmt: skip
    want_pg, want_vf, _, _ = _np_ppo(params["logp"], params["v"], mb, c)
    np.testing.assert_allclose(float(pg), want_pg, rtol=1e-5)
    np.testing.assert_allclose(float(vf), 0.5 * want_vf, rtol=1e-5)
    z = logits.astype(np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    entropy = -(np.exp(logp) * logp).sum(-1)
    m = mb["mask"]
    np.testing.assert_allclose(
        float(stats["policy/entropy"]), (entropy * m).sum() / m.sum(), rtol=1e-5
    )
    assert "ratio_skipped" not in stats


def test_rewards_clip_the_scores_and_add_them_at_the_last_response_token():
    c = PPOConfig(score_clip=1.0)
    kl = np.random.default_rng(4).normal(size=(3, 4)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 0, 0]], np.float32)
    scores = np.array([2.5, -0.4, -3.0], np.float32)
    moments = rl.running_moments_init()
    scaled, _, rewards, non_score = ppo.make_rewards(c)(scores, moments, kl, mask, 0.2)
    np.testing.assert_allclose(scaled, [1.0, -0.4, -1.0])
    want = -0.2 * kl.astype(np.float64)
    np.testing.assert_allclose(non_score, want, rtol=1e-6)
    for b, last in enumerate([2, 3, 1]):
        want[b, last] += [1.0, -0.4, -1.0][b]
    np.testing.assert_allclose(rewards, want, rtol=1e-6, atol=1e-7)


def test_advantages_are_whitened_gae_with_the_configs_gamma_and_lambda():
    gamma, lam = 0.9, 0.8
    c = PPOConfig(gamma=gamma, lam=lam)
    rng = np.random.default_rng(5)
    values = rng.normal(size=(2, 4)).astype(np.float32)
    rewards = rng.normal(size=(2, 4)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)
    got_values, adv, returns = ppo.make_advantages(c)(values, rewards, mask)
    v, r = values.astype(np.float64) * mask, rewards.astype(np.float64) * mask
    raw = np.zeros_like(v)
    for b in range(2):
        last = 0.0
        for t in reversed(range(4)):
            next_v = v[b, t + 1] if t + 1 < 4 else 0.0
            last = r[b, t] + gamma * next_v - v[b, t] + gamma * lam * last
            raw[b, t] = last
    n = mask.sum()
    mean = (raw * mask).sum() / n
    var = (((raw - mean) ** 2) * mask).sum() / n * n / (n - 1)
    np.testing.assert_allclose(got_values, v, rtol=1e-6)
    np.testing.assert_allclose(returns, raw + v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adv, (raw - mean) / np.sqrt(var + 1e-8), rtol=1e-5, atol=1e-6)


def test_with_learning_rate_sets_every_injected_rate():
    params = {"w": jnp.ones(3)}
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    )
    opt_state = ppo.with_learning_rate(tx.init(params), jnp.float32(0.025))
    assert float(opt_state[1].hyperparams["learning_rate"]) == pytest.approx(0.025)
    nested = ppo.with_learning_rate([tx.init(params)], 0.5)  # lists are walked too
    assert float(nested[0][1].hyperparams["learning_rate"]) == 0.5


@pytest.mark.parametrize("scheduler, lr", [(None, 1.0), (lambda step: 0.1 * (step + 1), 0.4)])
def test_optimise_applies_the_scheduled_learning_rate(scheduler, lr):
    """One PPO step of one backward batch with SGD: params move by `-lr x grad`, `lr` the
    scheduler's at `extras["ppo_step"]` (3), or the optimizer's own without a scheduler."""
    params, mb = _table(6)
    c = PPOConfig(batch_size=2, mini_batch_size=2, gradient_accumulation_steps=1)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)
    loss_fn = ppo.make_loss(c, _TablePolicy)
    optimise = jax.jit(ppo.make_optimise(c, loss_fn, tx, scheduler))
    state = TrainState.create(params, tx, seed=0, extras={"ppo_step": jnp.int32(3)})
    perms = jnp.arange(2, dtype=jnp.int32)[None]
    grads = jax.grad(lambda p: loss_fn(p, None, mb, None, None)[0])(params)
    new_state, out = optimise(state, mb, perms)
    assert float(new_state.opt_state.hyperparams["learning_rate"]) == pytest.approx(lr)
    for k in params:
        want = np.asarray(params[k]) - lr * np.asarray(grads[k])
        np.testing.assert_allclose(new_state.params[k], want, rtol=1e-5, atol=1e-6, err_msg=k)
    assert float(jnp.abs(grads["logp"]).sum()) > 0 and np.asarray(out["epoch_ran"]).all()
