"""Per-token target log-probs from final hidden states, without a full f32 `[B, T, V]` tensor.

The unembedding is applied chunk by chunk along T inside a `lax.scan`, with a hand-written
backward (`_fused_head`; under mixed precision it follows TRL's fused head: bf16-rounded logits,
a bf16 logits gradient, f32 hidden-state gradient). With several chunks the backward recomputes
each chunk's logits instead of storing them; a single chunk keeps its own. Peak logits memory is
one `[B, chunk_size, V]` block and its gradient (forward and backward). This is the
JAX counterpart of TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`), including its
optional per-token statistics. The caller aligns targets (`shift_targets`): hidden state at
position t scores token t + 1.
"""

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.core import loops
from jaxrl.core.matmul import weight_grad
from jaxrl.core.shapes import same_shape, shape_is


def shift_targets(input_ids_BT: jax.Array, mask_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Next-token targets and their mask, same length T: `targets[t] = input_ids[t + 1]`.

    The last position has no next token: target 0 with mask 0. Pass the *loss* mask (e.g. the
    completion mask) to get the mask of the positions whose next token is scored.
    """
    same_shape("shift_targets", rank=2, input_ids_BT=input_ids_BT, mask_BT=mask_BT)
    targets_BT = jnp.concatenate([input_ids_BT[:, 1:], jnp.zeros_like(input_ids_BT[:, :1])], axis=1)
    shifted_mask_BT = jnp.concatenate([mask_BT[:, 1:], jnp.zeros_like(mask_BT[:, :1])], axis=1)
    return targets_BT, shifted_mask_BT


def _logits_dtype(head_dtype) -> jnp.dtype:
    """The dtype the LM-head GEMM writes: f32 accumulation rounded once to the head's dtype.

    On GPU the GEMM writes the head's dtype itself (cuBLAS and XLA's Triton GEMMs accumulate in
    f32 and round the result once: bit-identical to an f32 product rounded afterwards, measured
    on an H100), which halves the logits' write traffic and drops a convert kernel over the
    whole `[B, T, V]` logits (about 5 ms of a 78 ms Qwen2.5-0.5B step). XLA:CPU's bf16-output dot
    rounds differently (not bit-identical), and TPU's is unverified: there the GEMM writes f32 and
    the caller rounds.
    """
    if head_dtype == jnp.float32 or jax.default_backend() != "gpu":
        return jnp.float32
    return head_dtype


def unembed_logits(
    hidden_BTD: jax.Array, unembed_DV: jax.Array, logit_softcap: float | None = None
) -> jax.Array:
    """f32 logits `hidden @ unembed` as an LM head in the unembedding's dtype makes them: hidden
    cast to that dtype, the f32 accumulation rounded to it, then upcast for the softmax. A bf16
    head gives bf16-rounded logits, as torch autocast's lm_head and TRL's fused LM head tiles
    do; an f32 head gives plain f32 logits. `logit_softcap` (Gemma 2's final_logit_softcapping)
    then maps them to `cap * tanh(logits / cap)` in f32."""
    if unembed_DV.dtype == jnp.float32:
        logits = jnp.dot(hidden_BTD, unembed_DV, preferred_element_type=jnp.float32)
    else:
        logits = _rounded_logits(hidden_BTD, unembed_DV)
    return _final_logits(logits, 1.0, logit_softcap)


@jax.custom_vjp
def _rounded_logits(hidden_BTD, unembed_DV):
    return _rounded_logits_fwd(hidden_BTD, unembed_DV)[0]


def _rounded_logits_fwd(hidden_BTD, unembed_DV):
    h_BTD = hidden_BTD.astype(unembed_DV.dtype)
    logits_BTV = jnp.dot(h_BTD, unembed_DV, preferred_element_type=_logits_dtype(unembed_DV.dtype))
    # A 0-d array carries hidden's dtype to the backward (dtypes are not valid residuals).
    res = (h_BTD, unembed_DV, jnp.zeros((), hidden_BTD.dtype))
    return logits_BTV.astype(unembed_DV.dtype).astype(jnp.float32), res


def _rounded_logits_bwd(res, g_BTV):
    # TRL's fused head: the logits gradient is rounded to the head's dtype, then the hidden
    # gradient accumulates in f32 and reaches the (f32) hidden states unrounded.
    h_BTD, unembed_DV, hidden_like = res
    g_BTV = g_BTV.astype(unembed_DV.dtype)
    dh_BTD = jnp.einsum("...v,dv->...d", g_BTV, unembed_DV, preferred_element_type=jnp.float32)
    d, v = unembed_DV.shape
    dw_DV = weight_grad(h_BTD.reshape(-1, d), g_BTV.reshape(-1, v), jnp.float32)
    return dh_BTD.astype(hidden_like.dtype), dw_DV.astype(unembed_DV.dtype)


_rounded_logits.defvjp(_rounded_logits_fwd, _rounded_logits_bwd)


def _logits(hidden_BCD, unembed_DV, temperature, logit_softcap):
    """f32 logits of one chunk: (raw, final). The matmul takes its inputs in the unembedding's
    dtype (bf16 under mixed precision, as torch autocast's lm_head does), accumulates in f32 and
    is rounded to that dtype (as `unembed_logits`), then upcast for the softmax."""
    raw_BCV = jnp.einsum(
        "bcd,dv->bcv",
        hidden_BCD.astype(unembed_DV.dtype),
        unembed_DV,
        preferred_element_type=_logits_dtype(unembed_DV.dtype),
    )
    if unembed_DV.dtype != jnp.float32:
        raw_BCV = raw_BCV.astype(unembed_DV.dtype).astype(jnp.float32)
    return raw_BCV, _final_logits(raw_BCV, temperature, logit_softcap)


def _final_logits(raw_BCV, temperature, logit_softcap):
    logits_BCV = raw_BCV
    if logit_softcap is not None:
        # Gemma-style final-logit soft-capping, as in TRL's fused head (scale, softcap, temperature).
        logits_BCV = logit_softcap * jnp.tanh(logits_BCV / logit_softcap)
    if temperature != 1.0:
        logits_BCV = logits_BCV / temperature
    return logits_BCV


def _chunk_softmax(logits_BCV, targets_BC, with_stats):
    """log Z and the target logit of one chunk, plus the statistics when asked (entropy, mean
    logit, log sum of squared probs, argmax = the first index holding the max, as `jnp.argmax`
    and TRL's `is_top1`) and the expected logit `E_p[l]` (the entropy's backward needs it; None
    without statistics). `logsumexp` + `argmax` + a sum per statistic would read the `[B, C, V]`
    logits (2.5 GB in bf16 at Qwen2.5-0.5B's B=8, T=1024) five times.

    On GPU/TPU, where reading the logits is the cost, one online-softmax reduce reads them once
    (`_online_softmax`). On CPU, where the chunk is cache-sized and the cost is arithmetic, two
    passes of plain reductions (the max, then the sums) vectorise and run faster; finding the
    argmax as the first index equal to the max, not with `argmax`'s index-carrying reduce, makes
    the head's statistics about twice as fast there."""
    target_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
    vocab = logits_BCV.shape[-1]
    if jax.default_backend() != "cpu":
        max_BC, s_BC, el_BC, ee_BC, l_BC, argmax_BC = _online_softmax(logits_BCV, with_stats)
        shift_BC = max_BC
    else:
        max_BC = jnp.max(logits_BCV, axis=-1)
        shift_BC = jnp.where(jnp.isfinite(max_BC), max_BC, 0.0)  # as jax.nn.logsumexp
        e_BCV = jnp.exp(logits_BCV - shift_BC[..., None])
        s_BC = jnp.sum(e_BCV, axis=-1)
        if with_stats:
            # A row with a NaN has a NaN max: its argmax is its first NaN.
            hit_BCV = (logits_BCV == max_BC[..., None]) | jnp.isnan(logits_BCV)
            index_BCV = jax.lax.broadcasted_iota(jnp.int32, logits_BCV.shape, 2)
            argmax_BC = jnp.min(jnp.where(hit_BCV, index_BCV, vocab), axis=-1)
            el_BC = jnp.sum(e_BCV * logits_BCV, axis=-1)
            ee_BC = jnp.sum(jnp.square(e_BCV), axis=-1)
            l_BC = jnp.sum(logits_BCV, axis=-1)
    log_s_BC = jnp.log(s_BC)
    log_z_BC = shift_BC + log_s_BC
    if not with_stats:
        return log_z_BC, target_BC, {}, None
    stats = {"argmax": argmax_BC, "argmax_correct": argmax_BC == targets_BC}
    expected_BC = el_BC / s_BC  # E_p[l] = sum_v p_v l_v, with p_v = e_v / s
    stats |= {
        "entropy": log_z_BC - expected_BC,  # H = log Z - E_p[l]
        "logit_mean": l_BC / vocab,
        # -(1/V) sum_v log p_v = log Z - mean_v l_v: the NLL against the uniform distribution
        # (HF's label smoothing's per-token "smoothed loss", divided by V).
        "uniform_nll": log_z_BC - l_BC / vocab,
        # log sum_v p_v^2, TRL's `log_sum_sq_probs` (WPO weights, `use_weighting=True`).
        "log_sum_sq_probs": jnp.log(ee_BC) - 2.0 * log_s_BC,
    }
    return log_z_BC, target_BC, stats, expected_BC


def _online_softmax(logits_BCV, with_stats):
    """One read of the logits for the row max m and, relative to it, s = sum_v e_v with
    e_v = exp(l_v - m); with statistics also sum_v e_v l_v, sum_v e_v^2, sum_v l_v and the
    argmax. A single reduce whose accumulator is (m, s, ...): merging two partial rows rescales
    each one's exp-weighted sums by exp(m_part - m) (online softmax, as flash attention's).
    Without statistics the last four are None."""
    ones_BCV = jnp.ones_like(logits_BCV)  # one element alone: m = l, e = exp(l - l) = 1
    operands = (logits_BCV, ones_BCV)
    inits = (jnp.array(-jnp.inf, logits_BCV.dtype), jnp.array(0, logits_BCV.dtype))
    if with_stats:
        vocab = logits_BCV.shape[-1]
        index_BCV = jax.lax.broadcasted_iota(jnp.int32, logits_BCV.shape, 2)
        operands += (logits_BCV, ones_BCV, logits_BCV, index_BCV)
        inits += (inits[1], inits[1], inits[1], jnp.array(vocab, jnp.int32))

    def merge(a, b):
        m = jnp.maximum(a[0], b[0])  # NaN if either is
        # Each part's weight is exp(m_part - m): 1 for the part holding the max, and one exp,
        # exp(-|difference|), for the other (equal maxima, -inf ones too, weigh 1 each).
        a_holds = a[0] >= b[0]
        e = jnp.where(a[0] == b[0], 1.0, jnp.exp(-jnp.abs(a[0] - b[0])))
        wa, wb = jnp.where(a_holds, 1.0, e), jnp.where(a_holds, e, 1.0)
        out = (m, a[1] * wa + b[1] * wb)
        if not with_stats:
            return out
        a_nan, b_nan = jnp.isnan(a[0]), jnp.isnan(b[0])
        first = a[5] < b[5]
        take_a = jnp.where(
            a_nan | b_nan, a_nan & (~b_nan | first), (a[0] > b[0]) | ((a[0] == b[0]) & first)
        )
        return out + (
            a[2] * wa + b[2] * wb,
            a[3] * wa * wa + b[3] * wb * wb,
            a[4] + b[4],
            jnp.where(take_a, a[5], b[5]),
        )

    out = jax.lax.reduce(operands, inits, merge, (2,))
    return out if with_stats else (*out, None, None, None, None)


# The fused head has its own VJP. Autodiff of the chunked scan would save nothing per chunk but
# recompute it under `jax.checkpoint`, then run the two backward matmuls with the f32 logits
# cotangent, i.e. as f32 (TF32) GEMMs at a fraction of the bf16 rate, and sum the weight
# gradient chunk by chunk in the weight's dtype. Here the backward recomputes each chunk's logits
# from the saved log-partition, forms the logits cotangent in f32 in one fused pass, casts it to
# the unembedding's dtype (torch autocast's bf16 logits give the same cotangent dtype) and
# accumulates the weight gradient across chunks in f32. `grad_stats` names the statistics
# ("entropy", "uniform_nll") whose cotangents join the log-probs' in that same pass (no extra
# matmul); the others get no gradient.
@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fused_head(
    hidden_NBCD, unembed_DV, targets_NBC, temperature, logit_softcap, with_stats, grad_stats
):
    # Without differentiation (a reference model's forward, say) nothing is kept for a backward.
    args = (hidden_NBCD, unembed_DV, targets_NBC, temperature, logit_softcap, with_stats)
    return _head_forward(*args, keep_logits=False, entropy_grad=False)[0]


def _fused_head_fwd(
    hidden_NBCD, unembed_DV, targets_NBC, temperature, logit_softcap, with_stats, grad_stats
):
    # One chunk keeps its logits (in the head's dtype, which holds them exactly) for the
    # backward instead of recomputing them. The backward runs right after the forward's last op,
    # where that chunk's logits gradient is as large, so the peak barely moves (+0.1 GB at the
    # Qwen2.5-0.5B point on an H100, where the recompute GEMM alone takes 2.9 ms). Several chunks
    # recompute theirs, so that at most one chunk's logits exist at a time.
    args = (hidden_NBCD, unembed_DV, targets_NBC, temperature, logit_softcap, with_stats)
    keep_logits = hidden_NBCD.shape[0] == 1
    entropy_grad = "entropy" in grad_stats
    return _head_forward(*args, keep_logits=keep_logits, entropy_grad=entropy_grad)


def _head_forward(
    hidden_NBCD,
    unembed_DV,
    targets_NBC,
    temperature,
    logit_softcap,
    with_stats,
    *,
    keep_logits,
    entropy_grad,
):
    def step(_, xs):
        hidden_BCD, targets_BC = xs
        raw_BCV, logits_BCV = _logits(hidden_BCD, unembed_DV, temperature, logit_softcap)
        log_z_BC, target_BC, stats, expected_BC = _chunk_softmax(logits_BCV, targets_BC, with_stats)
        raw = raw_BCV.astype(unembed_DV.dtype) if keep_logits else None
        expected = expected_BC if entropy_grad else None
        return None, (target_BC - log_z_BC, stats, log_z_BC, raw, expected)

    _, (logps_NBC, stats_NBC, log_z_NBC, raw_NBCV, expected_NBC) = loops.scan(
        step, None, (hidden_NBCD, targets_NBC)
    )
    residuals = (hidden_NBCD, unembed_DV, targets_NBC, log_z_NBC, raw_NBCV, expected_NBC)
    return (logps_NBC, stats_NBC), residuals


def _fused_head_bwd(temperature, logit_softcap, with_stats, grad_stats, residuals, cotangents):
    hidden_NBCD, unembed_DV, targets_NBC, log_z_NBC, raw_NBCV, expected_NBC = residuals
    g_NBC = cotangents[0].astype(jnp.float32)
    # The statistics are under stop_gradient, except those named in `grad_stats`.
    g_stats = {k: cotangents[1][k].astype(jnp.float32) for k in grad_stats}
    g_entropy_NBC, g_uniform_NBC = g_stats.get("entropy"), g_stats.get("uniform_nll")

    def step(d_unembed_DV, xs):
        hidden_BCD, targets_BC, log_z_BC, g_BC, raw_BCV, g_entropy_BC, expected_BC, g_unif_BC = xs
        if raw_BCV is None:
            raw_BCV, logits_BCV = _logits(hidden_BCD, unembed_DV, temperature, logit_softcap)
        else:
            raw_BCV = raw_BCV.astype(jnp.float32)
            logits_BCV = _final_logits(raw_BCV, temperature, logit_softcap)
        probs_BCV = jnp.exp(logits_BCV - log_z_BC[..., None])
        vocab_BCV = jax.lax.broadcasted_iota(targets_BC.dtype, logits_BCV.shape, 2)
        # d log p(target) / d logits = onehot(target) - softmax
        if g_entropy_BC is None:
            d_logits_BCV = g_BC[..., None] * (
                jnp.where(vocab_BCV == targets_BC[..., None], 1.0, 0.0) - probs_BCV
            )
        else:
            onehot_BCV = jnp.where(vocab_BCV == targets_BC[..., None], 1.0, 0.0)
            # With H = log Z - E_p[l]: dH / dl_j = p_j - (p_j + p_j l_j - p_j E_p[l])
            # = -p_j (l_j - E_p[l]), so the two cotangents share the factor p_j.
            d_logits_BCV = g_BC[..., None] * onehot_BCV - probs_BCV * (
                g_BC[..., None] + g_entropy_BC[..., None] * (logits_BCV - expected_BC[..., None])
            )
        if g_unif_BC is not None:
            # d(log Z - mean_v l_v) / dl_j = p_j - 1 / V.
            vocab = logits_BCV.shape[-1]
            d_logits_BCV = d_logits_BCV + g_unif_BC[..., None] * (probs_BCV - 1.0 / vocab)
        # Both cotangents are w.r.t. the final logits: chain through temperature and soft-capping.
        if temperature != 1.0:
            d_logits_BCV = d_logits_BCV / temperature
        if logit_softcap is not None:
            d_logits_BCV = d_logits_BCV * (1.0 - jnp.square(jnp.tanh(raw_BCV / logit_softcap)))
        d_logits_BCV = d_logits_BCV.astype(unembed_DV.dtype)
        d_hidden_BCD = jnp.einsum(
            "bcv,dv->bcd", d_logits_BCV, unembed_DV, preferred_element_type=jnp.float32
        )
        d, v = unembed_DV.shape
        d_unembed_DV = d_unembed_DV + weight_grad(
            hidden_BCD.astype(unembed_DV.dtype).reshape(-1, d),
            d_logits_BCV.reshape(-1, v),
            jnp.float32,
        )
        return d_unembed_DV, d_hidden_BCD.astype(hidden_BCD.dtype)

    d_unembed_DV, d_hidden_NBCD = loops.scan(
        step,
        jnp.zeros(unembed_DV.shape, jnp.float32),
        (
            hidden_NBCD,
            targets_NBC,
            log_z_NBC,
            g_NBC,
            raw_NBCV,
            g_entropy_NBC,
            expected_NBC,
            g_uniform_NBC,
        ),
    )
    return d_hidden_NBCD, d_unembed_DV.astype(unembed_DV.dtype), None


_fused_head.defvjp(_fused_head_fwd, _fused_head_bwd)


# Accelerators: the most bytes of logits one chunk may write (`[B, chunk, V]` in the dtype the
# head's GEMM writes: 2**31 bf16 logits on GPU). One chunk runs fastest there (no f32
# weight-gradient carry across a scan, the GEMMs at full size): on an H100 the Qwen2.5-0.5B head
# at B=8, T=1024 takes 13.1 ms forward + backward as one chunk against 19.3 ms as eight chunks of
# 128 positions, for about 3.5 GB more peak memory; TRL holds the whole bf16 logits plus an f32
# copy.
ACCELERATOR_LOGITS_BYTES = 2**32
# Positions per chunk where chunks are kept small: on CPU (cache-sized blocks are faster there),
# and for the full-vocabulary KL on every backend (`jaxrl.core.rl.full_kl_from_hidden`).
SMALL_CHUNK_SIZE = 128


def resolve_chunk_size(
    chunk_size: int | None, batch: int, seq_len: int, vocab: int, head_dtype: Any
) -> int:
    """Positions per chunk: `chunk_size` when given, else 128 on CPU and, elsewhere, the whole
    sequence when its logits (`batch * seq_len * vocab` in the dtype the head's GEMM writes, see
    `_logits_dtype`) fit `ACCELERATOR_LOGITS_BYTES`, otherwise as many positions as fit (at
    least one)."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}.")
        return chunk_size
    if jax.default_backend() == "cpu":
        return SMALL_CHUNK_SIZE
    budget = ACCELERATOR_LOGITS_BYTES // jnp.dtype(_logits_dtype(head_dtype)).itemsize
    return max(1, min(seq_len, budget // max(1, batch * vocab)))


def token_logprobs(
    hidden_BTD: jax.Array,
    unembed_DV: jax.Array,
    targets_BT: jax.Array,
    *,
    chunk_size: int | None = None,
    with_stats: bool = False,
    temperature: float = 1.0,
    logit_softcap: float | None = None,
    entropy_grad: bool = False,
    uniform_nll_grad: bool = False,
) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
    """`log softmax(hidden @ unembed / temperature)[target]` as f32 `[B, T]`, chunked over T.

    Logits accumulate in f32 (`preferred_element_type`) whatever the input dtypes. T need not be
    a multiple of `chunk_size`: it runs as ceil(T / chunk_size) equal chunks of at most
    `chunk_size`, padded by less than one position per chunk. `chunk_size=None` picks it per
    backend (`resolve_chunk_size`). With `with_stats=True` also returns
    `[B, T]` statistics under `stop_gradient`: `argmax` (token ids), `argmax_correct` (bool), `entropy` (nats),
    `logit_mean` (mean logit over the vocabulary; TRL's `logits/chosen` is its mean over
    completion tokens), `uniform_nll` (-(1/V) sum_v log p_v) and `log_sum_sq_probs`. For tied
    embeddings pass `embedding_VD.T`.

    `entropy_grad=True` (needs `with_stats`) differentiates the `entropy` statistic too, the
    entropy of the same softmax (after soft-capping and temperature), as TRL's fused head gives
    its entropy output for the entropy bonus: its gradient joins the log-probs' in the head's
    backward pass, with no extra matmul. Off, the head's program is `with_stats`'s alone.
    `uniform_nll_grad=True` likewise differentiates `uniform_nll` (HF label smoothing's term).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if (entropy_grad or uniform_nll_grad) and not with_stats:
        raise ValueError(
            "entropy_grad / uniform_nll_grad differentiate a statistic; pass with_stats=True."
        )
    grad_stats = ("entropy",) * entropy_grad + ("uniform_nll",) * uniform_nll_grad
    shape_is("token_logprobs", (None, None, None), hidden_BTD=hidden_BTD)
    shape_is("token_logprobs", (None, None), unembed_DV=unembed_DV)
    shape_is("token_logprobs", hidden_BTD.shape[:2], targets_BT=targets_BT)
    if hidden_BTD.shape[-1] != unembed_DV.shape[0]:
        raise ValueError(
            f"hidden size {hidden_BTD.shape[-1]} does not match unembed_DV of shape {unembed_DV.shape}; "
            "pass the unembedding as [hidden, vocab] (for tied embeddings use embedding.T)."
        )
    B, T, D = hidden_BTD.shape
    chunk_size = resolve_chunk_size(chunk_size, B, T, unembed_DV.shape[1], unembed_DV.dtype)
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

    logps_NBC, stats_NBC = _fused_head(
        hidden_NBCD, unembed_DV, targets_NBC, temperature, logit_softcap, with_stats, grad_stats
    )

    def unchunk(x_NBC):
        return x_NBC.swapaxes(0, 1).reshape(B, num_chunks * chunk)[:, :T]

    logps_BT = unchunk(logps_NBC)
    if not with_stats:
        return logps_BT
    return logps_BT, {name: unchunk(x) for name, x in stats_NBC.items()}


def scored_logprobs(
    h_BTD: jax.Array,
    w_DV: jax.Array,
    targets_BT: jax.Array,
    scored_BT: jax.Array,
    chunk_size: int | None,
    with_stats: bool,
    score_span: int | None = None,
    uniform_nll_grad: bool = False,
    logit_softcap: float | None = None,
):
    """`token_logprobs` of every position, or with `score_span` (static) only of the
    `score_span` positions from each row's first scored one (`scored_BT`), which must hold all
    of that row's scored positions (a DPO row's completion, not its prompt): those go through
    the LM head, the others come back as 0. Values at scored positions are the full head's."""
    same_shape("scored_logprobs", rank=2, targets_BT=targets_BT, scored_BT=scored_BT)
    if score_span is None or score_span >= targets_BT.shape[1]:
        return token_logprobs(
            h_BTD,
            w_DV,
            targets_BT,
            chunk_size=chunk_size,
            with_stats=with_stats,
            uniform_nll_grad=uniform_nll_grad,
            logit_softcap=logit_softcap,
        )
    B, T = targets_BT.shape
    first_B = jnp.argmax(scored_BT, axis=1)
    idx_BS = jnp.minimum(first_B[:, None] + jnp.arange(score_span), T - 1)
    out = token_logprobs(
        jnp.take_along_axis(h_BTD, idx_BS[..., None], axis=1),
        w_DV,
        jnp.take_along_axis(targets_BT, idx_BS, axis=1),
        chunk_size=chunk_size,
        with_stats=with_stats,
        uniform_nll_grad=uniform_nll_grad,
        logit_softcap=logit_softcap,
    )
    rows_B1 = jnp.arange(B)[:, None]
    # Positions clamped to T - 1 repeat the same computation, so whichever write lands is right.
    return jax.tree.map(lambda v: jnp.zeros((B, T), v.dtype).at[rows_B1, idx_BS].set(v), out)
