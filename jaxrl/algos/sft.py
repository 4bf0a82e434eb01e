"""The traced math of supervised fine-tuning (TRL `SFTTrainer`): the forward of a collated LM
batch, its per-token weights, and the loss factory the generic step differentiates.

The loss is token-weighted NLL over `loss_mask` tokens (`loss_type="nll"`; `"dft"` weighs each
token by its own probability, `jaxrl.losses.sft`), optionally label-smoothed as HF's
`LabelSmoother`, computed from hidden states with chunked log-probs so no full f32 [B, T, V]
exists. Metrics use TRL's names (`loss`, `mean_token_accuracy`, `entropy`, `num_tokens`, and
`aux_loss` for MoE models). Nothing here reads datasets, collates or touches the host loop
(`jaxrl.trainers.sft` does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.algos import router_aux
from jaxrl.algos.masks import model_masks, weighted_token_count
from jaxrl.algos.predictions import label_ids_from_loss_mask
from jaxrl.core.logprobs import scored_logprobs, unembed_logits
from jaxrl.losses.sft import entropy, mean_token_accuracy, sft_loss_sum


def lm_hidden_states(model, mb: dict) -> jnp.ndarray:
    """Final hidden states [B, T, D] of a collated LM batch (masked only when packed), with its
    images when it has them (`jaxrl.data.vision`)."""
    attention_mask, segment_ids = model_masks(mb)
    images = {k: mb[k] for k in ("pixel_values", "token_type_ids") if k in mb}
    return model.hidden_states(
        mb["input_ids"], attention_mask, mb["positions"], segment_ids, **images
    )


def lm_forward(
    model,
    mb: dict,
    chunk_size: int,
    with_stats: bool,
    score_span: int | None = None,
    uniform_nll_grad: bool = False,
):
    """Per-token target log-probs (and stats) `[B, T]` of a collated LM batch; `score_span`
    as in `scored_logprobs` (rows scored where `loss_mask` is set); `uniform_nll_grad` as in
    `token_logprobs`."""
    return scored_logprobs(
        lm_hidden_states(model, mb),
        model.unembed_weight(),
        mb["targets"],
        mb["loss_mask"] > 0,
        chunk_size,
        with_stats,
        score_span,
        uniform_nll_grad=uniform_nll_grad,
        logit_softcap=model.config.final_logit_softcap,
    )


def full_logits(model, mb: dict) -> jnp.ndarray:
    """f32 logits [B, T, V] of a collated LM batch (eval predictions only; training never
    builds them)."""
    return unembed_logits(
        lm_hidden_states(model, mb), model.unembed_weight(), model.config.final_logit_softcap
    )


def example_weighted_mask(mb: dict) -> jnp.ndarray:
    """`loss_mask` with the rows of padding examples zeroed (`[..., B, T]`: one micro-batch or
    a whole `[A, B, T]` batch)."""
    mask_BT = mb["loss_mask"]
    if "example_mask" in mb:
        mask_BT = mask_BT * mb["example_mask"][..., None]
    return mask_BT


def lm_token_weights(mb: dict) -> jnp.ndarray:
    """1 on the real tokens of a collated LM batch's real examples (packed rows: every token of
    a segment), 0 on padding: the tokens TRL's MoE load-balancing loss counts."""
    tokens_BT = (mb["segment_ids"] > 0) if "segment_ids" in mb else mb["attention_mask"]
    tokens_BT = tokens_BT.astype(jnp.float32)
    if "example_mask" in mb:
        tokens_BT = tokens_BT * mb["example_mask"][..., None]
    return tokens_BT


def padding_free_widths(mb: dict, multiple_of: int | None) -> jnp.ndarray:
    """Per padding-free row `[B]`: its width as TRL collates it (its real tokens, rounded up to
    `multiple_of`; 0 for an empty row)."""
    n_B = jnp.sum(mb["segment_ids"] > 0, axis=-1)
    m = multiple_of or 1
    return (n_B + m - 1) // m * m


def loss_units(batch_A: dict) -> jax.Array:
    """The loss units (trained tokens of real examples) of a whole `[A, B, T]` train batch,
    known before its forward (`jaxrl.core.step.make_loss_and_grads`'s `loss_units`)."""
    return jnp.sum(example_weighted_mask(batch_A))


def make_loss(
    config: Any,
    apply_model: Callable[[Any, Any], Any],
    *,
    score_span: int | None = None,
    router_aux_coef: float = 0.0,
    padding_free: bool = False,
) -> Callable:
    """The SFT loss `loss_fn(params, state, mb, rng, extras) -> (loss_sum, (aux, extras))` of
    `jaxrl.core.step` (per trained token), from an `SFTConfig`'s `logprob_chunk_size`,
    `loss_type`, `label_smoothing_factor` and `pad_to_multiple_of`.

    `apply_model(params, state)` is the policy bound to `params`; `score_span` as in
    `lm_forward`; `router_aux_coef` the resolved MoE load-balancing coefficient
    (`router_aux.resolve_coef`); `padding_free`: train batches are `collate_padding_free` rows,
    whose `num_tokens` is the width TRL's collator gives each device's flattened row."""
    chunk = config.logprob_chunk_size
    loss_type = getattr(config, "loss_type", "nll")

    smoothing = getattr(config, "label_smoothing_factor", 0.0)

    coef = router_aux_coef
    multiple_of = config.pad_to_multiple_of

    def loss_fn(params, state, mb, rng, extras):
        model = apply_model(params, state)
        tokens_BT = lm_token_weights(mb)
        with router_aux.collect(bool(coef), tokens_BT) as router_stats:
            logps_BT, stats = lm_forward(
                model, mb, chunk, True, score_span, uniform_nll_grad=bool(smoothing)
            )
        mask_BT = example_weighted_mask(mb)
        loss_sum, n_tok = sft_loss_sum(logps_BT, mask_BT, loss_type=loss_type)
        if smoothing:  # HF's LabelSmoother: (1 - eps) NLL + eps x uniform-target NLL
            uniform_sum = jnp.sum(stats["uniform_nll"] * mask_BT)
            loss_sum = (1 - smoothing) * loss_sum + smoothing * uniform_sum
        correct, _ = mean_token_accuracy(stats["argmax_correct"], mask_BT)
        ent, _ = entropy(stats["entropy"], mask_BT)
        sums = {"loss": loss_sum, "mean_token_accuracy": correct, "entropy": ent}
        counts = {"loss": n_tok, "mean_token_accuracy": n_tok, "entropy": n_tok}
        loss_sum = router_aux.add_to_loss(coef, router_stats, tokens_BT, mb, loss_sum, sums, counts)
        if padding_free:  # TRL: the width of each device's flattened row
            num_tokens = jnp.sum(padding_free_widths(mb, multiple_of))
        else:
            num_tokens = weighted_token_count(mb["attention_mask"], mb)
        aux = {
            "sum": sums,
            "count": counts,
            "total": {"num_tokens": num_tokens.astype(jnp.float32)},
        }
        return loss_sum, (aux, extras)

    return loss_fn


def predict(model, mb: dict) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Logits `[B, T, V]` and HF labels of a collated batch (HF's `predict()` layout)."""
    logits_BTV = full_logits(model, mb)
    return logits_BTV, label_ids_from_loss_mask(mb["input_ids"], mb["loss_mask"])
