"""On-policy distillation's traced math (TRL 1.16 `DistillationTrainer._compute_loss`): the
generalised Jensen-Shannon divergence between the student's and the teacher's next-token
distributions over the whole vocabulary, per completion token, and the loss function of one
micro-batch for `make_train_step`.

With `p_s = softmax(z_s / T)` and `p_t = softmax(z_t / T)` (`T` = `temperature`, after each
model's logit scale and final soft-capping, as TRL's chunked divergence), TRL's `beta` selects:
- `beta = 0`: forward KL, `KL(p_t || p_s)`;
- `beta = 1`: reverse KL, `KL(p_s || p_t)`;
- otherwise the generalised JSD with mixture `m = (1 - beta) p_s + beta p_t`:
  `beta KL(p_t || m) + (1 - beta) KL(p_s || m)` (`beta = 0.5`: the JSD).
No `T^2` factor, as TRL. The gradient reaches the student only; the student's entropy (of `p_s`)
is a statistic.

Memory: neither model's `[B, C, V]` logits exist at once. The divergence runs over the C
completion positions in chunks (`jaxrl.core.logprobs.resolve_chunk_size`, 128 positions on CPU)
inside a `lax.scan` whose body is rematerialised (`jax.checkpoint`): the forward keeps one chunk's
two `[B, chunk, V]` blocks, and the backward recomputes each chunk's logits from the stored
hidden states rather than keeping every chunk's softmax.

Reduction (TRL): the summed divergence of the step's completion tokens over their count (TRL's
`num_items_in_batch`, the generation batch's loss tokens): `aux["sum"]["loss"]` /
`aux["count"]["loss"]`, which `make_train_step` divides once per optimizer step. `entropy` is
TRL's per-micro-batch mean over its tokens, averaged over micro-batches.

Pure functions of arrays and models: no sampler, teacher loading or host loop here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.algos.rollout import completion_hidden
from jaxrl.core import loops
from jaxrl.core.logprobs import SMALL_CHUNK_SIZE, resolve_chunk_size, unembed_logits
from jaxrl.core.shapes import shape_is

TEACHER = "teacher"  # the frozen teacher's params in `state.frozen`
TEACHER_HIDDEN = "teacher_hidden"  # the rollout's teacher hidden states `[B, C, D_t]`


def divergence_from_log_probs(log_ps_NV: jax.Array, log_pt_NV: jax.Array, beta: float) -> jax.Array:
    """Per-row generalised JSD `[...]` from the student's and the teacher's log-softmax over the
    last axis (see the module doc for what `beta` selects)."""
    if beta == 0.0:
        return jnp.sum(jnp.exp(log_pt_NV) * (log_pt_NV - log_ps_NV), axis=-1)
    if beta == 1.0:
        return jnp.sum(jnp.exp(log_ps_NV) * (log_ps_NV - log_pt_NV), axis=-1)
    log_m_NV = jnp.logaddexp(log_ps_NV + math.log(1.0 - beta), log_pt_NV + math.log(beta))
    kl_t = jnp.exp(log_pt_NV) * (log_pt_NV - log_m_NV)
    kl_s = jnp.exp(log_ps_NV) * (log_ps_NV - log_m_NV)
    return jnp.sum(beta * kl_t + (1.0 - beta) * kl_s, axis=-1)


def generalized_jsd_from_hidden(
    student_hidden_BCD: jax.Array,
    student_unembed_DV: jax.Array,
    teacher_hidden_BCE: jax.Array,
    teacher_unembed_EV: jax.Array,
    *,
    beta: float,
    temperature: float = 1.0,
    student_logit_softcap: float | None = None,
    teacher_logit_softcap: float | None = None,
    chunk_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`(divergence_BC, entropy_BC)` f32: the generalised JSD between both models' next-token
    distributions at each position, and the student's entropy (under `stop_gradient`), from
    their final hidden states and unembeddings (`[hidden, vocab]`, each model its own width,
    one vocabulary). Chunked over C, never a full `[B, C, V]` (module doc)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}.")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    shape_is(
        "generalized_jsd_from_hidden", (None, None, None), student_hidden_BCD=student_hidden_BCD
    )
    B, C, D = student_hidden_BCD.shape
    shape_is("generalized_jsd_from_hidden", (D, None), student_unembed_DV=student_unembed_DV)
    shape_is("generalized_jsd_from_hidden", (B, C, None), teacher_hidden_BCE=teacher_hidden_BCE)
    V = student_unembed_DV.shape[1]
    shape_is(
        "generalized_jsd_from_hidden",
        (teacher_hidden_BCE.shape[-1], V),
        teacher_unembed_EV=teacher_unembed_EV,
    )
    # Each chunk holds both models' f32 log-softmax, several times what the fused LM head holds
    # per logit: small chunks on every backend unless asked (as the full-vocabulary KL).
    chunk = min(
        resolve_chunk_size(chunk_size or SMALL_CHUNK_SIZE, B, C, V, student_unembed_DV.dtype), C
    )
    chunk = max(chunk, 1)
    n = -(-C // chunk)
    chunk = -(-C // n)  # balanced chunks: padding under one position per chunk
    pad = n * chunk - C
    teacher_hidden_BCE = jax.lax.stop_gradient(teacher_hidden_BCE)
    teacher_unembed_EV = jax.lax.stop_gradient(teacher_unembed_EV)

    def chunks(h_BCD):
        h_BCD = jnp.pad(h_BCD, ((0, 0), (0, pad), (0, 0)))
        return h_BCD.reshape(B, n, chunk, h_BCD.shape[-1]).swapaxes(0, 1)

    @jax.checkpoint
    def body(_, xs):
        h_s, h_t = xs
        zs = unembed_logits(h_s, student_unembed_DV, student_logit_softcap) / temperature
        zt = unembed_logits(h_t, teacher_unembed_EV, teacher_logit_softcap) / temperature
        log_ps = jax.nn.log_softmax(zs, axis=-1)
        log_pt = jax.nn.log_softmax(zt, axis=-1)
        div = divergence_from_log_probs(log_ps, log_pt, beta)
        ent = -jnp.sum(jnp.exp(log_ps) * log_ps, axis=-1)
        return None, (div, jax.lax.stop_gradient(ent))

    _, (div_NBC, ent_NBC) = loops.scan(
        body, None, (chunks(student_hidden_BCD), chunks(teacher_hidden_BCE))
    )

    def unchunk(x_NBC):
        return x_NBC.swapaxes(0, 1).reshape(B, n * chunk)[:, :C]

    return unchunk(div_NBC), unchunk(ent_NBC)


def teacher_head(teacher: Any) -> tuple[jax.Array, float | None]:
    """The teacher model's unembedding `[hidden, vocab]` (its logit scaling folded in) and its
    final-logit soft-cap."""
    return teacher.unembed_weight(), teacher.config.final_logit_softcap


def make_teacher_hidden(
    bind_teacher: Callable[[Any], Any],
) -> Callable[[Any, dict[str, jax.Array]], jax.Array]:
    """`hidden(teacher_params, batch) -> [B, C, D_t]`: the frozen teacher's final hidden states
    at the positions of `prompt + completion` rows that predict completion tokens (the scoring
    pass; the loss projects them through the teacher's head chunk by chunk).
    `bind_teacher(params)` binds the params to the teacher's graph."""

    def hidden(teacher_params, batch):
        h_BCD, _ = completion_hidden(bind_teacher(teacher_params), batch)
        return jax.lax.stop_gradient(h_BCD)

    return hidden


def make_loss(
    config: Any,
    apply_model: Callable[[Any, Any], Any],
    bind_teacher: Callable[[Any], Any],
) -> Callable:
    """The `make_train_step` loss of one distillation micro-batch (module doc).

    `apply_model(params, state)` binds the trained params to the student;
    `bind_teacher(teacher_params)` the frozen teacher (`state.frozen[TEACHER]`). The micro-batch
    holds the rollout rows (`input_ids`, `attention_mask` `[B, P + C]`, the loss mask
    `completion_mask` `[B, C]`) and the teacher's hidden states `TEACHER_HIDDEN` `[B, C, D_t]`.
    `config` is a `DistillationConfig` (read for `beta`, `temperature`, `logprob_chunk_size`).
    """
    beta, temperature, chunk = config.beta, config.temperature, config.logprob_chunk_size

    def loss_fn(params, state, mb, rng, extras) -> tuple[jax.Array, Any]:
        student = apply_model(params, state)
        h_BCD, _ = completion_hidden(student, mb)
        w_t, cap_t = teacher_head(bind_teacher(state.frozen[TEACHER]))
        div_BC, ent_BC = generalized_jsd_from_hidden(
            h_BCD,
            student.unembed_weight(),
            mb[TEACHER_HIDDEN],
            w_t,
            beta=beta,
            temperature=temperature,
            student_logit_softcap=student.config.final_logit_softcap,
            teacher_logit_softcap=cap_t,
            chunk_size=chunk,
        )
        mask_BC = mb["completion_mask"].astype(jnp.float32)
        n_tokens = jnp.sum(mask_BC)
        loss_sum = jnp.sum(div_BC * mask_BC)
        aux = {
            "sum": {
                "loss": jax.lax.stop_gradient(loss_sum),
                # TRL: each micro-batch's token mean, averaged over the logged micro-batches.
                "entropy": jnp.sum(ent_BC * mask_BC) / jnp.maximum(n_tokens, 1.0),
            },
            "count": {"loss": n_tokens, "entropy": jnp.ones((), jnp.float32)},
        }
        return loss_sum, (aux, extras)

    return loss_fn


def loss_units(batch_A: dict) -> jax.Array:
    """The step's loss-unit count: its completion tokens (TRL's `num_items_in_batch`)."""
    return jnp.sum(batch_A["completion_mask"].astype(jnp.float32))
