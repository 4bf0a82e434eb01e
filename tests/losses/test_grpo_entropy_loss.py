"""GRPO's entropy bonus at the loss level against TRL 1.16's own `_compute_loss` (entropy bonus
on, static or adaptive): loss and gradients w.r.t. the log-probs *and* the entropies for every
loss type, one optimizer step split into 1, 2 or 3 micro-batches; TRL's `policy_loss` and
`entropy_coef`; the adaptive controller's coefficients over several windows; and the gradient
the LM head gives its entropies (`token_logprobs(..., entropy_grad=True)`; see
`trl_reference.py` for how TRL's methods run here)."""

import collections
import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from trl import GRPOTrainer
from trl_reference import _ids, _OneProcess, grpo_args

from jaxrl.core.logprobs import token_logprobs
from jaxrl.core.state import TrainState
from jaxrl.core.step import make_train_step
from jaxrl.losses.grpo import (
    LOSS_TYPES,
    adaptive_entropy_coef,
    entropy_bonus_coef,
    grpo_loss,
    high_entropy_mask,
    masked_entropy,
)

TOL = dict(rtol=1e-5, atol=1e-6)
B, T, L_MAX = 6, 7, 9
TOKEN_NORMALISED = ("dapo", "cispo", "vespo")
EPS_HIGH = {"cispo": 1.2}


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.array([7, 3, 5, 0, 6, 1])  # unequal token counts per micro-batch
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    logps = (-np.abs(rng.normal(size=(B, T))) - 0.05).astype(np.float32)
    old = (logps + 0.35 * rng.normal(size=(B, T))).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    entropies = (np.abs(rng.normal(size=(B, T))) + 0.1).astype(np.float32)
    return logps, old, adv, mask, entropies


class TRLRun:
    """One TRL `GRPOTrainer` whose `_compute_loss` is called micro-batch by micro-batch (its
    controller state persists across calls, as in training)."""

    def __init__(self, loss_type, accum, *, coef, adaptive=False, quantile=1.0, **controller):
        args = grpo_args(
            steps_per_generation=accum,
            entropy_target=controller.get("target", 0.2),
            entropy_coef_delta=controller.get("delta", 0.005),
            entropy_coef_min=controller.get("coef_min", 0.0),
            entropy_coef_max=controller.get("coef_max", 1.0),
        )
        t = object.__new__(GRPOTrainer)
        t.model = types.SimpleNamespace(training=True, is_gradient_checkpointing=False)
        t.accelerator = _OneProcess()
        t._metrics = {"train": collections.defaultdict(list)}
        t.aux_loss_enabled = False
        attrs = dict(
            args=args,
            loss_type=loss_type,
            importance_sampling_level="token",
            beta=0.0,
            epsilon_low=0.2,
            epsilon_high=EPS_HIGH.get(loss_type, 0.28),
            max_completion_length=L_MAX,
            top_entropy_quantile=quantile,
            off_policy_mask_threshold=None,
            use_vllm=False,
            vllm_importance_sampling_correction=False,
            current_gradient_accumulation_steps=accum,
            # TRL's __init__ (grpo_trainer.py ~846-853)
            entropy_coef=coef,
            use_adaptive_entropy=adaptive,
            _entropy_bonus_enabled=coef != 0.0 or adaptive,
            _last_world_entropy=float("inf"),
            _entropy_window_stats=None,
        )
        for k, v in attrs.items():
            setattr(t, k, v)
        self.trainer = t

    def micro(self, logps, old, adv, mask, entropies, *, num_items, sync):
        lp = torch.tensor(logps, requires_grad=True)
        ent = torch.tensor(entropies, requires_grad=True)
        self.trainer._get_per_token_logps_and_entropies = lambda *a, **k: (lp, ent, None)
        self.trainer.accelerator.sync_gradients = sync
        inputs = _ids(mask)
        inputs["advantages"] = torch.tensor(adv)
        inputs["num_items_in_batch"] = torch.tensor(float(num_items))
        inputs["old_per_token_logps"] = torch.tensor(old)
        loss = self.trainer._compute_loss(None, inputs)
        loss.backward()
        return float(loss.detach()), lp.grad.numpy(), ent.grad.numpy()

    def step(self, logps, old, adv, mask, entropies, num_micro):
        """One optimizer step: the summed micro-batch losses and the gradients."""
        size = B // num_micro
        loss, g_lp, g_ent = 0.0, [], []
        for i in range(num_micro):
            rows = slice(i * size, (i + 1) * size)
            li, gl, ge = self.micro(
                logps[rows], old[rows], adv[rows], mask[rows], entropies[rows],
                num_items=mask.sum(), sync=i == num_micro - 1,
            )  # fmt: skip
            loss += li
            g_lp.append(gl)
            g_ent.append(ge)
        return loss, np.concatenate(g_lp), np.concatenate(g_ent)

    @property
    def metrics(self):
        return self.trainer._metrics["train"]


@functools.cache
def _steps(loss_type, num_micro, quantile):
    """One jitted program per loss type, accumulation split and entropy quantile running
    `make_train_step` (SGD, lr 1) once per coefficient in `coefs`, whose params are offsets on the
    log-probs and the entropies, so each update is minus the gradient w.r.t. both. A coefficient is
    a traced argument (the adaptive test's six coefficients share one program); a None one is the
    bonus off (its own trace: `grpo_loss(entropy_coef=None)`). Several steps in one program compile
    once instead of once each. The count of a token-normalised type is the generation batch's
    tokens / steps_per_generation, as `GRPOTrainer` passes it."""
    tx = optax.sgd(1.0)

    def loss_fn_for(coef, token_count):
        def loss_fn(params, state, mb, rng, extras):
            lp = mb["logps"] + params["lp"][mb["rows"]]
            ent = mb["ent"] + params["ent"][mb["rows"]]
            emask = high_entropy_mask(ent, mb["mask"], quantile) if quantile < 1.0 else None
            loss_sum, aux = grpo_loss(
                lp,
                mb["adv"],
                mb["mask"],
                old_per_token_logps_BT=mb["old"],
                loss_type=loss_type,
                epsilon_high=EPS_HIGH.get(loss_type, 0.28),
                max_completion_length=L_MAX,
                entropies_BT=ent,
                entropy_mask_BT=emask,
                entropy_coef=coef,
                token_count=token_count if loss_type in TOKEN_NORMALISED else None,
            )
            return loss_sum, (aux, extras)

        return loss_fn

    def steps(state, batch, token_count, coefs):
        out = []
        for coef in coefs:
            new_state, metrics = make_train_step(loss_fn_for(coef, token_count), tx)(state, batch)
            out.append((jax.tree.map(jnp.negative, new_state.params), metrics))
        return out

    return jax.jit(steps)


def _ours(logps, old, adv, mask, entropies, num_micro, *, loss_type, coefs, quantile=1.0):
    """`(loss, grad lp, grad entropies, metrics)` of one optimizer step per coefficient."""
    batch = dict(logps=logps, old=old, adv=adv, mask=mask, ent=entropies, rows=np.arange(B))
    batch = {
        k: jnp.asarray(v).reshape(num_micro, B // num_micro, *v.shape[1:]) for k, v in batch.items()
    }
    tx = optax.sgd(1.0)
    params = {"lp": jnp.zeros((B, T)), "ent": jnp.zeros((B, T))}
    state = TrainState.create(params, tx, seed=0)
    token_count = np.float32(mask.sum() / num_micro)
    out = jax.device_get(_steps(loss_type, num_micro, quantile)(state, batch, token_count, coefs))
    return [(float(m["loss"]), g["lp"], g["ent"], m) for g, m in out]


FAST = [(lt, 2) for lt in LOSS_TYPES] + [("dapo", 1), ("grpo", 1), ("dapo", 3), ("grpo", 3)]
CASES = [
    c if c in FAST else pytest.param(*c, marks=pytest.mark.slow)
    for c in [(lt, n) for lt in LOSS_TYPES for n in (1, 2, 3)]
]


@pytest.mark.parametrize(("loss_type", "num_micro"), CASES)
def test_static_bonus_matches_trl(loss_type, num_micro):
    """Loss, both gradients and `policy_loss` equal TRL's for every loss type and accumulation
    split (micro-batches with unequal token counts)."""
    logps, old, adv, mask, ent = _inputs()
    coef = 0.3
    trl = TRLRun(loss_type, num_micro, coef=coef)
    t_loss, t_glp, t_gent = trl.step(logps, old, adv, mask, ent, num_micro)
    # The step with the bonus and the step without it (coef None), in one program.
    (loss, glp, gent, metrics), (no_bonus, *_) = _ours(
        logps, old, adv, mask, ent, num_micro, loss_type=loss_type, coefs=(coef, None)
    )
    np.testing.assert_allclose(loss, t_loss, **TOL)
    np.testing.assert_allclose(glp, t_glp, **TOL)
    np.testing.assert_allclose(gent, t_gent, **TOL)
    assert np.abs(t_gent).max() > 1e-2  # the bonus has a gradient to compare
    # TRL's logged metric: the mean of the per-micro-batch values. A token-normalised type's
    # is each micro-batch's share of the step's loss, hence the step's / accumulation steps
    # (GRPOTrainer multiplies that metric's count by them).
    policy_loss = metrics["policy_loss"] / (num_micro if loss_type in TOKEN_NORMALISED else 1)
    np.testing.assert_allclose(policy_loss, np.mean(trl.metrics["policy_loss"]), **TOL)
    assert abs(no_bonus - metrics["loss"]) > 1e-3  # the bonus changes the loss
    if loss_type not in TOKEN_NORMALISED:
        np.testing.assert_allclose(metrics["policy_loss"], no_bonus, **TOL)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo"])
def test_bonus_follows_the_top_entropy_mask(loss_type):
    logps, old, adv, mask, ent = _inputs(1)
    trl = TRLRun(loss_type, 2, coef=0.5, quantile=0.4)
    t_loss, t_glp, t_gent = trl.step(logps, old, adv, mask, ent, 2)
    ((loss, glp, gent, _),) = _ours(
        logps, old, adv, mask, ent, 2, loss_type=loss_type, coefs=(0.5,), quantile=0.4
    )
    np.testing.assert_allclose(loss, t_loss, **TOL)
    np.testing.assert_allclose(glp, t_glp, **TOL)
    np.testing.assert_allclose(gent, t_gent, **TOL)
    # Only the high-entropy tokens get the bonus's gradient.
    assert ((np.abs(gent) > 0) & (mask > 0)).sum() < (mask > 0).sum()


def test_masked_entropy_is_the_mean_over_the_loss_tokens():
    ent = jnp.array([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    emask = jnp.array([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]])

    @jax.jit  # one program for the four means, not one per primitive and shape
    def means(ent, mask, emask, example_mask):
        return (
            masked_entropy(ent, mask),
            masked_entropy(ent, mask, entropy_mask_BT=emask),
            masked_entropy(ent, mask, example_mask_B=example_mask),
            masked_entropy(ent, jnp.zeros_like(mask)),
        )

    plain, top, example, empty = map(float, means(ent, mask, emask, jnp.array([1.0, 0.0])))
    assert plain == pytest.approx(2.0)
    assert top == pytest.approx(2.5)
    assert example == 1.5
    assert empty == 0.0  # TRL's clamp(min=1)
    with pytest.raises(ValueError, match="entropies_BT"):  # raised while tracing: no compiles
        jax.eval_shape(lambda: grpo_loss(ent, jnp.ones(2), mask, entropy_coef=0.1))


def test_adaptive_controller_matches_trl_over_several_windows():
    """TRL's controller over 6 optimizer steps of 2 micro-batches: the coefficient each step
    applies (gated by the previous step's window entropy; none on the first), the loss, and
    the coefficient logged after each step, with the window entropy token-weighted over both
    micro-batches. The target splits the windows' entropies, so both branches and the gate
    are exercised; the clamp binds at the top."""
    target, delta, cmin, cmax = 1.0, 0.3, 0.05, 0.7
    controller = dict(
        entropy_target=target,
        entropy_coef_delta=delta,
        entropy_coef_min=cmin,
        entropy_coef_max=cmax,
    )
    trl = TRLRun(
        "dapo", 2, coef=0.2, adaptive=True, target=target, delta=delta, coef_min=cmin,
        coef_max=cmax,
    )  # fmt: skip
    coef, last = jnp.float32(0.2), jnp.float32(jnp.inf)
    applied, branches = [], set()
    for step, scale in enumerate([0.5, 0.6, 2.0, 0.4, 0.3, 1.5]):
        logps, old, adv, mask, ent = _inputs(10 + step)
        ent = ent * scale
        t_loss, _, t_gent = trl.step(logps, old, adv, mask, ent, 2)
        apply = entropy_bonus_coef(coef, last, target)
        applied.append(float(apply))
        ((loss, _, gent, _),) = _ours(
            logps, old, adv, mask, ent, 2, loss_type="dapo", coefs=(apply,)
        )
        np.testing.assert_allclose(loss, t_loss, **TOL)
        np.testing.assert_allclose(gent, t_gent, **TOL)
        window = float((ent * mask).sum() / mask.sum())
        branches.add(window <= target)
        coef = adaptive_entropy_coef(coef, window, **controller)
        last = jnp.float32(window)
        np.testing.assert_allclose(float(coef), trl.metrics["entropy_coef"][-1], rtol=1e-6)
        assert trl.trainer._last_world_entropy == pytest.approx(window, rel=1e-6)
    assert applied[0] == 0.0  # first step: no measurement yet (+inf), gated off
    assert branches == {True, False}
    assert 0.0 in applied[1:] and any(a > 0 for a in applied)
    assert cmax in [pytest.approx(c, abs=1e-7) for c in trl.metrics["entropy_coef"]]


def test_controller_edge_cases_as_trl():
    kw = dict(
        entropy_target=0.2, entropy_coef_delta=0.1, entropy_coef_min=0.0, entropy_coef_max=1.0
    )
    assert float(adaptive_entropy_coef(0.95, 0.2, **kw)) == pytest.approx(1.0)  # <= target: up
    assert float(adaptive_entropy_coef(0.05, 0.21, **kw)) == 0.0  # down, clamped at min
    assert float(adaptive_entropy_coef(0.5, math.nan, **kw)) == pytest.approx(0.4)  # NaN: down
    assert float(entropy_bonus_coef(0.5, math.inf, 0.2)) == 0.0
    assert float(entropy_bonus_coef(0.5, 0.2, 0.2)) == 0.5  # at the target: applied
    assert float(entropy_bonus_coef(0.5, math.nan, 0.2)) == 0.0


@pytest.mark.parametrize(
    ("temperature", "chunk", "dtype"),
    [(1.0, 7, "float32"), (0.7, 3, "float32"), (0.7, 4, "bfloat16")],
)
def test_head_entropy_gradient_is_the_entropys_gradient(temperature, chunk, dtype):
    """The head's entropies with `entropy_grad`: the gradient w.r.t. the hidden states and the
    unembedding is autodiff's of the softmax entropy of the (dtype-rounded) logits /
    temperature, for chunks that do not divide T."""
    rng = np.random.default_rng(0)
    Bh, Th, D, V = 3, 7, 5, 11
    h = jnp.asarray(rng.normal(size=(Bh, Th, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, V)), dtype)
    g = jnp.asarray(rng.normal(size=(Bh, Th)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, size=(Bh, Th)))

    def reference(h, w):
        logits = jnp.dot(h.astype(w.dtype), w, preferred_element_type=jnp.float32)
        logits = logits.astype(w.dtype).astype(jnp.float32) / temperature
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.sum(jnp.exp(logp) * logp, axis=-1)

    def ours(h, w):
        _, stats = token_logprobs(
            h,
            w,
            targets,
            chunk_size=chunk,
            with_stats=True,
            temperature=temperature,
            entropy_grad=True,
        )
        return stats["entropy"]

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    f = lambda fn: lambda h, w: jnp.sum(fn(h, w) * g)  # noqa: E731

    @jax.jit  # the entropies and both gradients in one program instead of three
    def run(h, w, h32, w32):
        grad = lambda fn, *a: jax.grad(f(fn), argnums=(0, 1))(*a)  # noqa: E731
        return (ours(h, w), reference(h, w)), grad(ours, h, w), grad(reference, h32, w32)

    entropies, got, want = run(h, w, h.astype(jnp.float32), w.astype(jnp.float32))
    np.testing.assert_allclose(*entropies, **tol)
    assert got[1].dtype == w.dtype
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), b, **tol)
    assert float(jnp.abs(want[0]).max()) > 0.1
