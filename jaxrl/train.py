"""`python -m jaxrl.train --algo {sft,reward,dpo,kto,ppo,grpo,rloo,distill,ddpo} [--config NAME|FILE.yaml] [--field ...]`.

A thin entry point over the library. With no model and no dataset flag it runs offline on the
embedded arithmetic task and its recipe (`jaxrl/recipes/ALGO.yaml`): SFT trains the shipped tiny
model config from scratch; reward, DPO and KTO start from the shipped SFT-trained model (KTO on
the DPO pairs unpaired: correct answers desirable, wrong ones undesirable). With a model
or a dataset given, every field the user leaves unset keeps the config class default (TRL's), and a
recipe applies only when named with `--config NAME_OR_PATH`. Exit status 0 on success; on bad
input one paragraph on stderr and status 2.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrl import config_docs, parallel, run_dir, scripting
from jaxrl.checkpoint import CheckpointDiskFullError
from jaxrl.config import ConfigError
from jaxrl.config_cli import MissingExtraError, PeftArguments, parse_config, read_yaml
from jaxrl.data import task
from jaxrl.data.loading import load_dataset_any
from jaxrl.models.diffusion import rewards as image_rewards
from jaxrl.models.diffusion.tiny import TINY_PROMPTS
from jaxrl.rewards import arith_correct, script_reward_funcs
from jaxrl.trainers import TrainingInterrupted
from jaxrl.trainers.ddpo_config import parse_ddpo_cli
from jaxrl.trainers.registry import ALGORITHMS

DEFAULT_ALGO = "dpo"
EXIT_SIGTERM = 143  # 128 + SIGTERM after the checkpoint is saved, so a babysitter knows to resume
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


def argmax_logits(logits: Any, labels: Any) -> Any:
    """`preprocess_logits_for_metrics` of the embedded recipes: token ids, reduced on device."""
    return jnp.argmax(logits, axis=-1)


def task_compute_metrics(pred) -> dict[str, float]:
    """Held-out accuracy of the embedded task: a row is right when every trained token is the
    teacher-forced argmax (HF layout: prediction `t` scores label `t + 1`)."""
    preds, labels = np.asarray(pred.predictions), np.asarray(pred.label_ids)
    targets = labels[:, 1:]
    mask = targets != -100
    return {"task_accuracy": float(np.mean(task.exact_match(preds[:, :-1], targets, mask)))}


def chosen_task_compute_metrics(pred) -> dict[str, float]:
    """`task_compute_metrics` of a DPO eval: on the chosen rows (the first half)."""
    n = len(pred.label_ids) // 2
    return task_compute_metrics(type(pred)(pred.predictions[:n], pred.label_ids[:n]))


def kto_task_dataset(split: str) -> Any:
    """The embedded KTO data: the task's preference pairs of `split` unpaired, each correct sum
    a desirable row and each wrong one an undesirable row, in a fixed shuffled order (TRL's
    unpairing would give batches of one label only, and KTO's KL estimate pairs each row with
    its neighbour's completion, which must answer another prompt)."""
    import datasets  # ~1 s to import: only the runs that need it

    pairs = load_dataset_any(str(task.asset_path(f"dpo_{split}.jsonl")), split="train")
    rows = [
        {"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
        for p in pairs
        for side in ("chosen", "rejected")
    ]
    order = np.random.default_rng(0).permutation(len(rows))
    return datasets.Dataset.from_list([rows[i] for i in order])


def kto_task_compute_metrics(tokenizer: Any):
    """`compute_metrics` of a KTO eval on the embedded task: held-out accuracy over its
    desirable rows (TRL's KTO predictions are labelled with the rows' input ids: a row is right
    when the teacher-forced argmax gives every answer token and the EOS after `=`)."""
    eq, eos = tokenizer.convert_tokens_to_ids("="), tokenizer.eos_token_id

    def compute(pred) -> dict[str, float]:
        hits = []
        preds, label_ids = np.asarray(pred.predictions), np.asarray(pred.label_ids)
        for pred_row, ids in zip(preds, label_ids, strict=True):
            tokens = [int(t) for t in ids if t >= 0]
            if eq not in tokens or eos not in tokens[tokens.index(eq) :]:
                continue
            e = tokens.index(eq)
            end = tokens.index(eos, e)
            text = "".join(tokenizer.convert_ids_to_tokens(tokens[:end]))
            prompt, answer = text[: text.index("=") + 1], text[text.index("=") + 1 :]
            if task.is_correct(prompt.lstrip(tokenizer.bos_token or ""), answer):
                hits.append(all(pred_row[t] == tokens[t + 1] for t in range(e, end)))
        return {"task_accuracy": float(np.mean(hits)) if hits else 0.0}

    return compute


# `python -m jaxrl.train`'s TRL `ModelConfig` PEFT / bitsandbytes flags.
PEFT_FIELDS = tuple(f.name for f in dataclasses.fields(PeftArguments))


def peft_options(script: Any) -> tuple[Any, str | None]:
    """`(peft_config, quantization_config)` for the trainer from the PEFT flags, built as TRL's
    `get_peft_config` / `get_quantization_config` build them from a `ModelConfig`."""
    values = {name: getattr(script, name) for name in PEFT_FIELDS}
    defaults = {name: getattr(type(script)(), name) for name in PEFT_FIELDS}
    changed = sorted(k for k in PEFT_FIELDS if values[k] != defaults[k])
    if not changed:
        return None, None
    if not values["use_peft"] and not (values["load_in_4bit"] or values["load_in_8bit"]):
        raise ConfigError(
            f"{changed} configure LoRA, which is off: add --use_peft true (TRL's ModelConfig "
            "ignores them without it; jaxrl refuses options that would do nothing)."
        )
    model = scripting.ModelConfig(**values)  # validates (DoRA, fp4, ... are rejected)
    return scripting.get_peft_config(model), scripting.get_quantization_config(model)


def import_path(flag: str, path: str, what: str) -> Any:
    """The object `module:name` (`name` may be dotted) names, for `--tools` and
    `--environment_factory`; a ConfigError naming the flag and the fix when it cannot be had."""
    usage = (
        f"Give {flag} as `module:{what}` with the module importable from the working directory "
        f"or PYTHONPATH (e.g. `{flag} my_tools:{'calculator' if what == 'function' else 'Game'}` "
        "for my_tools.py in the directory you run from)."
    )
    module_name, colon, attr = path.partition(":")
    if not colon or not module_name or not attr:
        raise ConfigError(f"{flag} {path!r} is not an import path `module:{what}`. {usage}")
    try:
        obj = importlib.import_module(module_name)
    except (ImportError, SyntaxError) as e:
        raise ConfigError(
            f"{flag} {path!r}: cannot import module {module_name!r} ({e}). {usage}"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{flag} {path!r}: module {module_name!r} has no {what} {attr!r}. {usage}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{flag} {path!r} is a {type(obj).__name__}, not a {what}. {usage}")
    return obj


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
    if algo not in ALGORITHMS:
        raise ValueError(f"--algo {algo!r} is not one of {', '.join(ALGORITHMS)}.")
    if ALGORITHMS[algo].script_class is None:
        raise ValueError(
            f"--algo {algo} has a command line of its own (`jaxrl.train.main_ddpo`); "
            "`build_trainer` builds the other algorithms' trainers."
        )
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
        return CONFIG_DIR / f"{ALGORITHMS[algo].recipe}.yaml"
    return None


# Script flags a shipped recipe may name as paths relative to the jaxrl package
# (`model_name_or_path: assets/arith/tools_model`), so that it runs from any directory.
_RECIPE_PATH_FLAGS = ("model_name_or_path", "tokenizer_name_or_path", "dataset_name")


def _resolve_recipe_paths(script: Any) -> None:
    """Turn the package-relative paths of a shipped recipe (`jaxrl/recipes/*.yaml`) into absolute
    ones; a value given on the command line, or one that exists from the working directory, is
    left as it is."""
    if script.config is None or Path(script.config).resolve().parent != CONFIG_DIR:
        return
    package = CONFIG_DIR.parent
    recipe = read_yaml(script.config)
    for flag in _RECIPE_PATH_FLAGS:
        value = getattr(script, flag)
        if (
            value is not None
            and value == recipe.get(flag)
            and not Path(value).is_absolute()
            and not Path(value).exists()
            and (package / value).exists()
        ):
            setattr(script, flag, str(package / value))


def _script_tokenizer_and_eval(script: Any, args: Any, tokenizer: Any, eval_ds: Any):
    """`--tokenizer_name_or_path` over the default tokenizer, and no eval dataset when the run
    never evaluates (TRL's scripts load it only then)."""
    if script.tokenizer_name_or_path is not None:
        from transformers import AutoTokenizer  # ~3 s to import: only the runs that need it

        tokenizer = AutoTokenizer.from_pretrained(script.tokenizer_name_or_path)
    if args.eval_strategy == "no" and not args.eval_on_start:
        eval_ds = None
    return tokenizer, eval_ds


def build_trainer(argv: list[str]) -> Any:
    """Parse the command line and build the trainer (shared by `jaxrl.train` and `jaxrl.bench`)."""
    algo, rest = _split_algo(argv)
    spec = ALGORITHMS[algo]
    if algo == "ppo":
        return build_ppo_trainer(rest)
    if algo == "distill":
        return build_distill_trainer(rest)
    if spec.takes_reward_funcs:
        return build_online_trainer(algo, rest)
    args, script = parse_config(
        spec.config_class, yaml_path=_recipe_yaml(algo, rest), cli_args=_without_config(rest)
    )
    peft_config, quantization_config = peft_options(script)
    # Fail on an unusable output_dir before loading any data or model.
    run_dir.check_output_dir(
        args.output_dir, args.resume_from_checkpoint, args.overwrite_output_dir
    )

    compute_metrics = None
    tokenizer = None
    if script.dataset_name is None and algo == "kto":
        train_ds, eval_ds = kto_task_dataset("train"), kto_task_dataset("test")
        compute_metrics = kto_task_compute_metrics(task.load_tokenizer())
    elif script.dataset_name is None:
        name = {"sft": "sft", "reward": "dpo", "dpo": "dpo"}[algo]
        train_ds = str(task.asset_path(f"{name}_train.jsonl"))
        eval_ds = str(task.asset_path(f"{name}_test.jsonl"))
        compute_metrics = {"sft": task_compute_metrics, "dpo": chosen_task_compute_metrics}.get(
            algo
        )
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
            from transformers import AutoConfig  # ~3 s to import: only the runs that need it

            # The embedded SFT job trains the shipped tiny config from random weights.
            model = AutoConfig.from_pretrained(str(task.asset_path("model_config")))
        else:
            model = str(task.asset_path("sft_model"))
    else:
        model = script.model_name_or_path
    tokenizer, eval_ds = _script_tokenizer_and_eval(script, args, tokenizer, eval_ds)
    return spec.trainer_class(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=argmax_logits if compute_metrics is not None else None,
        peft_config=peft_config,
        quantization_config=quantization_config,
    )


def build_ppo_trainer(rest: list[str]) -> Any:
    """`--algo ppo`: TRL v0.7.2's PPOConfig (+ jaxrl loop fields). Embedded default: the shipped
    SFT model with a new value head, prompts of the arithmetic task, reward 1 for a correct sum
    and 0 otherwise (`arith_correct`'s None, a non-task prompt, counts as 0). With
    `--reward_model DIR` the completions are scored by that reward model instead."""
    spec = ALGORITHMS["ppo"]
    args, script = parse_config(
        spec.config_class, yaml_path=_recipe_yaml("ppo", rest), cli_args=_without_config(rest)
    )
    peft_config, quantization_config = peft_options(script)
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
        from transformers import AutoTokenizer  # ~3 s to import: only the runs that need it

        tokenizer = AutoTokenizer.from_pretrained(tok_path)
    return spec.trainer_class(
        args,
        model,
        tokenizer=tokenizer,
        dataset=dataset,
        reward=reward,
        peft_config=peft_config,
        quantization_config=quantization_config,
    )


def build_distill_trainer(rest: list[str]) -> Any:
    """`--algo distill` (TRL's `distillation` script): the student is `--model_name_or_path`,
    the teacher `--teacher_model_name_or_path`. The embedded default distils the shipped SFT
    model (teacher) into the shipped smaller student on the arithmetic task's prompts
    (held-out accuracy: `eval_greedy/exact_match`)."""
    spec = ALGORITHMS["distill"]
    args, script = parse_config(
        spec.config_class, yaml_path=_recipe_yaml("distill", rest), cli_args=_without_config(rest)
    )
    peft_config, quantization_config = peft_options(script)
    run_dir.check_output_dir(
        args.output_dir, args.resume_from_checkpoint, args.overwrite_output_dir
    )
    embedded = script.model_name_or_path is None
    if script.dataset_name is None:
        train_ds = str(task.asset_path("sft_train.jsonl"))
        eval_ds = str(task.asset_path("sft_test.jsonl"))
    else:
        train_ds = _load_split(script, script.dataset_train_split)
        eval_ds = _load_split(script, script.dataset_test_split)
    teacher = args.teacher_model_name_or_path
    if teacher is None:
        if not embedded:
            raise ConfigError(
                "--algo distill needs a teacher, as TRL's script: --teacher_model_name_or_path "
                "DIR_OR_HUB_ID (a causal LM with the student's vocabulary)."
            )
        teacher = str(task.asset_path("sft_model"))
    tokenizer = task.load_tokenizer() if embedded else None
    model = str(task.asset_path("student_model")) if embedded else script.model_name_or_path
    tokenizer, eval_ds = _script_tokenizer_and_eval(script, args, tokenizer, eval_ds)
    return spec.trainer_class(
        model=model,
        teacher_model=teacher,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        quantization_config=quantization_config,
        peft_config=peft_config,
    )


def build_online_trainer(algo: str, rest: list[str]) -> Any:
    """GRPO/RLOO: prompt datasets and reward functions. The embedded default starts from the
    shipped SFT model on the arithmetic task's prompts, rewarded by `jaxrl.rewards.arith_correct`
    (held-out accuracy: `eval_greedy/rewards/arith_correct/mean`, greedy exact match). TRL's GRPO
    script flags `--reward_model_name_or_path` / `--reward_funcs` pick other rewards; a
    `--dataset_name` needs one of them."""
    spec = ALGORITHMS[algo]
    args, script = parse_config(
        spec.config_class,
        yaml_path=_recipe_yaml(algo, rest),
        cli_args=_without_config(rest),
        script_class=spec.script_class,
    )
    _resolve_recipe_paths(script)
    reward_funcs = script_reward_funcs(script.reward_funcs, script.reward_model_name_or_path)
    # TRL's `tools=` and `environment_factory=`, resolved before any data or model is loaded.
    tools = [import_path("--tools", path, "function") for path in script.tools or ()]
    environment_factory = None
    if script.environment_factory is not None:
        environment_factory = import_path(
            "--environment_factory", script.environment_factory, "class"
        )
    if not reward_funcs and environment_factory is not None:
        reward_funcs = None  # TRL: the environment's `get_reward` may be the reward
    elif not reward_funcs:
        if script.dataset_name is not None:
            raise ConfigError(
                f"--algo {algo} with --dataset_name needs a reward, as TRL's script: "
                "--reward_funcs NAME [NAME ...] (think_format_reward, get_soft_overlong_punishment, "
                "accuracy_reward, reasoning_accuracy_reward, arith_correct, or a dotted import "
                "path) and/or --reward_model_name_or_path DIR."
            )
        reward_funcs = [arith_correct]
    peft_config, quantization_config = peft_options(script)
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
        from transformers import AutoTokenizer  # ~3 s to import: only the runs that need it

        tokenizer = AutoTokenizer.from_pretrained(script.tokenizer_name_or_path)
    if args.eval_strategy == "no":
        eval_ds = None
    return spec.trainer_class(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        quantization_config=quantization_config,
        peft_config=peft_config,
        tools=tools or None,
        environment_factory=environment_factory,
    )


def main_ddpo(argv: list[str]) -> int:
    """`--algo ddpo`: DDPO on the tiny random SD pipeline (or --pretrained_model DIR) with a
    JPEG reward and prompts drawn from a fixed list of animals (TRL's example script)."""
    try:
        config, reward = parse_ddpo_cli(argv)
        # Prompts from NumPy's global generator, as TRL's example script: the trainer seeds it
        # and its state is in every checkpoint, so a resumed run draws the prompts it would have.
        trainer = ALGORITHMS["ddpo"].trainer_class(
            config,
            getattr(image_rewards, reward),
            lambda: (str(np.random.choice(TINY_PROMPTS)), {}),
            config.pretrained_model or None,
        )
        trainer.train()
        out = trainer.save_model()
    except TrainingInterrupted as e:
        print(f"jaxrl.train: {e}", file=sys.stderr)
        return EXIT_SIGTERM
    except USER_ERRORS as e:
        return report_error(e)
    print(f"jaxrl.train: done; metrics in {config.output_dir}/metrics.jsonl, model in {out}")
    return 0


# What bad input raises: each carries a message naming the problem and the fix.
USER_ERRORS = (
    ConfigError,
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    TypeError,
    FloatingPointError,
    CheckpointDiskFullError,
    MissingExtraError,
)


def report_error(err: BaseException) -> int:
    """Print a user error as one paragraph (after the traceback of the user's own code, when
    the error carries one: a reward function that raised) and return exit status 2."""
    user_traceback = getattr(err, "user_traceback", "")
    if user_traceback:
        print(user_traceback.rstrip(), file=sys.stderr)
    print(f"jaxrl.train: error: {err}", file=sys.stderr)
    return 2


def usage(algo: str) -> str:
    """`--help`: the module's synopsis and every flag `--algo ALGO` accepts, in groups, each with
    its type, default and one-line description (`jaxrl.config_docs.usage`)."""
    return config_docs.usage(algo, synopsis=__doc__ or "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        algo = _flag_value(argv, "algo")
        print(usage(algo if algo in ALGORITHMS else DEFAULT_ALGO))
        return 0
    pairs = [(a, b) for a, b in zip(argv, argv[1:], strict=False) if a == "--algo"]
    if "--algo=ddpo" in argv or ("--algo", "ddpo") in pairs:
        i = argv.index("--algo=ddpo") if "--algo=ddpo" in argv else argv.index("--algo")
        return main_ddpo(argv[:i] + argv[i + (1 if argv[i] == "--algo=ddpo" else 2) :])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parallel.initialize_distributed()
    try:
        trainer = build_trainer(argv)
        trainer.train()
        # The CLI's contract: the model in OUTPUT_DIR/final/, beside checkpoints/ and metrics
        # (the library's save_model() writes into output_dir itself, as HF's).
        out = trainer.save_model(os.path.join(trainer.args.output_dir, "final"))
    except TrainingInterrupted as e:
        print(f"jaxrl.train: {e}", file=sys.stderr)
        return EXIT_SIGTERM
    except USER_ERRORS as e:
        return report_error(e)
    print(
        f"jaxrl.train: done; metrics in {os.path.join(trainer.args.output_dir, 'metrics.jsonl')},"
        f" model in {out}"
    )
    return 0


def _tune_gc() -> None:
    """The CLI process's Python GC: with JAX, transformers and datasets loaded, each older-
    generation pass walks millions of objects, and tracing allocates enough to start passes
    constantly. Rarer young passes, and the modules imported so far frozen out of every pass,
    cut a small DPO run's CPU time by ~13% (21.9 -> 19.1 s). Only the CLI: a library import
    leaves the host program's GC alone."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


if __name__ == "__main__":
    _tune_gc()
    sys.exit(main())
