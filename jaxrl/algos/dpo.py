"""The traced math of direct preference optimisation (TRL `DPOTrainer`): the pairs' log-probs
in either batch layout, and the loss factory the generic step differentiates.

A pair batch is `[B, 2, T]` (chosen, rejected rows of `collate_preference`, run as `[2B, T]` in
one forward) or, with prefix sharing, `[B, T]` rows `prompt + chosen + rejected`
(`collate_preference_shared`, run once under the prefix-tree mask). The loss combines the
configured loss types (`jaxrl.losses.dpo_multi_loss`: sigmoid, IPO, f-DPO's divergences, ...),
optionally RPO's `sft` term, WPO's weights (`use_weighting`) and LD-DPO's down-weighted tail
(`ld_alpha`), against reference log-probs from a reference forward the trainer provides, from
the batch (precomputed), or none (`reference_free`). Metrics use TRL's names. Nothing here
reads datasets, collates, loads a reference or touches the host loop (`jaxrl.trainers.dpo`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.algos import router_aux
from jaxrl.algos.masks import model_masks, prefix_tree_mask, weighted_token_count
from jaxrl.algos.predictions import label_ids_from_loss_mask, label_ids_from_trained
from jaxrl.algos.sft import lm_forward, lm_hidden_states
from jaxrl.core.logprobs import scored_logprobs, unembed_logits
from jaxrl.losses.dpo import dpo_multi_loss
from jaxrl.models.adapters import adapter_off


def pairs_to_rows(mb: dict) -> dict:
    """[B, 2, ...] (chosen, rejected) pairs -> [2B, ...] rows: B chosen then B rejected. A
    pair's images (`pixel_values` [B, I, C, H, W]) are the pair's, not per row: left out."""
    return {
        k: jnp.concatenate([v[:, 0], v[:, 1]], axis=0)
        for k, v in mb.items()
        if v.ndim >= 2 and k != "pixel_values"
    }


def pair_rows_hidden_states(model, mb: dict, rows: dict) -> jax.Array:
    """Final hidden states [2B, T, D] of a pair batch's rows (`rows = pairs_to_rows(mb)`); with
    images (`jaxrl.data.vision_preference`), the vision tower runs once per pair and both rows
    read its image features (TRL repeats the images for the rejected rows: the same values)."""
    if "token_type_ids" not in rows:
        return lm_hidden_states(model, rows)
    attention_mask, segment_ids = model_masks(rows)
    features = None
    if "pixel_values" in mb:
        features_BIMD = model.image_features(mb["pixel_values"])
        features = jnp.concatenate([features_BIMD, features_BIMD], axis=0)
    return model.hidden_states(
        rows["input_ids"], attention_mask, rows["positions"], segment_ids,
        token_type_ids=rows["token_type_ids"], image_features=features,
    )  # fmt: skip


def shared_token_logps(model, mb: dict, chunk: int, with_stats: bool, score_span=None):
    """Per-slot log-probs [B, T] (and stats) of prefix-shared rows (`collate_preference_shared`).

    One forward over `prompt + chosen + rejected` with the prefix-tree mask; the slot of the
    first rejected token takes its hidden state from the last prompt token (`source_index`).
    `score_span`: the head runs on that many slots from the first scored one (`scored_logprobs`).
    """
    mask_BTS = prefix_tree_mask(mb["branch_ids"])
    h_BTD = model.hidden_states(mb["input_ids"], mask_BTS, mb["positions"], None)
    h_BTD = jnp.take_along_axis(h_BTD, mb["source_index"][..., None], axis=1)
    scored_BT = (mb["chosen_mask"] > 0) | (mb["rejected_mask"] > 0)
    return scored_logprobs(
        h_BTD, model.unembed_weight(), mb["targets"], scored_BT, chunk, with_stats, score_span,
        logit_softcap=model.config.final_logit_softcap,
    )  # fmt: skip


def pair_logps(
    model,
    mb: dict,
    chunk: int,
    with_stats: bool,
    score_span: int | None = None,
    ld_alpha: float | None = None,
) -> dict:
    """Per-pair quantities of a DPO micro-batch in either layout, all [B]: `chosen`/`rejected`
    summed completion log-probs and token counts, and (with stats) per-pair sums over the
    scored tokens of `logits/*` (mean logit), `argmax_correct/chosen`, `entropy/*` and
    `wpo/*` (log p(y_t) - log sum_v p_v^2, WPO's per-token weight exponent).
    `score_span`: pair rows run the LM head on that many positions from their first completion
    target only (`DPOTrainer.score_span`; see `lm_forward`).
    `ld_alpha` (LD-DPO): `chosen`/`rejected` sum the first min(chosen, rejected tokens) tokens
    of each completion in full and the later ones scaled by `ld_alpha`; `nll/chosen` keeps the
    plain sum (the `sft` term's)."""
    if "branch_ids" in mb:  # prefix-shared rows [B, T]
        out = shared_token_logps(model, mb, chunk, with_stats, score_span)
        logps_BT, stats = out if with_stats else (out, None)
        masks = {"chosen": mb["chosen_mask"], "rejected": mb["rejected_mask"]}
        per_side = {side: (logps_BT, stats, m) for side, m in masks.items()}
    else:  # pair rows [B, 2, T]
        rows = pairs_to_rows(mb)
        if "token_type_ids" in rows:  # image-text rows: each pair's images read once
            out = scored_logprobs(
                pair_rows_hidden_states(model, mb, rows), model.unembed_weight(),
                rows["targets"], rows["loss_mask"] > 0, chunk, with_stats, score_span,
                logit_softcap=model.config.final_logit_softcap,
            )  # fmt: skip
        else:
            out = lm_forward(model, rows, chunk, with_stats, score_span)
        logps_2BT, stats_2B = out if with_stats else (out, None)
        b = logps_2BT.shape[0] // 2
        halves = {"chosen": slice(None, b), "rejected": slice(b, None)}
        per_side = {
            side: (
                logps_2BT[sl],
                None if stats_2B is None else {k: v[sl] for k, v in stats_2B.items()},
                rows["loss_mask"][sl],
            )
            for side, sl in halves.items()
        }
    res = {f"tokens/{side}": jnp.sum(m, axis=-1) for side, (_, _, m) in per_side.items()}
    shared_B = jnp.minimum(res["tokens/chosen"], res["tokens/rejected"])
    for side, (logps_BT, stats, mask_BT) in per_side.items():
        res[side] = jnp.sum(logps_BT * mask_BT, axis=-1)
        if ld_alpha is not None:
            res[f"nll/{side}"] = res[side]
            # The i-th completion token (1-based) is shared while i <= the shorter length.
            past_BT = jnp.cumsum(mask_BT, axis=-1) > shared_B[:, None]
            res[side] = jnp.sum(logps_BT * mask_BT * jnp.where(past_BT, ld_alpha, 1.0), axis=-1)
        if with_stats:
            res[f"logits/{side}"] = jnp.sum(stats["logit_mean"] * mask_BT, axis=-1)
            res[f"argmax_correct/{side}"] = jnp.sum(stats["argmax_correct"] * mask_BT, axis=-1)
            res[f"entropy/{side}"] = jnp.sum(stats["entropy"] * mask_BT, axis=-1)
            aligned_BT = jax.lax.stop_gradient(logps_BT) - stats["log_sum_sq_probs"]
            res[f"wpo/{side}"] = jnp.sum(aligned_BT * mask_BT, axis=-1)
    return res


def wpo_weights(out: dict) -> jax.Array:
    """WPO's per-pair weight `[B]` (TRL `use_weighting`): the product over the pair's two
    completions of exp(mean over its tokens of log p(y_t) - log sum_v p_v^2), without gradient.
    Each factor is the completion's probability under the policy's own sampling distribution,
    normalised per token."""
    w_B = 1.0
    for side in ("chosen", "rejected"):
        w_B = w_B * jnp.exp(out[f"wpo/{side}"] / jnp.maximum(out[f"tokens/{side}"], 1))
    return jax.lax.stop_gradient(w_B)


def shared_row_slots(branch_BT: jax.Array) -> tuple[jax.Array, ...]:
    """Prompt, chosen and rejected lengths `[B, 1]` of prefix-shared rows, the slot index
    `j` `[B, T]` and the shared slot the rejected row's position `j` reads (`src`)."""
    p_B1, c_B1, r_B1 = (jnp.sum(branch_BT == k, axis=1, keepdims=True) for k in (1, 2, 3))
    j_BT = jnp.broadcast_to(jnp.arange(branch_BT.shape[1]), branch_BT.shape)
    src_BT = jnp.minimum(jnp.where(j_BT < p_B1, j_BT, j_BT + c_B1), branch_BT.shape[1] - 1)
    return p_B1, c_B1, r_B1, j_BT, src_BT


def shared_rows_input_ids(mb: dict, pad_id: int) -> jax.Array:
    """Input ids of the `prompt + chosen` then `prompt + rejected` rows `[2B, T]` unpacked from
    prefix-shared rows, each padded with `pad_id` as `collate_preference` pads its rows."""
    ids_BT = mb["input_ids"]
    p_B1, c_B1, r_B1, j_BT, src_BT = shared_row_slots(mb["branch_ids"])
    chosen_BT = jnp.where(j_BT < p_B1 + c_B1, ids_BT, pad_id)
    rejected_BT = jnp.where(j_BT < p_B1 + r_B1, jnp.take_along_axis(ids_BT, src_BT, axis=1), pad_id)
    return jnp.concatenate([chosen_BT, rejected_BT], axis=0).astype(ids_BT.dtype)


def num_pair_tokens(mb: dict) -> jax.Array:
    """Tokens of the pairs as TRL counts them (prompt once per completion), in either layout;
    the copies filling a partial batch (`example_mask` 0) do not count."""
    n = weighted_token_count(mb["attention_mask"], mb)
    if "branch_ids" in mb:
        n = n + weighted_token_count(mb["branch_ids"] == 1, mb)
    return n


def pair_token_weights(mb: dict) -> jax.Array:
    """Per-token weights of the policy forward's rows for TRL's MoE load-balancing loss, which
    runs over the `prompt + chosen` and `prompt + rejected` rows' real tokens: pair rows
    `[2B, T]` (chosen rows, then rejected); a prefix-shared row `[B, T]` counts its prompt
    twice (both of TRL's rows route the same prompt tokens identically). Copies filling a
    partial batch count 0."""
    if "branch_ids" in mb:
        branch_BT = mb["branch_ids"]
        weights_BT = (branch_BT > 0).astype(jnp.float32) + (branch_BT == 1)
        w_B = mb.get("example_mask", jnp.ones(branch_BT.shape[0]))
        return weights_BT * w_B[:, None]
    mask_2BT = pairs_to_rows(mb)["attention_mask"].astype(jnp.float32)
    if "example_mask" in mb:
        mask_2BT = mask_2BT * jnp.concatenate([mb["example_mask"]] * 2)[:, None]
    return mask_2BT


def _sft_term(mb: dict, logps_c_B: jax.Array, n_pairs: jax.Array, n_chosen: jax.Array):
    """Per-pair share of the `sft` loss: the chosen tokens' NLL averaged over every chosen token
    of the optimizer step's batch (RPO, TRL's `loss_type="sft"`).

    The step divides the summed per-pair losses by the step's pair count, so each pair's NLL is
    scaled by pairs/tokens of the whole step (carried in by `DPOTrainer._collate_micro`), which keeps the
    loss independent of `gradient_accumulation_steps`. Eval batches carry no step totals and use
    their own counts."""
    if "step_chosen_tokens" in mb:
        n_pairs, n_chosen = jnp.sum(mb["step_pairs"]), jnp.sum(mb["step_chosen_tokens"])
    return -logps_c_B * n_pairs / jnp.maximum(n_chosen, 1)


def reference_logps(
    model, mb: dict, chunk: int | None, score_span: int | None, ld_alpha: float | None
) -> tuple[jax.Array, jax.Array]:
    """The reference's summed completion log-probs `[B]` (chosen, rejected) of a pair batch,
    without gradient (`pair_logps` of `model`, the reference model)."""
    out = pair_logps(model, mb, chunk, False, score_span, ld_alpha)
    return jax.lax.stop_gradient(out["chosen"]), jax.lax.stop_gradient(out["rejected"])


def make_reference_logps(
    config: Any, bind_reference: Callable[[Any], Any], *, lora_base: bool, score_span: int | None
) -> Callable[[Any, dict], tuple[jax.Array, jax.Array]]:
    """`ref_logps(state, mb) -> (chosen, rejected)`: the reference's log-probs of a pair batch
    (`make_loss`'s `ref_logps`). `bind_reference(state)` is the reference model of the train
    state; with `lora_base` it is the LoRA policy's base, traced with every adapter off."""

    def ref_logps(state, mb):
        with adapter_off(lora_base):  # read when traced: the call must be inside
            return reference_logps(
                bind_reference(state), mb, config.logprob_chunk_size, score_span, config.ld_alpha
            )

    return ref_logps


def make_precompute_logps(
    graphdef: Any, config: Any, score_span: int | None, *, lora_base: bool
) -> Callable[[Any, dict], jax.Array]:
    """`logps(params, batch) -> [B, 2]` (chosen, rejected): one reference pass over a pair
    batch for `precompute_ref_log_probs`, the model `graphdef` bound to `params` (with
    `lora_base`, a LoRA policy's base without its adapter)."""

    def logps(params, batch):
        with adapter_off(lora_base):
            model = nnx.merge(graphdef, params)
            out = pair_logps(
                model, batch, config.logprob_chunk_size, False, score_span, config.ld_alpha
            )
        return jnp.stack([out["chosen"], out["rejected"]], axis=1)

    return logps


def loss_units(batch_A: dict) -> jax.Array:
    """The loss units (real pairs) of a whole `[A, B, ...]` train batch, known before its
    forward (`jaxrl.core.step.make_loss_and_grads`'s `loss_units`)."""
    return jnp.sum(batch_A["example_mask"])


def make_loss(
    config: Any,
    apply_model: Callable[[Any, Any], Any],
    *,
    ref_logps: Callable[[Any, dict], tuple[jax.Array, jax.Array]] | None = None,
    score_span: int | None = None,
    router_aux_coef: float = 0.0,
) -> Callable:
    """The DPO loss `loss_fn(params, state, mb, rng, extras) -> (loss_sum, (aux, extras))` of
    `jaxrl.core.step` (per pair) from a `DPOConfig` (`loss_type`, `loss_weights`, `beta`,
    `label_smoothing`, `discopop_tau`, `f_divergence_type`, `f_alpha_divergence_coef`,
    `use_weighting`, `ld_alpha`, `reference_free`, `precompute_ref_log_probs`,
    `logprob_chunk_size`).

    `apply_model(params, state)` is the policy bound to `params`; `ref_logps(state, mb)` the
    reference's `(chosen, rejected)` log-probs `[B]` (`reference_logps` of whichever model is
    the reference), needed unless the batch carries precomputed ones (`mb["ref_logps"]`
    `[B, 2]`) or the loss is reference-free; `score_span` as in `pair_logps`;
    `router_aux_coef` the resolved MoE load-balancing coefficient."""
    a = config
    chunk = a.logprob_chunk_size
    loss_types = a.loss_type if isinstance(a.loss_type, list) else [a.loss_type]

    coef = router_aux_coef
    if not (a.precompute_ref_log_probs or a.reference_free) and ref_logps is None:
        raise ValueError(
            "DPO's make_loss needs ref_logps (the reference forward) unless "
            "precompute_ref_log_probs or reference_free is set."
        )

    def loss_fn(params, state, mb, rng, extras):
        model = apply_model(params, state)
        tokens_BT = pair_token_weights(mb)
        with router_aux.collect(bool(coef), tokens_BT) as router_stats:
            out = pair_logps(model, mb, chunk, True, score_span, a.ld_alpha)
        logps_c, logps_r = out["chosen"], out["rejected"]
        if a.precompute_ref_log_probs:
            ref_c, ref_r = mb["ref_logps"][:, 0], mb["ref_logps"][:, 1]
        elif a.reference_free:
            ref_c, ref_r = jnp.zeros_like(logps_c), jnp.zeros_like(logps_r)
        else:
            ref_c, ref_r = ref_logps(state, mb)
        weights = a.loss_weights or [1.0] * len(loss_types)
        pair_types = [(t, w) for t, w in zip(loss_types, weights, strict=True) if t != "sft"]
        losses_B, cr_B, rr_B = dpo_multi_loss(
            logps_c,
            logps_r,
            ref_c,
            ref_r,
            # A pure-sft run still needs the rewards for its metrics: weight-0 sigmoid term.
            loss_types=[t for t, _ in pair_types] or ["sigmoid"],
            loss_weights=[w for _, w in pair_types] or [0.0],
            beta=a.beta,
            label_smoothing=a.label_smoothing,
            chosen_lengths=out["tokens/chosen"],
            rejected_lengths=out["tokens/rejected"],
            discopop_tau=a.discopop_tau,
            f_divergence_type=a.f_divergence_type,
            f_alpha_divergence_coef=a.f_alpha_divergence_coef,
            reference_free=a.reference_free,
            example_mask=mb.get("example_mask"),
        )
        w_B = mb["example_mask"] if "example_mask" in mb else jnp.ones_like(losses_B)
        n = jnp.sum(w_B)
        n_c, n_r = jnp.sum(out["tokens/chosen"] * w_B), jnp.sum(out["tokens/rejected"] * w_B)
        if a.use_weighting:  # never with "sft" (DPOConfig)
            losses_B = losses_B * wpo_weights(out)
        sft_weight = sum(w for t, w in zip(loss_types, weights, strict=True) if t == "sft")
        if sft_weight:
            sft_B = _sft_term(mb, out.get("nll/chosen", logps_c), n, n_c)
            losses_B = losses_B + sft_weight * sft_B
        loss_sum = jnp.sum(losses_B * w_B)
        sums = {
            "loss": loss_sum,
            "rewards/chosen": jnp.sum(cr_B * w_B),
            "rewards/rejected": jnp.sum(rr_B * w_B),
            "rewards/accuracies": jnp.sum((cr_B > rr_B) * w_B),
            "rewards/margins": jnp.sum((cr_B - rr_B) * w_B),
            "logps/chosen": jnp.sum(logps_c * w_B),
            "logps/rejected": jnp.sum(logps_r * w_B),
            "logits/chosen": jnp.sum(out["logits/chosen"] * w_B),
            "logits/rejected": jnp.sum(out["logits/rejected"] * w_B),
            "mean_token_accuracy": jnp.sum(out["argmax_correct/chosen"] * w_B),
            "entropy": jnp.sum((out["entropy/chosen"] + out["entropy/rejected"]) * w_B),
        }
        counts = {k: n for k in sums}
        counts.update(
            {
                "logits/chosen": n_c,
                "logits/rejected": n_r,
                "mean_token_accuracy": n_c,
                "entropy": n_c + n_r,
            }
        )
        loss_sum = router_aux.add_to_loss(coef, router_stats, tokens_BT, mb, loss_sum, sums, counts)
        aux = {
            "sum": sums,
            "count": counts,
            "total": {"num_tokens": num_pair_tokens(mb).astype(jnp.float32)},
        }
        return loss_sum, (aux, extras)

    return loss_fn


# ---------------------------------------------------------------- predictions (HF layout)


def shared_rows_predictions(model, mb: dict) -> tuple[jax.Array, jax.Array]:
    """Logits and HF labels of the `prompt + chosen` then `prompt + rejected` rows `[2B, T]`,
    unpacked from prefix-shared rows: one forward over the shared row, whose logits at each
    slot equal those of the same token in its own row (the prefix-tree mask hides the other
    completion). A rejected row reads slot `j` for its prompt and `j + len(chosen)` after it."""
    branch_BT = mb["branch_ids"]
    h_BTD = model.hidden_states(mb["input_ids"], prefix_tree_mask(branch_BT), mb["positions"], None)
    logits_BTV = unembed_logits(h_BTD, model.unembed_weight(), model.config.final_logit_softcap)
    p_B1, c_B1, r_B1, j_BT, src_BT = shared_row_slots(branch_BT)
    rejected_logits_BTV = jnp.take_along_axis(logits_BTV, src_BT[..., None], axis=1)
    rejected_ids_BT = jnp.take_along_axis(mb["input_ids"], src_BT, axis=1)
    chosen_labels = label_ids_from_trained(mb["input_ids"], branch_BT == 2)
    rejected_labels = label_ids_from_trained(rejected_ids_BT, (j_BT >= p_B1) & (j_BT < p_B1 + r_B1))
    return (
        jnp.concatenate([logits_BTV, rejected_logits_BTV], axis=0),
        jnp.concatenate([chosen_labels, rejected_labels], axis=0),
    )


def predict(model, mb: dict) -> tuple[jax.Array, jax.Array]:
    """Logits and HF labels `[2B, T, ...]` of a pair batch: the `prompt + chosen` rows, then the
    `prompt + rejected` rows (prefix-shared rows unpacked, `shared_rows_predictions`)."""
    if "branch_ids" in mb:
        return shared_rows_predictions(model, mb)
    rows = pairs_to_rows(mb)
    logits_BTV = unembed_logits(
        pair_rows_hidden_states(model, mb, rows),
        model.unembed_weight(),
        model.config.final_logit_softcap,
    )
    return logits_BTV, label_ids_from_loss_mask(rows["input_ids"], rows["loss_mask"])
