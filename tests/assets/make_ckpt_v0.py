"""Regenerate `tests/assets/ckpt_v0/`: checkpoints written by jaxrl before the house redesign, which
`tests/test_checkpoint_compat.py` resumes with the current code.

Run from the repository root, on the commit whose checkpoint layout the asset should freeze:

    PYTHONPATH=$PWD python tests/assets/make_ckpt_v0.py

It writes, under `tests/assets/ckpt_v0/`:
- `model/`: a tiny random Qwen2 (2 layers, width 32, torch seed 0) with the embedded task's
  character tokenizer, saved by transformers; `sd/`: the package's tiny random SD pipeline
  (`jaxrl.models.diffusion.tiny`, v2), as diffusers saved it;
- `data/dpo.jsonl`, `data/grpo.jsonl`: the first rows of the embedded task's training data;
- `RUN/checkpoints/checkpoint-1/` and `RUN/metrics.jsonl` for RUN in dpo, grpo (the CLI, 2 steps,
  a save every step) and ddpo (`DDPOTrainer`, 2 epochs, a save every epoch): the orbax checkpoint
  after step 1 and the uninterrupted run's metrics;
- `README.txt`: the commit and the exact commands.

The runs go through `jaxrl.train.main` / `DDPOTrainer` in this process, under the test suite's
XLA flags and matmul precision (`tests/conftest.py`, imported before JAX loads), as the test
resumes them. The test imports this module for the runs' arguments and reward functions, so it
must stay importable without running anything, and what it defines must not change once the
asset is written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ASSET = Path(__file__).resolve().parent / "ckpt_v0"
ROOT = Path(__file__).resolve().parents[2]

# Flags shared by the CLI runs: one device, f32, a log and a save at every step, nothing else
# written. `{asset}` is the asset directory (the test passes its own copy).
COMMON = [
    "--max_steps", "2",
    "--logging_steps", "1",
    "--save_strategy", "steps",
    "--save_steps", "1",
    "--eval_strategy", "no",
    "--disable_tqdm", "true",
    "--report_to", "none",
    "--bf16", "false",
    "--gradient_checkpointing", "false",
    "--mesh_data", "1",
    "--mesh_fsdp", "1",
    "--seed", "0",
    "--learning_rate", "1e-3",
    "--lr_scheduler_type", "constant",
    "--model_name_or_path", "{asset}/model",
]  # fmt: skip
CLI_RUNS = {
    "dpo": [
        "--algo", "dpo",
        "--dataset_name", "{asset}/data/dpo.jsonl",
        "--per_device_train_batch_size", "4",
        "--max_length", "16",
    ],
    "grpo": [
        "--algo", "grpo",
        "--dataset_name", "{asset}/data/grpo.jsonl",
        # A reward that varies within a group (the random model never adds up right, so
        # arith_correct would give zero advantages, zero gradients and an unchanged model).
        "--reward_funcs", "make_ckpt_v0.completion_length",
        "--per_device_train_batch_size", "8",
        "--num_generations", "4",
        "--max_completion_length", "4",
    ],
}  # fmt: skip
# DDPO's CLI draws its prompts from a generator that a resumed process starts afresh, so the
# DDPO run uses the trainer with one fixed prompt instead.
DDPO = dict(
    num_epochs=2,
    save_freq=1,
    sample_num_steps=2,
    sample_batch_size=2,
    sample_num_batches_per_epoch=1,
    train_batch_size=2,
    train_learning_rate=1e-2,
    mixed_precision="no",
    mesh_fsdp=1,
    seed=0,
)
DATA_ROWS = 16


def completion_length(completions: list, **_: Any) -> list[float]:
    """GRPO's reward: the completion's length in characters."""
    return [float(len(c)) for c in completions]


def brightness(images, prompts, metadata):
    """DDPO's reward: each image's mean pixel value."""
    return images.mean(axis=(1, 2, 3)), {}


def prompt() -> tuple[str, dict]:
    """DDPO's prompt function: one fixed prompt."""
    return "a photo of a cat", {}


def cli_argv(run: str, asset: Path, output_dir: Path, *extra: str) -> list[str]:
    """`jaxrl.train` arguments of `run` on the asset at `asset`, writing to `output_dir`."""
    flags = [f.format(asset=asset) for f in (*CLI_RUNS[run], *COMMON)]
    return [*flags, "--output_dir", str(output_dir), *extra]


def ddpo_trainer(asset: Path, logdir: Path, **kw: Any):
    """The DDPO run's trainer on the asset at `asset`, writing to `logdir`."""
    from jaxrl.trainers.ddpo import DDPOTrainer
    from jaxrl.trainers.ddpo_config import DDPOConfig

    config = DDPOConfig(**DDPO, logdir=str(logdir), pretrained_model=str(asset / "sd"), **kw)
    return DDPOTrainer(config, brightness, prompt)


def step_lines(path: Path) -> list[dict]:
    """The per-step lines of a metrics.jsonl (the wall-clock summary differs per run)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if "train_runtime" not in r]


def _model(dest: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from jaxrl.data import task

    config = Qwen2Config(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(dest)
    task.load_tokenizer().save_pretrained(dest)


def _data(dest: Path) -> None:
    from jaxrl.data import task

    dest.mkdir(parents=True)
    for name, source in (("dpo", "dpo_train.jsonl"), ("grpo", "sft_train.jsonl")):
        rows = task.asset_path(source).read_text().splitlines()[:DATA_ROWS]
        (dest / f"{name}.jsonl").write_text("\n".join(rows) + "\n")


def _keep(out: Path, dest: Path) -> None:
    name = "checkpoint-1"
    shutil.copytree(out / "checkpoints" / name, dest / "checkpoints" / name)
    shutil.copy(out / "metrics.jsonl", dest / "metrics.jsonl")


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import conftest  # noqa: F401  (the suite's XLA flags and matmul precision, before JAX loads)

    from jaxrl.models.diffusion.tiny import tiny_pipeline
    from jaxrl.train import main as train

    if ASSET.exists():
        shutil.rmtree(ASSET)
    ASSET.mkdir(parents=True)
    _model(ASSET / "model")
    shutil.copytree(tiny_pipeline(), ASSET / "sd")
    _data(ASSET / "data")
    commands = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in CLI_RUNS:
            out = Path(tmp) / run
            if train(cli_argv(run, ASSET, out)) != 0:
                raise SystemExit(f"the {run} run failed")
            _keep(out, ASSET / run)
            rel = cli_argv(run, Path("tests/assets/ckpt_v0"), Path(f"OUT/{run}"))
            commands.append(f"python -m jaxrl.train {' '.join(rel)}")
        ddpo_trainer(ASSET, Path(tmp) / "ddpo").train()
        _keep(Path(tmp) / "ddpo", ASSET / "ddpo")
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    (ASSET / "README.txt").write_text(
        "Checkpoints of jaxrl before the house redesign, resumed by "
        "tests/test_checkpoint_compat.py.\n"
        f"Written by tests/assets/make_ckpt_v0.py at commit {commit},\n"
        "under the test suite's XLA flags and matmul precision (tests/conftest.py), all runs in\n"
        "one process (`PYTHONPATH=$PWD python tests/assets/make_ckpt_v0.py`).\n\n"
        "model/    a tiny random Qwen2 (2 layers, width 32, torch seed 0) + the arith tokenizer\n"
        "sd/       the tiny random SD pipeline of jaxrl.models.diffusion.tiny (v2)\n"
        f"data/     the first {DATA_ROWS} rows of jaxrl/assets/arith/dpo_train.jsonl and "
        "sft_train.jsonl\n"
        "RUN/checkpoints/checkpoint-1/   the orbax checkpoint after step 1 of a 2-step run\n"
        "RUN/metrics.jsonl               that uninterrupted run's metrics\n\n"
        "Commands (OUT a scratch directory; only checkpoint-1 and metrics.jsonl are kept; the\n"
        "GRPO reward is make_ckpt_v0.completion_length, with tests/assets on sys.path):\n"
        + "\n".join(commands)
        + "\nddpo: DDPOTrainer(DDPOConfig(**make_ckpt_v0.DDPO, logdir=OUT/ddpo, "
        "pretrained_model=tests/assets/ckpt_v0/sd),\n"
        "                  make_ckpt_v0.brightness, make_ckpt_v0.prompt).train()\n"
        f"      DDPO = {DDPO}\n"
        "\nDo not regenerate this asset to make a failing compatibility test pass: it is the\n"
        "old layout the current code must still read.\n"
    )


if __name__ == "__main__":
    main()
