"""`DPOConfig`: TRL's `DPOConfig` fields and defaults for `DPOTrainer`, plus TRL < 1.0's
prompt/completion length limits.

The fields every trainer shares live in `jaxrl.config.TrainingConfig`; this file adds DPO's loss,
reference-model and truncation fields with TRL's validation. Like every config it only describes
and validates a run: it never touches arrays or devices.
"""

import typing
from dataclasses import dataclass, field

from jaxrl import config_fields
from jaxrl.config import with_foreign
from jaxrl.config_checks import (
    BETA_MAX,
    DPO_F_DIVERGENCE_LOSS_TYPES,
    DPO_F_DIVERGENCE_TYPES,
    DPO_LOSS_TYPES,
    REF_MODEL_QUANTIZATIONS,
    TRUNCATION_MODES,
    check,
    check_choice,
    check_number,
    resolve_length_buckets,
)
from jaxrl.config_fields import Foreign


@dataclass
class DPOConfig(with_foreign("_DPOForeign", config_fields.DPO)):
    """TRL `DPOConfig` fields we implement, plus TRL < 1.0's prompt/completion length limits."""

    FOREIGN_FIELDS: typing.ClassVar[tuple[Foreign, ...]] = config_fields.DPO

    # TRL: keep the activations saved for the backward pass in host memory between the forward
    # and the backward (with `gradient_checkpointing`, each layer's saved input); the same
    # numbers, less device memory, host transfers instead (`models.layers.remat_wrap`).
    activation_offloading: bool = False
    learning_rate: float = 1e-6
    beta: float = 0.1
    loss_type: list[str] = field(default_factory=lambda: ["sigmoid"])
    loss_weights: list[float] | None = None  # None -> 1.0 for every loss_type
    label_smoothing: float = 0.0
    max_length: int | None = 1024
    # TRL < 1.0 (and the v0.7.2 API): cut prompts to this many tokens first. None (TRL 1.16, which
    # has no such field): a pair longer than max_length keeps its prompt and cuts its completions.
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    # Which end of the prompt survives truncation to max_prompt_length. TRL 1.16's default
    # "keep_start"; TRL < 1.0 defaulted to "keep_end".
    truncation_mode: str = "keep_start"
    padding_value: int | None = None  # None -> tokenizer.pad_token_id
    label_pad_token_id: int = -100  # only -100: padding is masked, never scored
    # TRL default True. False: the policy's training forwards apply the model config's dropout
    # (GPT-2's and Phi-3's, any family's attention_dropout; `jaxrl.algos.model_dropout`).
    disable_dropout: bool = True
    reference_free: bool = False
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    # TR-DPO (https://huggingface.co/papers/2404.09656): ref <- alpha*policy + (1-alpha)*ref
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    discopop_tau: float = 0.05
    # LD-DPO (https://huggingface.co/papers/2409.06411): each completion's log-prob sums its
    # first min(len(chosen), len(rejected)) tokens in full and the rest scaled by `ld_alpha`, for
    # the policy and the reference alike. None: plain sums (standard DPO).
    ld_alpha: float | None = None
    # f-DPO (https://huggingface.co/papers/2309.16240): the pair's score difference uses
    # f'(pi / pi_ref) of this divergence instead of the log-ratio (reverse KL). Rewards stay
    # beta * log-ratio, as in TRL.
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5  # alpha of `alpha_divergence`
    # WPO (https://huggingface.co/papers/2406.11827): each pair's loss is scaled by the product of
    # its two completions' weights exp(mean_t [log p(y_t) - log sum_v p_v^2]) under the current
    # policy, without gradient.
    use_weighting: bool = False
    dataset_num_proc: int | None = None
    # jaxrl: store the frozen reference weights as int8 to halve/quarter their memory.
    ref_model_quantization: str | None = None
    # jaxrl: run each pair as one row `prompt + chosen + rejected` with a prefix-tree attention
    # mask (https://huggingface.co/papers/2410.20305), so the prompt is computed once, not twice.
    # Same log-probs as the two-row layout; fewer tokens when prompts are long.
    prefix_sharing: bool = False
    # TRL: weight of the MoE load-balancing loss (transformers' `aux_loss`) added to the loss;
    # None takes the model config's own `router_aux_loss_coef`, 0.0 turns it off; nonzero on a
    # model without MoE layers is an error (`jaxrl.algos.router_aux`).
    router_aux_loss_coef: float | None = None
    pad_token: str | None = None  # TRL: overrides the tokenizer's pad token
    # TRL < 1.0 (dropped in 1.0): at each evaluation, sample completions of a random eval batch
    # from the policy and from the reference model; logged as the W&B table `game_log` (columns
    # Prompt / Policy / Ref Model) and always as JSON lines in `output_dir/game_log.jsonl`.
    generate_during_eval: bool = False
    # jaxrl: the row lengths a step's batch may be padded to (its train micro-batches, all
    # processes; each eval batch alike): the smallest one >= the batch's longest row. The run's
    # static length (the longest example, capped at `max_length`, rounded up to
    # `pad_to_multiple_of`) is always the last; longer entries are unused. "auto": powers of two
    # from 256 below it (rounded up to `pad_to_multiple_of`); None: every batch at the static
    # length (one compiled shape). TRL pads each batch to its own longest row; a few buckets
    # keep most of that saving while jit compiles one program per bucket. With `prefix_sharing`,
    # a row holds the prompt and both completions.
    length_buckets: list[int] | str | None = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        resolve_length_buckets(self)
        check(
            self.label_pad_token_id == -100,
            "`label_pad_token_id` other than -100 is not supported: jaxrl marks padded completion "
            "tokens with a loss mask, so remove the setting.",
        )
        if isinstance(self.loss_type, str):
            self.loss_type = [name.strip() for name in self.loss_type.split(",")]
        check(bool(self.loss_type), "`loss_type` needs at least one loss name.")
        for name in self.loss_type:
            check_choice("loss_type", name, DPO_LOSS_TYPES)
        check(
            self.loss_weights is None or len(self.loss_weights) == len(self.loss_type),
            f"`loss_weights` must have the same length as `loss_type`; got "
            f"{len(self.loss_weights or [])} weights for {len(self.loss_type)} loss types.",
        )
        check_number(
            "beta",
            self.beta,
            minimum=0,
            exclusive_minimum=True,
            maximum=BETA_MAX,
            why="beta scales the implicit reward beta x log(policy / reference); TRL's default "
            "is 0.1 and published runs use 0.01 to 1 (larger saturates the loss).",
        )
        check(
            0.0 <= self.label_smoothing < 0.5,
            f"`label_smoothing` must be in [0, 0.5); got {self.label_smoothing}.",
        )
        check(
            "exo_pair" not in self.loss_type or self.label_smoothing > 0,
            "`loss_type='exo_pair'` needs `label_smoothing` > 0 (the EXO paper recommends 1e-3).",
        )
        for name in ("max_length", "max_prompt_length", "max_completion_length"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"`{name}` must be None or >= 1; got {value}.")
        check_choice("truncation_mode", self.truncation_mode, TRUNCATION_MODES)
        check(
            self.truncation_mode == "keep_start" or self.max_prompt_length is not None,
            "`truncation_mode='keep_end'` chooses which end of the prompt survives "
            "`max_prompt_length`, so it needs `max_prompt_length` set (TRL 1.16's deprecated "
            "whole-sequence 'keep_end' is not implemented).",
        )
        check(
            not (self.sync_ref_model and self.precompute_ref_log_probs),
            "`sync_ref_model=True` cannot be combined with `precompute_ref_log_probs=True`: the "
            "precomputed log-probs would go stale when the reference syncs. Disable one of them.",
        )
        check(
            not (self.reference_free and (self.sync_ref_model or self.precompute_ref_log_probs)),
            "`reference_free=True` uses no reference model; unset `sync_ref_model` and "
            "`precompute_ref_log_probs`.",
        )
        check(
            0.0 <= self.ref_model_mixup_alpha <= 1.0,
            f"`ref_model_mixup_alpha` must be in [0, 1]; got {self.ref_model_mixup_alpha}.",
        )
        check(
            self.ref_model_sync_steps >= 1,
            f"`ref_model_sync_steps` must be >= 1; got {self.ref_model_sync_steps}.",
        )
        check(self.discopop_tau > 0, f"`discopop_tau` must be > 0; got {self.discopop_tau}.")
        check(
            self.ld_alpha is None or 0.0 <= self.ld_alpha <= 1.0,
            f"`ld_alpha` must be None or in [0, 1] (1 weighs every token fully, 0 drops the tokens "
            f"past the shorter completion's length); got {self.ld_alpha}.",
        )
        check_choice("f_divergence_type", self.f_divergence_type, DPO_F_DIVERGENCE_TYPES)
        if self.f_divergence_type != "reverse_kl":
            other = [t for t in self.loss_type if t not in DPO_F_DIVERGENCE_LOSS_TYPES]
            check(
                not other,
                f"`f_divergence_type={self.f_divergence_type!r}` is only defined for the loss types "
                f"built on the chosen-rejected score difference {list(DPO_F_DIVERGENCE_LOSS_TYPES)}, "
                f"not {other}; use `f_divergence_type='reverse_kl'` with those.",
            )
        check(
            not (self.use_weighting and {"aot", "aot_unpaired"} & set(self.loss_type)),
            "`use_weighting=True` (WPO) is not defined for 'aot' / 'aot_unpaired': they sort the "
            "pairs, which would misalign the per-pair weights (as in TRL). Drop one of them.",
        )
        check(
            not (self.use_weighting and "sft" in self.loss_type),
            "`use_weighting=True` (WPO) weighs pairs, and the 'sft' loss is one NLL over the "
            "batch's chosen tokens, not a per-pair loss; TRL 1.16's DPOTrainer fails on this "
            "combination too. Drop 'sft' from `loss_type` or set `use_weighting=False`.",
        )
        for name in ("precompute_ref_batch_size", "dataset_num_proc"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"`{name}` must be None or >= 1; got {value}.")
        if self.ref_model_quantization is not None:
            check_choice(
                "ref_model_quantization", self.ref_model_quantization, REF_MODEL_QUANTIZATIONS
            )

