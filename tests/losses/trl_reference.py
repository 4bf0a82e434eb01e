"""Run TRL 1.16's own GRPO/RLOO loss code on given per-token log-probs (test reference).

`GRPOTrainer._compute_loss` / `RLOOTrainer._compute_loss` are called on a trainer built with
`object.__new__` plus the attributes those methods read; the model forward is replaced by a
function returning a leaf tensor, so torch autograd gives the gradient w.r.t. the log-probs.
"""

import collections
import types

import numpy as np
import torch
from trl import GRPOTrainer, RLOOTrainer


def grpo_args(**fields) -> types.SimpleNamespace:
    """The `GRPOConfig` fields `_compute_loss` reads, at TRL 1.16's defaults, and `fields`."""
    return types.SimpleNamespace(
        **{
            "delta": None,
            "use_bias_correction_kl": True,
            "steps_per_generation": 1,
            "sapo_temperature_neg": 1.05,
            "sapo_temperature_pos": 1.0,
            "vespo_k_pos": 2.0,
            "vespo_lambda_pos": 3.0,
            "vespo_k_neg": 3.0,
            "vespo_lambda_neg": 2.0,
            **fields,
        }
    )


class _OneProcess:
    """The accelerator calls the loss methods make, for a single process."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def _trainer(cls, logps, entropies, **attrs):
    trainer = object.__new__(cls)
    leaf = torch.tensor(np.asarray(logps), dtype=torch.float32, requires_grad=True)
    ent = torch.tensor(np.asarray(entropies), dtype=torch.float32)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, ent, None)
    trainer.model = types.SimpleNamespace(training=True, is_gradient_checkpointing=False)
    trainer.accelerator = _OneProcess()
    trainer._metrics = {"train": collections.defaultdict(list)}
    trainer.aux_loss_enabled = False
    trainer._entropy_bonus_enabled = False
    for name, value in attrs.items():
        setattr(trainer, name, value)
    return trainer, leaf


def _ids(mask):
    ids = torch.zeros(np.asarray(mask).shape, dtype=torch.long)
    return {
        "prompt_ids": torch.zeros((ids.shape[0], 1), dtype=torch.long),
        "prompt_mask": torch.ones((ids.shape[0], 1), dtype=torch.long),
        "completion_ids": ids,
        "completion_mask": torch.tensor(np.asarray(mask), dtype=torch.long),
    }


def trl_grpo_loss(
    logps,
    advantages,
    mask,
    *,
    old_logps=None,
    ref_logps=None,
    entropies=None,
    num_items_in_batch=None,
    grad_accum=1,
    loss_type="dapo",
    importance_sampling_level="token",
    beta=0.0,
    epsilon=0.2,
    epsilon_high=None,
    delta=None,
    max_completion_length=None,
    top_entropy_quantile=1.0,
    off_policy_mask_threshold=None,
    use_bias_correction_kl=True,
):
    """TRL's loss, its gradient w.r.t. `logps` and the metrics it logged (last values)."""
    mask = np.asarray(mask)
    entropies = np.zeros_like(np.asarray(logps)) if entropies is None else entropies
    args = grpo_args(
        delta=delta,
        use_bias_correction_kl=use_bias_correction_kl,
        steps_per_generation=grad_accum,
    )
    trainer, leaf = _trainer(
        GRPOTrainer,
        logps,
        entropies,
        args=args,
        loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
        beta=beta,
        epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        max_completion_length=max_completion_length,
        top_entropy_quantile=top_entropy_quantile,
        off_policy_mask_threshold=off_policy_mask_threshold,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=grad_accum,
    )
    inputs = _ids(mask)
    inputs["advantages"] = torch.tensor(np.asarray(advantages), dtype=torch.float32)
    n_items = mask.sum() if num_items_in_batch is None else num_items_in_batch
    inputs["num_items_in_batch"] = torch.tensor(float(n_items))
    if old_logps is not None:
        inputs["old_per_token_logps"] = torch.tensor(np.asarray(old_logps), dtype=torch.float32)
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = torch.tensor(np.asarray(ref_logps), dtype=torch.float32)
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), leaf.grad.numpy(), metrics


def trl_rloo_loss(
    logps, advantages, mask, old_logps, *, epsilon=0.2, epsilon_high=None, entropies=None
):
    """TRL's RLOO loss, its gradient w.r.t. `logps` and the metrics it logged."""
    entropies = np.zeros_like(np.asarray(logps)) if entropies is None else entropies
    trainer, leaf = _trainer(
        RLOOTrainer,
        logps,
        entropies,
        epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
    )
    inputs = _ids(mask)
    inputs["advantages"] = torch.tensor(np.asarray(advantages), dtype=torch.float32)
    inputs["old_logps"] = torch.tensor(np.asarray(old_logps), dtype=torch.float32)
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), leaf.grad.numpy(), metrics


def _scoring_trainer(
    cls, rewards_per_func, completion_ids_list, *, pad_token_id, eos_token_ids, **attrs
):
    """A trainer whose `_generate_and_score_completions` runs on fixed completions and rewards."""
    trainer, _ = _trainer(cls, np.zeros((1, 1)), np.zeros((1, 1)))
    n = len(completion_ids_list)
    trainer.accelerator.device = torch.device("cpu")
    trainer.accelerator.process_index = 0
    trainer._tokenizer = types.SimpleNamespace(pad_token_id=pad_token_id)
    trainer.eos_token_ids = list(eos_token_ids)
    trainer.pad_to_multiple_of = None
    trainer.num_generations_eval = None
    trainer._logs = {
        "prompt": [],
        "completion": [],
        "rewards": collections.defaultdict(list),
        "advantages": [],
        "extra": collections.defaultdict(list),
    }
    trainer._pending_extra_logs = {}
    trainer._pending_metrics = {}
    trainer.log_multimodal = False
    trainer._calculate_rewards = lambda *a: torch.tensor(np.asarray(rewards_per_func))
    trainer.reward_func_names = [f"f{i}" for i in range(np.asarray(rewards_per_func).shape[1])]
    trainer.reward_funcs = [None] * len(trainer.reward_func_names)  # only counted
    trainer.reward_weights = torch.tensor(
        np.asarray(attrs.pop("reward_weights")), dtype=torch.float32
    )
    for name, value in attrs.items():
        setattr(trainer, name, value)
    prompt_ids = [[7] for _ in range(n)]
    completions = ["c"] * n
    return trainer, [{"prompt": "p"} for _ in range(n)], prompt_ids, completions


def trl_grpo_scoring(
    rewards_per_func,
    completion_ids_list,
    *,
    num_generations,
    reward_weights,
    scale_rewards="group",
    multi_objective_aggregation="sum_then_normalize",
    mask_truncated_completions=False,
    eos_token_ids=(1,),
    pad_token_id=0,
):
    """TRL's `GRPOTrainer._generate_and_score_completions` on fixed completions and rewards:
    advantages, completion mask, `num_items_in_batch` and the reward metrics it logged."""
    trainer, inputs, prompt_ids, completions = _scoring_trainer(
        GRPOTrainer,
        rewards_per_func,
        completion_ids_list,
        pad_token_id=pad_token_id,
        eos_token_ids=eos_token_ids,
        reward_weights=reward_weights,
        num_generations=num_generations,
        scale_rewards=scale_rewards,
        multi_objective_aggregation=multi_objective_aggregation,
        mask_truncated_completions=mask_truncated_completions,
        environment_factories=None,
        environments=None,
        tools=None,
        rollout_func=None,
        beta=0.0,
        num_iterations=1,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        args=types.SimpleNamespace(
            steps_per_generation=1,
            gradient_accumulation_steps=1,
            per_device_train_batch_size=len(completion_ids_list),
            gradient_checkpointing_kwargs=None,
        ),
    )
    trainer._generate = lambda prompts: (
        prompt_ids,
        [list(ids) for ids in completion_ids_list],
        None,
        completions,
        None,
        {},
        None,
        [],
    )
    out = trainer._generate_and_score_completions(inputs)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return (
        out["advantages"].numpy(),
        out["completion_mask"].numpy(),
        float(out["num_items_in_batch"]),
        metrics,
    )


def trl_rloo_scoring(
    rewards_per_func,
    completion_ids_list,
    old_logps,
    ref_logps,
    *,
    num_generations,
    reward_weights,
    beta=0.05,
    reward_clip_range=None,
    normalize_advantages=False,
    mask_truncated_completions=False,
    eos_token_ids=(1,),
    pad_token_id=0,
):
    """TRL's `RLOOTrainer._generate_and_score_completions` on fixed completions, rewards and
    old/reference per-token log-probs: advantages, completion mask, summed old log-probs and the
    metrics it logged."""
    trainer, inputs, prompt_ids, completions = _scoring_trainer(
        RLOOTrainer,
        rewards_per_func,
        completion_ids_list,
        pad_token_id=pad_token_id,
        eos_token_ids=eos_token_ids,
        reward_weights=reward_weights,
        num_generations=num_generations,
        beta=beta,
        reward_clip_range=reward_clip_range,
        normalize_advantages=normalize_advantages,
        mask_truncated_completions=mask_truncated_completions,
        ref_model=object(),
        args=types.SimpleNamespace(
            per_device_train_batch_size=len(completion_ids_list),
            gradient_checkpointing_kwargs=None,
        ),
    )
    old = torch.tensor(np.asarray(old_logps), dtype=torch.float32)
    ref = torch.tensor(np.asarray(ref_logps), dtype=torch.float32)
    trainer._get_per_token_logps_and_entropies = lambda model, *a, **k: (
        (old if model is trainer.model else ref),
        None,
        None,
    )
    trainer._generate = lambda prompts: (
        prompt_ids,
        [list(ids) for ids in completion_ids_list],
        completions,
    )
    out = trainer._generate_and_score_completions(inputs)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return (
        out["advantages"].numpy(),
        out["completion_mask"].numpy(),
        out["old_logps"].numpy(),
        metrics,
    )
