"""Per-token target log-probs from final hidden states, without a full f32 `[B, T, V]` tensor.

The unembedding is applied chunk by chunk along T inside a `lax.scan`; each chunk is wrapped in
`jax.checkpoint`, so the backward pass recomputes that chunk's logits instead of storing them.
Peak logits memory is one `[B, chunk_size, V]` f32 block (forward and backward). This is the
JAX counterpart of TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`), including its
optional per-token statistics. The caller aligns targets (`shift_targets`): hidden state at
position t scores token t + 1.
"""

import jax
import jax.numpy as jnp


def shift_targets(input_ids_BT: jax.Array, mask_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Next-token targets and their mask, same length T: `targets[t] = input_ids[t + 1]`.

    The last position has no next token: target 0 with mask 0. Pass the *loss* mask (e.g. the
    completion mask) to get the mask of the positions whose next token is scored.
    """
    targets_BT = jnp.concatenate([input_ids_BT[:, 1:], jnp.zeros_like(input_ids_BT[:, :1])], axis=1)
    shifted_mask_BT = jnp.concatenate([mask_BT[:, 1:], jnp.zeros_like(mask_BT[:, :1])], axis=1)
    return targets_BT, shifted_mask_BT


def unembed_logits(hidden_BTD: jax.Array, unembed_DV: jax.Array) -> jax.Array:
    """f32 logits `hidden @ unembed` as an LM head in the unembedding's dtype makes them: hidden
    cast to that dtype, the f32 accumulation rounded to it, then upcast for the softmax. A bf16
    head gives bf16-rounded logits, as torch autocast's lm_head and TRL's fused LM head tiles
    do; an f32 head gives plain f32 logits."""
    if unembed_DV.dtype == jnp.float32:
        return jnp.dot(hidden_BTD, unembed_DV, preferred_element_type=jnp.float32)
    return _rounded_logits(hidden_BTD, unembed_DV)


@jax.custom_vjp
def _rounded_logits(hidden_BTD, unembed_DV):
    return _rounded_logits_fwd(hidden_BTD, unembed_DV)[0]


def _rounded_logits_fwd(hidden_BTD, unembed_DV):
    h_BTD = hidden_BTD.astype(unembed_DV.dtype)
    logits_BTV = jnp.dot(h_BTD, unembed_DV, preferred_element_type=jnp.float32)
    # A 0-d array carries hidden's dtype to the backward (dtypes are not valid residuals).
    res = (h_BTD, unembed_DV, jnp.zeros((), hidden_BTD.dtype))
    return logits_BTV.astype(unembed_DV.dtype).astype(jnp.float32), res


def _rounded_logits_bwd(res, g_BTV):
    # TRL's fused head: the logits gradient is rounded to the head's dtype, then the hidden
    # gradient accumulates in f32 and reaches the (f32) hidden states unrounded.
    h_BTD, unembed_DV, hidden_like = res
    g_BTV = g_BTV.astype(unembed_DV.dtype)
    dh_BTD = jnp.einsum("...v,dv->...d", g_BTV, unembed_DV, preferred_element_type=jnp.float32)
    dw_DV = jnp.einsum("...d,...v->dv", h_BTD, g_BTV, preferred_element_type=jnp.float32)
    return dh_BTD.astype(hidden_like.dtype), dw_DV.astype(unembed_DV.dtype)


_rounded_logits.defvjp(_rounded_logits_fwd, _rounded_logits_bwd)


def _chunk_outputs(hidden_BCD, unembed_DV, targets_BC, temperature, logit_softcap, with_stats):
    logits_BCV = unembed_logits(hidden_BCD, unembed_DV)
    if logit_softcap is not None:
        # Gemma-style final-logit soft-capping, as in TRL's fused head (scale, softcap, temperature).
        logits_BCV = logit_softcap * jnp.tanh(logits_BCV / logit_softcap)
    if temperature != 1.0:
        logits_BCV = logits_BCV / temperature
    log_z_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    target_logit_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
    logps_BC = target_logit_BC - log_z_BC
    if not with_stats:
        return logps_BC, {}
    logits_BCV = jax.lax.stop_gradient(logits_BCV)
    log_z_BC = jax.lax.stop_gradient(log_z_BC)
    probs_BCV = jnp.exp(logits_BCV - log_z_BC[..., None])
    stats = {
        # First-index argmax, like TRL's `is_top1` (ties resolve to the lowest token id).
        "argmax": jnp.argmax(logits_BCV, axis=-1),
        "argmax_correct": jnp.argmax(logits_BCV, axis=-1) == targets_BC,
        "entropy": log_z_BC - jnp.sum(probs_BCV * logits_BCV, axis=-1),
        "logit_mean": jnp.mean(logits_BCV, axis=-1),
        # log sum_v p_v^2, TRL's `log_sum_sq_probs` (WPO weights, `use_weighting=True`).
        "log_sum_sq_probs": jnp.log(jnp.sum(jnp.square(probs_BCV), axis=-1)),
    }
    return logps_BC, stats


def token_logprobs(
    hidden_BTD: jax.Array,
    unembed_DV: jax.Array,
    targets_BT: jax.Array,
    *,
    chunk_size: int = 128,
    with_stats: bool = False,
    temperature: float = 1.0,
    logit_softcap: float | None = None,
) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
    """`log softmax(hidden @ unembed / temperature)[target]` as f32 `[B, T]`, chunked over T.

    Logits are formed as `unembed_logits` does (rounded to the unembedding's dtype), and the
    softmax is f32 whatever the input dtypes. T need not be
    a multiple of `chunk_size`: it runs as ceil(T / chunk_size) equal chunks of at most
    `chunk_size`, padded by less than one position per chunk. With `with_stats=True` also returns
    `[B, T]` statistics under `stop_gradient`: `argmax` (token ids), `argmax_correct` (bool), `entropy` (nats),
    `logit_mean` (mean logit over the vocabulary; TRL's `logits/chosen` is its mean over
    completion tokens) and `log_sum_sq_probs`. For tied embeddings pass `embedding_VD.T`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if hidden_BTD.shape[-1] != unembed_DV.shape[0]:
        raise ValueError(
            f"hidden size {hidden_BTD.shape[-1]} does not match unembed_DV of shape {unembed_DV.shape}; "
            "pass the unembedding as [hidden, vocab] (for tied embeddings use embedding.T)."
        )
    B, T, D = hidden_BTD.shape
    # Balanced chunks: as few as chunk_size allows, all of one size, so the padding is under one
    # row per chunk (T=129 runs as 2 x 65, not 2 x 128).
    num_chunks = -(-T // chunk_size)
    chunk = -(-T // num_chunks)
    pad = num_chunks * chunk - T
    if pad:
        hidden_BTD = jnp.pad(hidden_BTD, ((0, 0), (0, pad), (0, 0)))
        targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
    # Chunk axis first so scan iterates over T; B stays intact (and keeps its sharding).
    hidden_NBCD = hidden_BTD.reshape(B, num_chunks, chunk, D).swapaxes(0, 1)
    targets_NBC = targets_BT.reshape(B, num_chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def body(hidden_BCD, targets_BC):
        return _chunk_outputs(
            hidden_BCD, unembed_DV, targets_BC, temperature, logit_softcap, with_stats
        )

    def step(carry, xs):
        return carry, body(*xs)

    _, (logps_NBC, stats_NBC) = jax.lax.scan(step, None, (hidden_NBCD, targets_NBC))

    def unchunk(x_NBC):
        return x_NBC.swapaxes(0, 1).reshape(B, num_chunks * chunk)[:, :T]

    logps_BT = unchunk(logps_NBC)
    if not with_stats:
        return logps_BT
    return logps_BT, {name: unchunk(x) for name, x in stats_NBC.items()}
