"""PPO's traced update (TRL v0.7.2 `PPOTrainer.step` semantics): the rollout forward, rewards,
advantages and the whole optimisation phase as jitted functions, built from a `PPOConfig`.

- `make_rollout_forward`: one forward pass of the policy (log-probs of the taken tokens and
  values) and of the frozen reference (log-probs), aligned as TRL's `batched_forward_pass`
  (position t scores token t + 1; `[B, L - 1]`), plus the per-token KL penalty. Log-probs come
  from chunked unembedding (`core.logprobs`); for `kl_penalty="full"` the full-vocabulary KL is
  reduced chunk by chunk too, so no f32 `[B, T, V]` exists. `make_rollout` runs it over the
  rollout in TRL's forward batches of `mini_batch_size` rows.
- `make_rewards`, `make_advantages`: score scaling and the KL-penalised per-token rewards, then
  masked GAE (`core.rl`), with the config's settings.
- `make_ppo_loss_fn` / `make_loss`: the loss of one mini-batch (`jaxrl.losses.ppo.ppo_loss`);
  `policy_and_value_loss` is TRL's `loss` on arrays.
- `make_ppo_update` / `make_optimise`: the whole optimisation phase as ONE jitted call:
  `lax.scan` over epochs (a `lax.cond` skips the epochs after an early stop), `lax.scan` over
  backward batches of one epoch's permutation, and `make_loss_and_grads`' scan over the
  mini-batches of a backward batch (gradient accumulation). One optimizer update per backward
  batch; clipping, if any, is part of the optimizer and so applies to every update.
- `batched_forward`: the forward of TRL's public `batched_forward_pass`.

The mini-batch, not the token, is the loss unit here: each mini-batch loss is TRL's masked mean
over its own tokens, and an accumulated update averages mini-batch losses (what accelerate's
`loss / gradient_accumulation_steps` does), so numbers match TRL for any accumulation factor.
Host work (padding, masks, stats formatting, the KL controller's update) stays in the trainer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl.core import loops, rl
from jaxrl.core.logprobs import token_logprobs, unembed_logits
from jaxrl.core.rl import full_kl_from_hidden, kl_penalty
from jaxrl.core.state import TrainState
from jaxrl.core.step import StateUpdate, make_apply_grads, make_loss_and_grads
from jaxrl.losses.ppo import PPO_ARRAY_STATS, PPO_SCALAR_STATS, ppo_loss
from jaxrl.models.heads import CausalLMWithValueHead

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


# ---------------------------------------------------------------------- built from a PPOConfig
def make_rollout(
    config: Any, apply_policy: Callable[[Any], Any], apply_ref: Callable[[Any], Any]
) -> Callable[..., dict[str, jax.Array]]:
    """`rollout(params, ref_params, input_ids_BL, attention_mask_BL) -> dict`: the
    `make_rollout_forward` outputs over the whole rollout, run in TRL's forward batches of
    `config.mini_batch_size` rows one after the other (`lax.map`)."""
    forward = make_rollout_forward(apply_policy, apply_ref, kl_kind=config.kl_penalty)
    fbs = config.mini_batch_size

    def rollout(params, ref_params, input_ids_BL, attention_mask_BL):
        # TRL's forward batches of mini_batch_size rows, one after the other.
        B, L = input_ids_BL.shape
        chunks = lambda x: x.reshape(B // fbs, fbs, L)  # noqa: E731
        out = jax.lax.map(
            lambda xs: forward(params, ref_params, *xs),
            (chunks(input_ids_BL), chunks(attention_mask_BL)),
        )
        return jax.tree.map(lambda x: x.reshape(B, *x.shape[2:]), out)

    return rollout


def make_rewards(config: Any) -> Callable:
    """`rewards(scores_B, moments, kl_BT, mask_BT, kl_coef) -> (scores_B, moments, rewards_BT,
    non_score_reward_BT)`: TRL's score scaling / normalisation / clipping (`moments`: the
    running score moments), then the KL-penalised per-token rewards."""
    c = config

    def rewards(scores_B, moments, kl_BT, mask_BT, kl_coef):
        scores_B, moments = rl.scale_scores(
            scores_B,
            moments,
            use_score_scaling=c.use_score_scaling,
            use_score_norm=c.use_score_norm,
            score_clip=c.score_clip,
        )
        r, nsr = rl.compute_rewards(scores_B, kl_BT, mask_BT, kl_coef)
        return scores_B, moments, r, nsr

    return rewards


def make_advantages(config: Any) -> Callable:
    """`advantages(values_BT, rewards_BT, mask_BT) -> (values, advantages, returns)`: masked GAE
    with whitened advantages (TRL), `config.gamma`, `lam` and `whiten_rewards`."""
    c = config
    return lambda v, r, m: rl.compute_advantages(
        v, r, m, gamma=c.gamma, lam=c.lam, whiten_rewards=c.whiten_rewards
    )


def make_loss(config: Any, apply_policy: Callable[[Any], Any], *, peft: bool = False) -> Callable:
    """`make_ppo_loss_fn` with the config's clip ranges, `vf_coef` and `ratio_threshold`. With
    `peft` the trained params are the adapter and the value head, merged with the frozen base
    `state.frozen["base"]` inside the loss (the base gets no gradient)."""
    c = config
    loss_fn = make_ppo_loss_fn(
        apply_policy,
        cliprange=c.cliprange,
        cliprange_value=c.cliprange_value,
        vf_coef=c.vf_coef,
        ratio_threshold=c.ratio_threshold,
    )
    if not peft:
        return loss_fn
    full_loss = loss_fn

    def peft_loss_fn(params, state, mb, rng, extras):
        # Gradients reach only `params` (adapter + value head); the base is a constant.
        full = nnx.merge_state(params, state.frozen["base"])
        return full_loss(full, state, mb, rng, extras)

    return peft_loss_fn


def with_learning_rate(opt_state: Any, lr: jax.Array) -> Any:
    """`opt_state` with every `inject_hyperparams` state's `learning_rate` set to `lr`."""

    def replace(node):
        if hasattr(node, "hyperparams") and "learning_rate" in node.hyperparams:
            hyper = dict(node.hyperparams)
            hyper["learning_rate"] = jnp.asarray(lr, hyper["learning_rate"].dtype)
            return node._replace(hyperparams=hyper)
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            return tuple(replace(c) for c in node)
        if isinstance(node, list):
            return [replace(c) for c in node]
        return node

    return replace(opt_state)


def make_optimise(
    config: Any,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    lr_scheduler: Callable[[jax.Array], jax.Array] | None = None,
) -> Callable[[TrainState, dict, jax.Array], tuple[TrainState, dict]]:
    """`optimise(state, rollout_B, perms_EB) -> (state, out)`: `make_ppo_update` with the
    config's sizes and early stopping; with `lr_scheduler` (`ppo_step -> lr`) the learning rate
    is set first, once per PPO step as TRL's `lr_scheduler.step()` (`extras["ppo_step"]`)."""
    c = config
    update = make_ppo_update(
        loss_fn,
        tx,
        batch_size=c.batch_size,
        mini_batch_size=c.mini_batch_size,
        gradient_accumulation_steps=c.gradient_accumulation_steps,
        early_stopping=c.early_stopping,
        target_kl=c.target_kl,
    )

    def optimise(state: TrainState, rollout_B: dict, perms_EB: jax.Array):
        if lr_scheduler is not None:  # TRL steps its scheduler once per PPO step
            lr = lr_scheduler(state.extras["ppo_step"])
            state = state.replace(opt_state=with_learning_rate(state.opt_state, lr))
        return update(state, rollout_B, perms_EB)

    return optimise


def policy_and_value_loss(
    config: Any,
    old_logprobs: Any,
    values: Any,
    logits: Any,
    vpreds: Any,
    logprobs: Any,
    mask: Any,
    advantages: Any,
    returns: Any,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """TRL's `loss`: `(pg_loss, vf_coef * vf_loss, stats)` of one mini-batch, the entropy from
    the full `logits` `[B, T, V]`."""
    c = config
    entropy = rl.entropy_from_logits(jnp.asarray(logits))
    total, stats = ppo_loss(
        old_logprobs, values, logprobs, vpreds, mask, advantages, returns, entropy,
        cliprange=c.cliprange, cliprange_value=c.cliprange_value, vf_coef=c.vf_coef,
        ratio_threshold=c.ratio_threshold,
    )  # fmt: skip
    del total
    stats = {k: v for k, v in stats.items() if k != "ratio_skipped"}
    return stats["loss/policy"], c.vf_coef * stats["loss/value"], stats


@functools.partial(jax.jit, static_argnums=(0, 4))
def batched_forward(graphdef, state, ids, attn, return_logits: bool):
    """`batched_forward_pass`'s forward: `(logprobs, logits or None, values or None)` of a
    value-head model (values) or a plain causal LM, `[B, L - 1, ...]`; one program per model
    structure, shapes and `return_logits` (a closure built per call compiled again on every
    call)."""
    m = nnx.merge(graphdef, state)
    if isinstance(m, CausalLMWithValueHead):
        logps, values, _ = m.token_logprobs_and_values(ids, attn)
        lm = m.pretrained_model
    else:
        h = m.hidden_states(ids, attn)
        logps = token_logprobs(
            h[:, :-1], m.unembed_weight(), ids[:, 1:], logit_softcap=m.config.final_logit_softcap
        )
        values, lm = None, m
    logits = None
    if return_logits:
        h = lm.hidden_states(ids, attn)[:, :-1]
        logits = unembed_logits(h, lm.unembed_weight(), lm.config.final_logit_softcap)
    return logps, logits, values
