"""On-policy update phases as jitted functions (TRL v0.7.2 `PPOTrainer.step` semantics).

- `make_rollout_forward`: one forward pass of the policy (log-probs of the taken tokens and
  values) and of the frozen reference (log-probs), aligned as TRL's `batched_forward_pass`
  (position t scores token t + 1; `[B, L - 1]`), plus the per-token KL penalty. Log-probs come
  from chunked unembedding (`core.logprobs`); for `kl_penalty="full"` the full-vocabulary KL is
  reduced chunk by chunk too, so no f32 `[B, T, V]` exists.
- `make_ppo_update`: the whole optimisation phase as ONE jitted call: `lax.scan` over epochs (a
  `lax.cond` skips the epochs after an early stop), `lax.scan` over backward batches of one
  epoch's permutation, and `make_loss_and_grads`' scan over the mini-batches of a backward batch
  (gradient accumulation). One optimizer update per backward batch; clipping, if any, is part of
  the optimizer and so applies to every update.

The mini-batch, not the token, is the loss unit here: each mini-batch loss is TRL's masked mean
over its own tokens, and an accumulated update averages mini-batch losses (what accelerate's
`loss / gradient_accumulation_steps` does), so numbers match TRL for any accumulation factor.
Host work (padding, masks, stats formatting) stays in the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxrl.core import loops
from jaxrl.core.logprobs import token_logprobs
from jaxrl.core.rl import full_kl_from_hidden, kl_penalty
from jaxrl.core.state import TrainState
from jaxrl.core.step import StateUpdate, make_apply_grads, make_loss_and_grads
from jaxrl.losses.ppo import PPO_ARRAY_STATS, PPO_SCALAR_STATS, ppo_loss

# Per-mini-batch scalars reported by the update (TRL's train stats plus the skip flag).
UPDATE_SCALARS = (*PPO_SCALAR_STATS, "ratio_skipped")


def make_rollout_forward(
    apply_policy: Callable[[Any], Any],
    apply_ref: Callable[[Any], Any],
    *,
    kl_kind: str = "kl",
    chunk_size: int | None = None,
) -> Callable[..., dict[str, jax.Array]]:
    """Build `forward(params, ref_params, input_ids_BL, attention_mask_BL) -> dict` with
    `logprobs`, `ref_logprobs`, `values` and `kl` (the penalty per token), all f32 `[B, L - 1]`.

    `apply_policy(params)` is a `CausalLMWithValueHead`; `apply_ref(ref_params)` any causal LM
    with `hidden_states` and `unembed_weight` (the value head of a reference is never needed).
    Everything runs without gradients (TRL's `torch.no_grad`).
    """

    def forward(params, ref_params, input_ids_BL, attention_mask_BL):
        policy, ref = apply_policy(params), apply_ref(ref_params)
        targets_BT = input_ids_BL[:, 1:]
        h_BLD = policy.hidden_states(input_ids_BL, attention_mask_BL)
        ref_h_BLD = ref.hidden_states(input_ids_BL, attention_mask_BL)
        w_DV, ref_w_DV = policy.unembed_weight(), ref.unembed_weight()
        cap, ref_cap = policy.config.final_logit_softcap, ref.config.final_logit_softcap
        logprobs_BT = token_logprobs(
            h_BLD[:, :-1], w_DV, targets_BT, chunk_size=chunk_size, logit_softcap=cap
        )
        ref_logprobs_BT = token_logprobs(
            ref_h_BLD[:, :-1], ref_w_DV, targets_BT, chunk_size=chunk_size, logit_softcap=ref_cap
        )
        values_BT = policy.v_head(h_BLD[:, :-1]).astype(jnp.float32)
        if kl_kind == "full":
            kl_BT = full_kl_from_hidden(
                h_BLD[:, :-1], w_DV, ref_h_BLD[:, :-1], ref_w_DV, chunk_size=chunk_size,
                logit_softcap=cap, ref_logit_softcap=ref_cap,
            )  # fmt: skip
        else:
            kl_BT = kl_penalty(logprobs_BT, ref_logprobs_BT, kl_kind)
        out = {
            "logprobs": logprobs_BT,
            "ref_logprobs": ref_logprobs_BT,
            "values": values_BT,
            "kl": kl_BT,
        }
        return jax.lax.stop_gradient(out)

    return forward


def make_ppo_loss_fn(
    apply_policy: Callable[[Any], Any],
    *,
    cliprange: float,
    cliprange_value: float,
    vf_coef: float,
    ratio_threshold: float,
    chunk_size: int | None = None,
) -> Callable:
    """The `step.make_loss_and_grads` loss of one PPO mini-batch.

    The mini-batch dict holds `input_ids`, `attention_mask` `[b, L]` and the rollout's
    `old_logprobs`, `values`, `mask`, `advantages`, `returns` `[b, L - 1]`. The loss unit is the
    mini-batch (count 1, see module doc); aux `sum` holds its TRL train stats and `arrays` the
    per-token `policy/advantages` and `policy/ratio`.
    """

    def loss_fn(params, state: TrainState, mb: dict, rng: jax.Array, extras: Any):
        del state, rng  # TRL's PPO forward runs in eval mode: no dropout
        policy = apply_policy(params)
        logprobs_BT, vpreds_BT, entropy_BT = policy.token_logprobs_and_values(
            mb["input_ids"], mb["attention_mask"], chunk_size=chunk_size, with_entropy=True
        )
        loss, stats = ppo_loss(
            mb["old_logprobs"],
            mb["values"],
            logprobs_BT,
            vpreds_BT,
            mb["mask"],
            mb["advantages"],
            mb["returns"],
            entropy_BT,
            cliprange=cliprange,
            cliprange_value=cliprange_value,
            vf_coef=vf_coef,
            ratio_threshold=ratio_threshold,
        )
        one = jnp.ones((), jnp.float32)
        aux = {
            "sum": {k: stats[k] for k in UPDATE_SCALARS},
            "count": {"loss": one, **{k: one for k in UPDATE_SCALARS}},
            "arrays": {k: stats[k] for k in PPO_ARRAY_STATS},
        }
        return loss, (aux, extras)

    return loss_fn


def make_ppo_update(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    *,
    batch_size: int,
    mini_batch_size: int,
    gradient_accumulation_steps: int,
    early_stopping: bool,
    target_kl: float,
    state_updates: Sequence[StateUpdate] = (),
) -> Callable[[TrainState, dict, jax.Array], tuple[TrainState, dict]]:
    """Build `update(state, rollout_B, perms_EB) -> (state, out)`.

    `rollout_B`: dict of `[batch_size, ...]` arrays (see `make_ppo_loss_fn`); `perms_EB`: the
    row order of each epoch (int32). Epoch e visits rows `perms_EB[e]` in
    backward batches of `mini_batch_size * gradient_accumulation_steps` rows, each split into
    `gradient_accumulation_steps` mini-batches. With `early_stopping`, once the last mini-batch
    of an epoch has `policy/policykl > 1.5 * target_kl` the remaining epochs are skipped.

    `out`: `sum` (per-mini-batch scalars `[E, N, A]`), `arrays` (`[E, N, A, b, T]`),
    `grad_norm` (`[E, N]`, before clipping) and `epoch_ran` (`[E]` bool).
    """
    backward = mini_batch_size * gradient_accumulation_steps
    if batch_size % backward:
        raise ValueError(
            f"batch_size ({batch_size}) must be a multiple of mini_batch_size * "
            f"gradient_accumulation_steps ({backward})."
        )
    n_backward = batch_size // backward
    loss_and_grads = make_loss_and_grads(loss_fn)
    apply_grads = make_apply_grads(tx, None, state_updates)

    def run_epoch(state: TrainState, rollout: dict, perm_B: jax.Array):
        def split(x):
            return x[perm_B].reshape(
                n_backward, gradient_accumulation_steps, mini_batch_size, *x.shape[1:]
            )

        batches_N = jax.tree.map(split, rollout)

        def backward_step(state, batch_A):
            rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
            grads, aux_A, extras = loss_and_grads(state, batch_A, rng)
            state, metrics = apply_grads(state, grads, extras)
            out = {"sum": aux_A["sum"], "arrays": aux_A["arrays"]}
            return state, (out, metrics["grad_norm"])

        return loops.scan(backward_step, state, batches_N)

    # Jitted (a nested call XLA inlines) so that the skip branch's `eval_shape` finds the run
    # branch's trace in jit's cache instead of tracing the epoch's forward and backward again.
    run_epoch_jit = jax.jit(run_epoch)

    def update(state: TrainState, rollout: dict, perms_EB: jax.Array):
        def epoch(carry, perm_B):
            state, stopped = carry

            def skip(state, rollout, perm_B):
                _, (out_shape, gn_shape) = jax.eval_shape(run_epoch_jit, state, rollout, perm_B)
                zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (out_shape, gn_shape))
                return state, zeros

            state, (out_N, grad_norm_N) = jax.lax.cond(
                stopped, skip, run_epoch_jit, state, rollout, perm_B
            )
            ran = jnp.logical_not(stopped)
            if early_stopping:
                last_policykl = out_N["sum"]["policy/policykl"][-1, -1]
                stopped = stopped | (last_policykl > 1.5 * target_kl)
            return (state, stopped), (out_N, grad_norm_N, ran)

        (state, _), (out, grad_norm, ran) = loops.scan(
            epoch, (state, jnp.zeros((), bool)), perms_EB
        )
        return state, {**out, "grad_norm": grad_norm, "epoch_ran": ran}

    return update
