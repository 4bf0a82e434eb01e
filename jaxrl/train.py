"""`python -m jaxrl.train --algo {sft,reward,dpo,grpo,rloo} [--config NAME|FILE.yaml] [--field value ...]`.

A thin entry point over the library. With no model and no dataset flag it runs offline on the
embedded arithmetic task and its recipe (`jaxrl/recipes/ALGO.yaml`): SFT trains the shipped tiny
model config from scratch; reward and DPO start from the shipped SFT-trained model. With a model
or a dataset given, every field the user leaves unset keeps the config class default (TRL's), and a
recipe applies only when named with `--config NAME_OR_PATH`. Exit status 0 on success; on bad
input one paragraph on stderr and status 2.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

ALGOS = ("sft", "reward", "dpo", "grpo", "rloo")
ONLINE_ALGOS = ("grpo", "rloo")
DEFAULT_ALGO = "dpo"
# Recipes ship inside the package so that an installed wheel runs the embedded job too.
CONFIG_DIR = Path(__file__).resolve().parent / "recipes"


def recipe_path(name_or_path: str) -> Path:
    """`--config` value -> YAML file: a shipped recipe name (`dpo`, `sft.yaml`) or a path."""
    path = Path(name_or_path)
    if path.exists():
        return path
    shipped = CONFIG_DIR / (
        name_or_path if name_or_path.endswith(".yaml") else f"{name_or_path}.yaml"
    )
    if path.parent == Path(".") and shipped.exists():
        return shipped
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise FileNotFoundError(
        f"--config {name_or_path!r} is neither a file nor a shipped recipe; give a YAML path or "
        f"one of {names}."
    )


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


def _flag_value(argv: list[str], name: str) -> str | None:
    for i, token in enumerate(argv):
        if token == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(f"--{name}="):
            return token.split("=", 1)[1]
    return None


def _without_config(argv: list[str]) -> list[str]:
    out, skip = [], False
    for i, token in enumerate(argv):
        if skip:
            skip = False
        elif token == "--config":
            skip = i + 1 < len(argv)
        elif not token.startswith("--config="):
            out.append(token)
    return out


def _load_split(script, split: str):
    from jaxrl.data.loading import load_dataset_any

    try:
        return load_dataset_any(script.dataset_name, split=split)
    except (KeyError, ValueError) as e:
        if split == script.dataset_test_split:
            return None  # no test split: train without eval, as TRL scripts do
        raise e


def _recipe_yaml(algo: str, rest: list[str]) -> Path | None:
    """`--config NAME|PATH` names a recipe; with no model and no dataset flag the embedded job
    runs its shipped recipe; a user's model or data gets TRL's defaults, never the demo recipe."""
    config = _flag_value(rest, "config")
    if config is not None:
        return recipe_path(config)
    if (
        _flag_value(rest, "model_name_or_path") is None
        and _flag_value(rest, "dataset_name") is None
    ):
        return CONFIG_DIR / f"{algo}.yaml"
    return None


def build_trainer(argv: list[str]) -> Any:
    """Parse the command line and build the trainer (shared by `jaxrl.train` and `jaxrl.bench`)."""
    from jaxrl import run_dir, trainers
    from jaxrl.config import CONFIGS, parse_config
    from jaxrl.data import task

    algo, rest = _split_algo(argv)
    if algo in ONLINE_ALGOS:
        return build_online_trainer(algo, rest)
    args, script = parse_config(
        CONFIGS[algo], yaml_path=_recipe_yaml(algo, rest), cli_args=_without_config(rest)
    )
    # Fail on an unusable output_dir before loading any data or model.
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
        eval_ds = (
            _load_split(script, script.dataset_test_split)
            if args.eval_strategy != "no" or args.eval_on_start
            else None
        )
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
    if args.eval_strategy == "no" and not args.eval_on_start:
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


def build_online_trainer(algo: str, rest: list[str]) -> Any:
    """GRPO/RLOO: prompt datasets and reward functions. The embedded default starts from the
    shipped SFT model on the arithmetic task's prompts, rewarded by `jaxrl.rewards.arith_correct`
    (held-out accuracy: `eval_greedy/rewards/arith_correct/mean`, greedy exact match)."""
    from jaxrl import run_dir
    from jaxrl.config import parse_config
    from jaxrl.data import task
    from jaxrl.rewards import arith_correct
    from jaxrl.trainers.grpo import GRPOTrainer
    from jaxrl.trainers.grpo_config import GRPOConfig
    from jaxrl.trainers.rloo import RLOOTrainer
    from jaxrl.trainers.rloo_config import RLOOConfig

    config_cls, trainer_cls = {
        "grpo": (GRPOConfig, GRPOTrainer),
        "rloo": (RLOOConfig, RLOOTrainer),
    }[algo]
    args, script = parse_config(
        config_cls, yaml_path=_recipe_yaml(algo, rest), cli_args=_without_config(rest)
    )
    run_dir.check_output_dir(
        args.output_dir, args.resume_from_checkpoint, args.overwrite_output_dir
    )
    if script.dataset_name is None:
        train_ds = str(task.asset_path("sft_train.jsonl"))
        eval_ds = str(task.asset_path("sft_test.jsonl"))
    else:
        train_ds = _load_split(script, script.dataset_train_split)
        eval_ds = _load_split(script, script.dataset_test_split)
    tokenizer = None
    if script.model_name_or_path is None:
        tokenizer = task.load_tokenizer()
        model = str(task.asset_path("sft_model"))
    else:
        model = script.model_name_or_path
    if script.tokenizer_name_or_path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(script.tokenizer_name_or_path)
    if args.eval_strategy == "no":
        eval_ds = None
    return trainer_cls(
        model=model,
        reward_funcs=arith_correct,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
    )


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
