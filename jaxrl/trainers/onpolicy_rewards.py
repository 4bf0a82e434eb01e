"""How the online trainers (GRPO, RLOO) get their reward functions: reward model paths loaded
as reward functions (`jaxrl.trainers.reward_scoring`), callables checked, and TRL's
`log_metric` / `log_extra` hooks the reward functions log through while a generation batch is
scored, with the metrics that may therefore be NaN.

`OnPolicyRewardsMixin` is one of the pieces `jaxrl.trainers.onpolicy.OnPolicyTrainer` is
composed of. The scoring itself is `jaxrl.rewards.compute_rewards` (called from
`OnPolicyTrainer._sample`); no advantages, no sampling, no traced code here; it does not import
`jaxrl.trainers.onpolicy`.
"""

from __future__ import annotations

from jaxrl.rewards import RewardFunc
from jaxrl.trainers.reward_scoring import load_reward_model_func


class OnPolicyRewardsMixin:
    """`OnPolicyTrainer`'s reward functions and their logging hooks (the buffers
    `_pending_metrics`, `_pending_extras`, `_user_metric_names` are set by its `__init__`)."""

    def _metric_may_be_nan(self, key: str) -> bool:
        if super()._metric_may_be_nan(key) or key in self._user_metric_names:
            return True
        return any(key in (f"rewards/{n}/mean", f"rewards/{n}/std") for n in self.reward_func_names)

    # ----------------------------------------------------------------- rewards
    def _load_reward_funcs(self, reward_funcs, tokenizers) -> list[RewardFunc]:
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ValueError("reward_funcs is empty; pass at least one reward function or model.")
        if tokenizers is not None and not isinstance(tokenizers, (list, tuple)):
            tokenizers = [tokenizers]
        if tokenizers is not None and len(tokenizers) != len(funcs):
            raise ValueError(
                f"reward_processing_classes has {len(tokenizers)} entries for {len(funcs)} reward "
                "functions; give one per reward function (None for callables)."
            )
        # TRL prepares reward models (and the reference, `_models_prepared_at_init`) in __init__.
        self._has_reward_models = any(isinstance(func, str) for func in funcs)
        out = []
        for i, func in enumerate(funcs):
            if isinstance(func, str):
                tok = tokenizers[i] if tokenizers is not None else None
                out.append(
                    load_reward_model_func(
                        func, tokenizer=tok, chat_template_kwargs=self.args.chat_template_kwargs
                    )
                )
            elif callable(func):
                out.append(func)
            else:
                raise TypeError(
                    f"reward_funcs[{i}] is a {type(func).__name__}; pass a callable "
                    "(prompts, completions, **kwargs) -> list[float] or a reward model path."
                )
        return out

    def _log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric` hook for reward functions: a scalar metric; every value logged
        while scoring one generation batch counts, their mean is logged with its metrics."""
        self._pending_metrics[name].append(float(value))

    def _log_completion_extra(self, column: str, values: list) -> None:
        """TRL's `log_extra` hook for reward functions: an extra column (one value per
        completion) for the completions table, kept in `completion_extras` (TRL `_logs`)."""
        self._pending_extras[column].extend(values)
