"""`python -m jaxrl.train --algo {sft,reward,dpo,ppo} [--config FILE.yaml] [--field value ...]`.

A thin entry point over the library. With no model/dataset flags it runs offline on the embedded
arithmetic task: SFT trains the shipped tiny model config from scratch; reward and DPO start
from the shipped SFT-trained model. Exit status 0 on success; on bad input one paragraph on
stderr and status 2.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

ALGOS = ("sft", "reward", "dpo", "ppo")
DEFAULT_ALGO = "dpo"
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def task_compute_metrics(pred) -> dict[str, float]:
    """Held-out accuracy of the embedded task from teacher-forced argmax predictions."""
    from jaxrl.data.task import exact_match

    labels = np.asarray(pred.label_ids)
    mask = labels != -100
    return {"task_accuracy": float(np.mean(exact_match(pred.predictions, labels, mask)))}


def _split_algo(argv: list[str]) -> tuple[str, list[str]]:
    algo, rest, i = DEFAULT_ALGO, [], 0
    while i < len(argv):
        if argv[i] == "--algo" and i + 1 < len(argv):
            algo, i = argv[i + 1], i + 2
        elif argv[i].startswith("--algo="):
            algo, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    if algo not in ALGOS:
        raise ValueError(f"--algo {algo!r} is not one of {ALGOS}.")
    return algo, rest


def _load_split(script, split: str):
    from jaxrl.data.loading import load_dataset_any

    try:
        return load_dataset_any(script.dataset_name, split=split)
    except (KeyError, ValueError) as e:
        if split == script.dataset_test_split:
            return None  # no test split: train without eval, as TRL scripts do
        raise e


def build_trainer(argv: list[str]) -> Any:
    """Parse the command line and build the trainer (shared by `jaxrl.train` and `jaxrl.bench`)."""
    from jaxrl import run_dir, trainers
    from jaxrl.config import CONFIGS, parse_config
    from jaxrl.data import task

    algo, rest = _split_algo(argv)
    if algo == "ppo":
        return build_ppo_trainer(rest)
    has_config = any(a == "--config" or a.startswith("--config=") for a in rest)
    default_yaml = CONFIG_DIR / f"{algo}.yaml"
    yaml_path = None if has_config or not default_yaml.exists() else default_yaml
    args, script = parse_config(CONFIGS[algo], yaml_path=yaml_path, cli_args=rest)
    # [run_dir] fail on an unusable output_dir before loading any data or model
    run_dir.check_output_dir(
        args.output_dir, args.resume_from_checkpoint, args.overwrite_output_dir
    )

    compute_metrics = None
    tokenizer = None
    if script.dataset_name is None:
        name = {"sft": "sft", "reward": "dpo", "dpo": "dpo"}[algo]
        train_ds = str(task.asset_path(f"{name}_train.jsonl"))
        eval_ds = str(task.asset_path(f"{name}_test.jsonl"))
        compute_metrics = task_compute_metrics if algo != "reward" else None
    else:
        train_ds = _load_split(script, script.dataset_train_split)
        eval_ds = _load_split(script, script.dataset_test_split)
    if script.model_name_or_path is None:
        tokenizer = task.load_tokenizer()
        if algo == "sft":
            from transformers import AutoConfig

            # The embedded SFT job trains the shipped tiny config from random weights.
            model = AutoConfig.from_pretrained(str(task.asset_path("model_config")))
        else:
            model = str(task.asset_path("sft_model"))
    else:
        model = script.model_name_or_path
    if script.tokenizer_name_or_path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(script.tokenizer_name_or_path)
    if args.eval_strategy == "no":
        eval_ds = None
    cls = {"sft": trainers.SFTTrainer, "reward": trainers.RewardTrainer, "dpo": trainers.DPOTrainer}
    return cls[algo](
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )


def build_ppo_trainer(rest: list[str]) -> Any:
    """`--algo ppo`: TRL v0.7.2's PPOConfig (+ jaxrl loop fields). Embedded default: the shipped
    SFT model with a new value head, prompts of the arithmetic task, reward 1 for a correct sum
    and 0 otherwise (`arith_correct`'s None, a non-task prompt, counts as 0). With
    `--reward_model DIR` the completions are scored by that reward model instead."""
    from jaxrl import run_dir
    from jaxrl.config import parse_config
    from jaxrl.data import task
    from jaxrl.data.loading import load_dataset_any
    from jaxrl.rewards import arith_correct
    from jaxrl.trainers.ppo import PPOTrainer
    from jaxrl.trainers.ppo_config import PPOConfig

    has_config = any(a == "--config" or a.startswith("--config=") for a in rest)
    default_yaml = CONFIG_DIR / "ppo.yaml"
    yaml_path = None if has_config or not default_yaml.exists() else default_yaml
    args, script = parse_config(PPOConfig, yaml_path=yaml_path, cli_args=rest)
    run_dir.check_output_dir(
        args.output_dir, args.resume_from_checkpoint, args.overwrite_output_dir
    )
    if script.dataset_name is None:
        dataset = load_dataset_any(str(task.asset_path("sft_train.jsonl")), split="train")
    else:
        dataset = _load_split(script, script.dataset_train_split)
    if "query" not in dataset.column_names and "prompt" in dataset.column_names:
        # TRL's dataloader keeps only model-input and logging columns (`query`, not `prompt`).
        dataset = dataset.rename_column("prompt", "query")
    if args.reward_model:
        reward = args.reward_model
    elif script.dataset_name is None:
        reward = arith_correct
    else:
        raise ValueError("--algo ppo on a dataset needs --reward_model PATH (a reward model).")
    model = script.model_name_or_path or str(task.asset_path("sft_model"))
    tok_path = script.tokenizer_name_or_path or script.model_name_or_path
    if tok_path is None:
        tokenizer = task.load_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tok_path)
    return PPOTrainer(args, model, tokenizer=tokenizer, dataset=dataset, reward=reward)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from jaxrl import parallel
    from jaxrl.config import ConfigError
    from jaxrl.trainers import TrainingInterrupted

    parallel.initialize_distributed()
    try:
        trainer = build_trainer(argv)
        trainer.train()
        out = trainer.save_model()
    except TrainingInterrupted as e:
        print(f"jaxrl.train: {e}", file=sys.stderr)
        return 143  # 128 + SIGTERM, so a babysitter knows to resume
    except (ConfigError, ValueError, FileNotFoundError, TypeError, FloatingPointError) as e:
        print(f"jaxrl.train: error: {e}", file=sys.stderr)
        return 2
    print(
        f"jaxrl.train: done; metrics in {os.path.join(trainer.args.output_dir, 'metrics.jsonl')},"
        f" model in {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
