"""GRPOTrainer's entropy bonus as TRL 1.16 (`entropy_coef`, `use_adaptive_entropy`): one step's
loss and gradients equal TRL's formula recomputed by hand on the step's rollout (two loss types,
accumulation 1 and 2); the adaptive coefficient follows TRL's controller step by step (gated off
on the first step, window entropy over both micro-batches); evaluation applies the bonus but
never moves the controller; kill-and-resume is bit-exact (the controller lives in the train
state); config validation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from onpolicy_utils import RecordingReward, prompt_rows
from trainer_utils import base_args, killed_after_checkpoint, train_logs

from jaxrl import models
from jaxrl.algos.rollout import completion_logprobs, completion_logprobs_and_entropy
from jaxrl.config import ConfigError
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig

ENTROPY_FIELDS = (
    "entropy_coef",
    "use_adaptive_entropy",
    "entropy_coef_min",
    "entropy_coef_max",
    "entropy_coef_delta",
    "entropy_target",
)


def make(model_dir, tokenizer, tmp_path, callbacks=None, optimizers=(None, None), **kw):
    settings = dict(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=4,
        max_steps=1,
    )
    args = GRPOConfig(**base_args(tmp_path, **{**settings, **kw}))
    return GRPOTrainer(
        model_dir,
        reward_funcs=RecordingReward(),
        args=args,
        train_dataset=prompt_rows(16),
        eval_dataset=prompt_rows(4, "test"),
        processing_class=tokenizer,
        callbacks=callbacks,
        optimizers=optimizers,
    )


def _head(trainer, params, rows):
    """Completion log-probs and entropies `[b, C]` from the full softmax (plain autodiff)."""
    model = trainer.apply_model(params)
    ids, cm = rows["input_ids"], rows["completion_mask"]
    C = cm.shape[1]
    P = ids.shape[1] - C
    h = model.hidden_states(ids, rows["attention_mask"])[:, P - 1 : P + C - 1]
    logits = jnp.dot(h, model.unembed_weight(), preferred_element_type=jnp.float32)
    logp_all = jax.nn.log_softmax(logits / trainer.args.temperature, axis=-1)
    logps = jnp.take_along_axis(logp_all, ids[:, P:, None], axis=-1)[..., 0]
    return logps, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


def trl_step(trainer, params, rollout, *, loss_type, coef, accum):
    """TRL 1.16's `_compute_loss` summed over the step's micro-batches (on-policy, one
    process, steps_per_generation == accumulation): `(loss, [policy_loss per micro-batch])`."""
    a = trainer.args
    n = rollout["input_ids"].shape[0] // accum
    total, policy = 0.0, []
    for j in range(accum):
        rows = {k: v[j * n : (j + 1) * n] for k, v in rollout.items()}
        logps, H = _head(trainer, params, rows)
        m = rows["completion_mask"].astype(jnp.float32)
        adv = rows["advantages"][:, None]
        ratio = jnp.exp(logps - jax.lax.stop_gradient(logps))
        eps_high = a.epsilon if a.epsilon_high is None else a.epsilon_high
        clipped = jnp.clip(ratio, 1 - a.epsilon, 1 + eps_high)
        per_token = -jnp.minimum(ratio * adv, clipped * adv)
        if loss_type == "dapo":  # num_items_in_batch / processes x accum / steps_per_generation
            loss = jnp.sum(per_token * m) / rows["num_items_in_batch"][0]
            policy.append(loss)
        else:  # grpo: sequence means, batch mean, / accumulation
            seq = jnp.sum(per_token * m, -1) / jnp.maximum(jnp.sum(m, -1), 1.0)
            policy.append(jnp.mean(seq))
            loss = jnp.mean(seq) / accum
        bonus = coef * jnp.sum(H * m) / jnp.maximum(jnp.sum(m), 1.0) / accum
        total = total + loss - bonus
    return total, policy


CASES = [("dapo", 2), ("grpo", 1)] + [
    pytest.param(*c, marks=pytest.mark.slow) for c in (("dapo", 1), ("grpo", 2))
]


@pytest.mark.parametrize(("loss_type", "accum"), CASES)
def test_static_bonus_loss_and_gradients_equal_trls(
    hf_model_dir, tokenizer, tmp_path, loss_type, accum
):
    coef = 0.5
    trainer = make(
        hf_model_dir, tokenizer, tmp_path, optimizers=(optax.sgd(1.0), None),
        loss_type=loss_type, entropy_coef=coef, gradient_accumulation_steps=accum,
        per_device_train_batch_size=8 // accum, max_grad_norm=0.0,
    )  # fmt: skip
    trainer._ensure_state()
    # A host copy (the state is donated); numpy, so that neither the copy nor the subtraction
    # below compiles one program per leaf shape (same float32 values as jnp's).
    p0 = jax.tree.map(np.array, trainer.train_state.params)
    trainer.train()
    (log,) = train_logs(trainer)
    rollout = jax.device_get(trainer.rollout)
    assert "old_logps" not in rollout and rollout["input_ids"].shape[0] == 8

    def loss_fn(p, c):
        return trl_step(trainer, p, rollout, loss_type=loss_type, coef=c, accum=accum)

    # Jitted (one program, the coefficient an argument): op by op, each of the model's
    # operations would compile on its own, for both coefficients.
    value_and_grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (want_loss, policy), want = value_and_grad(p0, coef)
    got = jax.tree.map(lambda a, b: a - np.asarray(b), p0, trainer.train_state.params)  # SGD, lr 1
    assert log["loss"] == pytest.approx(float(want_loss), rel=1e-5, abs=1e-6)
    assert log["policy_loss"] == pytest.approx(float(np.mean(policy)), rel=1e-5, abs=1e-6)
    assert log["entropy_coef"] == pytest.approx(coef)
    # numpy from here on (the same float32 values): jnp's abs/subtract/max compiled one program
    # per primitive and leaf shape.
    want = jax.device_get(want)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(want))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * scale)
    # Not vacuous: the bonus moves the gradient well beyond the tolerance.
    _, no_bonus = jax.device_get(value_and_grad(p0, 0.0))
    diff = max(
        float(np.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(no_bonus), strict=True)
    )
    assert diff > 0.02 * scale


ADAPTIVE = dict(
    use_adaptive_entropy=True,
    entropy_coef=0.5,
    entropy_coef_delta=0.3,
    entropy_coef_min=0.0,
    entropy_coef_max=1.0,
    # The tiny model's entropy starts near 2.75 and falls below 2.69 by step 5 at this lr.
    entropy_target=2.69,
    learning_rate=1e-2,
    max_steps=6,
    per_device_eval_batch_size=4,
    # For the resume check: a kill right after step 5 (saving does not change the run).
    save_strategy="steps",
    save_steps=5,
)


@pytest.fixture(scope="module")
def adaptive_run(hf_model_dir, tokenizer, tmp_path_factory):
    trainer = make(hf_model_dir, tokenizer, tmp_path_factory.mktemp("adaptive"), **ADAPTIVE)
    trainer.train()
    return trainer


def test_adaptive_controller_eval_and_resume(adaptive_run, hf_model_dir, tokenizer, tmp_path):
    """The adaptive run's three checks in one test, so that the run is built once (as a module
    fixture shared by several tests, xdist ran it on both workers): the controller follows
    TRL's step by step, then evaluation applies the bonus but never moves it (evaluate() runs
    after the controller check, on the trained state, as before), then kill-and-resume from the
    run's step-5 checkpoint is bit-exact (evaluate() moved no state, as the eval check
    asserts, so the run's final extras are still those of its training)."""
    check_adaptive_coefficient_follows_trls_controller(adaptive_run)
    check_eval_applies_the_bonus_but_never_moves_the_controller(adaptive_run)
    check_resume_is_bit_exact(adaptive_run, hf_model_dir, tokenizer, tmp_path)


def check_adaptive_coefficient_follows_trls_controller(adaptive_run):
    """Each step applies the coefficient the previous step left, gated to 0 when that step's
    entropy exceeded the target (+inf before the first step), then moves it by delta from its
    own window entropy, the token-weighted entropy of both micro-batches (the logged
    `entropy`, which jaxrl reduces over the whole step)."""
    a = adaptive_run.args
    coef, last = a.entropy_coef, math.inf
    applied, branches = [], []
    logs = train_logs(adaptive_run)
    assert [x["step"] for x in logs] == list(range(1, 7))
    for log in logs:
        apply = coef if last <= a.entropy_target else 0.0
        applied.append(apply)
        bonus = 2 * log["policy_loss"] - log["loss"]  # dapo, 2 micro-batches: policy_loss / 2
        if apply == 0.0:
            assert bonus == pytest.approx(0.0, abs=1e-6)
        else:  # coef x the mean of the two micro-batches' entropies
            assert bonus / apply == pytest.approx(log["entropy"], rel=1e-2)
        H = log["entropy"]
        branches.append(H <= a.entropy_target)
        if H <= a.entropy_target:
            coef = min(coef + a.entropy_coef_delta, a.entropy_coef_max)
        else:
            coef = max(coef - a.entropy_coef_delta, a.entropy_coef_min)
        last = H
        assert log["entropy_coef"] == pytest.approx(coef, abs=1e-6), log["step"]
    assert applied[0] == 0.0  # TRL's first step: no measurement yet
    assert set(branches) == {True, False} and any(applied)
    assert a.entropy_coef_min in [x["entropy_coef"] for x in logs]  # the clamp binds
    ctrl = jax.device_get(adaptive_run.train_state.extras["entropy_control"])
    assert ctrl["entropy_coef"] == pytest.approx(logs[-1]["entropy_coef"], abs=1e-7)
    assert ctrl["last_world_entropy"] == pytest.approx(logs[-1]["entropy"], rel=1e-6)
    assert ctrl["micro_steps"] == 0 and not ctrl["window"].any()


def check_eval_applies_the_bonus_but_never_moves_the_controller(adaptive_run):
    trainer = adaptive_run
    a = trainer.args
    before = jax.device_get(trainer.train_state.extras)
    assert before["entropy_control"]["last_world_entropy"] <= a.entropy_target  # gate open
    metrics = trainer.evaluate()
    after = jax.device_get(trainer.train_state.extras)
    jax.tree.map(np.testing.assert_array_equal, before, after)
    coef = float(before["entropy_control"]["entropy_coef"])
    assert coef > 0
    # TRL's eval logs `policy_loss` (each batch's, averaged over the batches) but not
    # `entropy_coef`; each batch's loss is its policy loss - coef x its mean entropy.
    assert "eval_entropy_coef" not in metrics
    bonus = metrics["eval_policy_loss"] - metrics["eval_loss"]
    assert bonus == pytest.approx(coef * metrics["eval_entropy"], rel=1e-5)
    # TRL's eval loss on one batch: ratio 1, normalised by the batch's own tokens (dapo), minus
    # the state's coefficient (gated) x the batch's mean entropy, no accumulation factor.
    batch = {k: v for k, v in jax.device_get(trainer.rollout).items() if k != "num_items_in_batch"}
    aux = jax.device_get(
        trainer._jit_eval_step(trainer.train_state, {k: v[None] for k, v in batch.items()})
    )
    got = np.sum(aux["sum"]["loss"]) / np.sum(aux["count"]["loss"])
    _, H = jax.jit(lambda p: _head(trainer, p, batch))(trainer.train_state.params)
    m = batch["completion_mask"]
    policy = np.sum(-batch["advantages"][:, None] * m) / m.sum()
    want = policy - coef * np.sum(H * m) / m.sum()
    assert got == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    assert aux["sum"]["policy_loss"].sum() / aux["count"]["policy_loss"].sum() == pytest.approx(
        float(policy), rel=1e-5, abs=1e-6
    )


def check_resume_is_bit_exact(full, hf_model_dir, tokenizer, tmp_path):
    """The adaptive run killed right after its step-5 checkpoint and resumed for step 6:
    identical logs and controller state. The controller is non-trivial at the kill (a positive
    coefficient and the gate open, so step 6 applies the restored coefficient: a resume that lost
    the coefficient or the last window entropy would change step 6's loss or coefficient).

    Was a test of its own with a 4-step run of its own (2 steps, a kill, 2 resumed) and a third
    trainer stopped at step 2; the killed run is now the uninterrupted run's own checkpoint-5,
    copied (the same run up to there: the same bytes)."""
    a = full.args
    logs = train_logs(full)
    at_kill = logs[4]
    assert at_kill["step"] == 5
    assert at_kill["entropy_coef"] > 0 and at_kill["entropy"] <= a.entropy_target
    killed_after_checkpoint(a.output_dir, 5, tmp_path / "b")
    resumed = make(hf_model_dir, tokenizer, tmp_path / "b", **ADAPTIVE)
    resumed.train(resume_from_checkpoint=True)
    b = [x for x in train_logs(resumed) if x["step"] > 5]
    assert [x["step"] for x in b] == [6]
    assert logs[5:] == b
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(full.train_state.extras),
        jax.device_get(resumed.train_state.extras),
    )


def test_config_fields_accepted_and_validated():
    unsupported = GRPOConfig.unsupported_fields()
    assert not set(ENTROPY_FIELDS) & set(unsupported)
    c = GRPOConfig(
        entropy_coef=0.01, use_adaptive_entropy=True, entropy_coef_min=0.001,
        entropy_coef_max=0.5, entropy_coef_delta=0.01, entropy_target=2.0,
    )  # fmt: skip
    assert (c.entropy_coef, c.use_adaptive_entropy, c.entropy_target) == (0.01, True, 2.0)
    d = GRPOConfig()  # TRL's defaults
    assert [getattr(d, f) for f in ENTROPY_FIELDS] == [0.0, False, 0.0, 1.0, 0.005, 0.2]
    GRPOConfig(entropy_coef=-0.1)  # an entropy penalty, as TRL allows
    GRPOConfig(use_adaptive_entropy=True, entropy_target=math.inf)  # always gated on
    GRPOConfig(entropy_coef_min=0.5, entropy_coef_max=0.1)  # unused without adaptive control
    for name in ("entropy_coef", "entropy_coef_min", "entropy_coef_delta", "entropy_target"):
        with pytest.raises(ConfigError, match=f"`{name}` must be a number"):
            GRPOConfig(**{name: math.nan})
    with pytest.raises(ConfigError, match="`entropy_coef` must be finite"):
        GRPOConfig(entropy_coef=math.inf)
    with pytest.raises(ConfigError, match="entropy_coef_min.*<= `entropy_coef_max`"):
        GRPOConfig(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1)
    with pytest.raises(ConfigError, match="`entropy_coef_delta` must be >= 0"):
        GRPOConfig(use_adaptive_entropy=True, entropy_coef_delta=-0.01)


def test_entropy_path_is_completion_logprobs(hf_model_dir):
    """The bonus's forward (`completion_logprobs_and_entropy`) is `completion_logprobs`'s, bit
    for bit, so turning the bonus on changes no log-prob or metric."""
    model = models.from_pretrained(hf_model_dir)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, 16, size=(3, 9)))
    batch = {
        "input_ids": ids,
        "attention_mask": jnp.asarray([[0, 1, 1, 1, 1, 1, 1, 1, 0]] * 3),
        "completion_mask": jnp.asarray([[1, 1, 1, 1, 0]] * 3),
    }
    kw = dict(temperature=0.7, chunk_size=2)
    logps, stats = jax.jit(lambda b: completion_logprobs(model, b, with_stats=True, **kw))(batch)
    logps2, stats2, ent = jax.jit(lambda b: completion_logprobs_and_entropy(model, b, **kw))(batch)
    np.testing.assert_array_equal(logps, logps2)
    jax.tree.map(np.testing.assert_array_equal, stats, stats2)
    np.testing.assert_array_equal(ent, stats["entropy"])
