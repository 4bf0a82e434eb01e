"""The pure core's entry points reject mis-shaped inputs by name (jaxrl.core.shapes, chex).

Each case is an input jnp would broadcast (or fail on deep inside a step) and that the check
turns into an AssertionError naming the function and the argument, at trace time under jit.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.core import logprobs, rl
from jaxrl.losses import ddpo, dpo, grpo, ppo, reward, rloo, sft

B, T, D, V = 4, 6, 8, 16
b = jnp.linspace(-1.0, 1.0, B)
b1 = b[:, None]
bt = jnp.linspace(-2.0, 0.0, B * T).reshape(B, T)
mask = jnp.ones((B, T))


def test_dpo_loss_broadcast_is_rejected():
    # Without the check a [B, 1] reference broadcasts against [B] into a [B, B] loss.
    assert (b - b1).shape == (B, B)
    with pytest.raises(AssertionError, match=r"dpo_loss: .*ref_chosen_logps \(4, 1\)"):
        dpo.dpo_loss(b, b, b1, b)
    with pytest.raises(AssertionError, match=r"dpo_loss: .*chosen_lengths \(3,\)"):
        dpo.dpo_loss(b, b, b, b, loss_type="ipo", chosen_lengths=jnp.ones(3), rejected_lengths=b)
    # reference_free ignores the reference arguments, whatever they are.
    losses, _, _ = dpo.dpo_loss(b, b - 1, jnp.zeros(()), jnp.zeros(()), reference_free=True)
    assert losses.shape == (B,)


CASES = {
    "reward_loss": (lambda: reward.reward_loss(b, b, margin_B=b1), "margin_B (4, 1)"),
    "reward_metrics": (lambda: reward.reward_metrics(b, b1), "rewards_rejected_B (4, 1)"),
    "sft_loss_sum": (lambda: sft.sft_loss_sum(bt, mask[:, 1:]), "loss_mask_BT (4, 5)"),
    "entropy": (lambda: sft.entropy(bt, mask[:1]), "mask_BT (1, 6)"),
    "ppo_loss": (
        lambda: ppo.ppo_loss(bt, bt, bt, bt, mask, b1, bt, bt),
        "advantages_BT (4, 1)",
    ),
    "ddpo_loss": (lambda: ddpo.ddpo_loss(b, b, b1), "advantages_B (4, 1)"),
    "grpo_advantages": (
        lambda: grpo.grpo_advantages(np.ones((B, 2)), np.ones(3), num_generations=2),
        "reward_weights_K (3,)",
    ),
    "grpo_per_token_loss": (
        lambda: grpo.grpo_per_token_loss(bt, b[None, :], mask),
        "advantages has shape (1, 4)",
    ),
    "grpo_per_token_loss mask": (
        lambda: grpo.grpo_per_token_loss(bt, b, mask[:, 1:]),
        "mask_BT (4, 5)",
    ),
    "grpo_aggregate": (
        lambda: grpo.grpo_aggregate(bt, mask, loss_type="grpo", example_mask_B=b1),
        "example_mask_B (4, 1)",
    ),
    "grpo_metrics": (
        lambda: grpo.grpo_metrics({"coef_1": bt}, b, mask, loss_type="dapo", entropies_BT=bt.T),
        "entropies_BT (6, 4)",
    ),
    "rloo_loss": (lambda: rloo.rloo_loss(bt, b1, mask), "advantages_B (4, 1)"),
    "rloo_advantages": (
        lambda: rloo.rloo_advantages(np.ones((B, 1)), np.ones(1), num_generations=2, kl_N=b1),
        "kl_N (4, 1)",
    ),
    "rloo_sequence_kl": (lambda: rloo.rloo_sequence_kl(bt, bt, mask[:, :1]), "mask_BT (4, 1)"),
    "kl_penalty": (lambda: rl.kl_penalty(bt, b1), "ref_logprobs (4, 1)"),
    "gae": (lambda: rl.gae(bt, b1, 1.0, 0.95), "rewards_BT (4, 1)"),
    "compute_rewards": (lambda: rl.compute_rewards(b1, bt, mask, 0.2), "scores_B (4, 1)"),
    "compute_advantages": (
        lambda: rl.compute_advantages(bt, bt, mask[:, 1:], gamma=1.0, lam=0.95),
        "mask_BT (4, 5)",
    ),
    "shift_targets": (
        lambda: logprobs.shift_targets(jnp.ones((B, T), jnp.int32), mask[:, 1:]),
        "mask_BT (4, 5)",
    ),
    "token_logprobs": (
        lambda: logprobs.token_logprobs(
            jnp.ones((B, T, D)), jnp.ones((D, V)), jnp.ones((B, T - 1), jnp.int32)
        ),
        "targets_BT (4, 5)",
    ),
    "full_kl_from_hidden": (
        lambda: rl.full_kl_from_hidden(
            jnp.ones((B, T, D)), jnp.ones((D, V)), jnp.ones((B, T, D)), jnp.ones((D, V + 1))
        ),
        "ref_unembed_DV (8, 17)",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_mis_shaped_input_is_named(name):
    fn, arg = CASES[name]
    where = name.split()[0]
    with pytest.raises(AssertionError) as err:
        fn()
    message = str(err.value)
    assert f"{where}: " in message and arg in message, message


def test_check_runs_at_trace_time_under_jit():
    traced = []

    @jax.jit
    def loss(chosen, rejected):
        traced.append(chosen.shape)
        return dpo.dpo_loss(chosen, rejected, chosen, rejected)[0]

    assert loss(b, b - 1).shape == (B,)
    with pytest.raises(AssertionError, match="dpo_loss: "):
        loss(b, b1)
    assert traced == [(B,), (B,)]  # rejected while tracing, before anything ran


def test_well_shaped_inputs_pass_and_asserts_can_be_disabled():
    advantages = [b, b1, bt]  # every advantage layout grpo documents
    for adv in advantages:
        loss_BT, _ = grpo.grpo_per_token_loss(bt, adv, mask)
        assert loss_BT.shape == (B, T)
    chex.disable_asserts()
    try:
        assert dpo.dpo_loss(b, b, b1, b)[0].shape == (B, B)
    finally:
        chex.enable_asserts()


def test_parameter_averaging_checks_tree_shapes():
    from jaxrl.core import averaging

    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    with pytest.raises(AssertionError, match="sync_ref_update: ref_params, policy_params"):
        averaging.sync_ref_update({"w": jnp.ones((3, 2)), "b": jnp.zeros(3)}, params, 0.6)
    with pytest.raises(AssertionError, match="sync_ref_update: .* structure"):
        averaging.sync_ref_update({"w": jnp.ones((2, 3))}, params, 0.6)
    # Dtypes may differ: each leaf keeps the reference's.
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert averaging.sync_ref_update(bf16, params, 0.6)["w"].dtype == jnp.bfloat16
    state = averaging.bema_init(params)
    with pytest.raises(AssertionError, match="bema_update: ema, params"):
        averaging.bema_update(state, {"w": jnp.ones((2, 4)), "b": jnp.zeros(3)}, 1)
