"""`python -m jaxrl.train` with only model and data flags trains like TRL 1.16 with its defaults.

Each algorithm runs five full-batch steps of TRL's own trainer (PyTorch, CPU) with TRL's default
config and of the jaxrl CLI with nothing but `--model_name_or_path`, `--dataset_name` and the run
bookkeeping (`--output_dir`, `--max_steps 5`, `--logging_steps 1`, `--disable_tqdm`, and on both
sides `save_strategy="no"`: no checkpoint is compared, and saving one costs more than the five
steps); the per-step losses agree.
The batch is the whole 8-example dataset, so data order cannot make the runs differ.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from xla_flags import with_devices

from jaxrl.data import task

ROOT = Path(__file__).resolve().parents[1]
MODEL = task.asset_path("sft_model")  # a tiny trained Qwen2-shaped model with its tokenizer
STEPS = 5


def _dataset(tmp_path: Path, name: str) -> Path:
    rows = task.asset_path(f"{name}_train.jsonl").read_text().splitlines()[:8]
    out = tmp_path / f"{name}_data"
    out.mkdir()
    (out / "train.jsonl").write_text("\n".join(rows) + "\n")
    return out


def _reward_model(tmp_path: Path) -> Path:
    """The tiny model with a seeded score head, so both sides start from the same weights."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(MODEL), num_labels=1)
    out = tmp_path / "rm"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(MODEL)).save_pretrained(out)
    return out


def _trl_losses(
    algo: str, model: Path, data: Path, out: Path, bf16: bool | None, pad_token: str | None
) -> list[float]:
    import datasets
    import trl

    train = datasets.load_dataset(str(data), split="train")
    config_cls, trainer_cls = {
        "sft": (trl.SFTConfig, trl.SFTTrainer),
        "reward": (trl.RewardConfig, trl.RewardTrainer),
        "dpo": (trl.DPOConfig, trl.DPOTrainer),
    }[algo]
    # use_cpu: HF refuses TRL's default bf16=True on a machine without a GPU unless told to.
    args = config_cls(
        output_dir=str(out),
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=bf16,
        **({"pad_token": pad_token} if pad_token else {}),
    )
    trainer = trainer_cls(model=str(model), args=args, train_dataset=train)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _start_jaxrl(
    runs: list[tuple[str, Path, Path, Path, tuple[str, ...]]], log: Path
) -> subprocess.Popen:
    """Start `python -m jaxrl.train --algo ALGO --model_name_or_path MODEL --dataset_name DATA
    --output_dir OUT ...` for each (algo, model, data, out, flags); the runs go one after another
    through `jaxrl.train.main` in one process (one `import jaxrl`), its output to `log`."""
    argvs = [
        ["--algo", algo, "--model_name_or_path", str(model), "--dataset_name", str(data),
         "--output_dir", str(out), "--max_steps", str(STEPS), "--logging_steps", "1",
         "--disable_tqdm", "true", "--save_strategy", "no", *flags]
        for algo, model, data, out, flags in runs
    ]  # fmt: skip
    # One CPU device, as TRL's single process: the same per-device batch is the same batch.
    env = dict(os.environ, XLA_FLAGS=with_devices(1))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    script = (
        "import json, sys\n"
        "from jaxrl.train import main\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    if main(argv):\n"
        "        sys.exit(f'failed: {argv}')\n"
    )
    cmd = [sys.executable, "-c", script, json.dumps(argvs)]
    # Output to a file, not a pipe: nothing reads a pipe while TRL's runs go.
    with open(log, "w") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)


def _jaxrl_losses(
    proc: subprocess.Popen, log: Path, runs: list[tuple[str, Path, Path, Path, tuple[str, ...]]]
) -> list[list[float]]:
    """Per-step losses of `_start_jaxrl(runs, log)`'s runs, once its process has ended."""
    try:
        proc.wait(timeout=1200)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, log.read_text()[-3000:]
    losses = []
    for _, _, _, out, _ in runs:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in rows if "loss" in r])
    return losses


CASES = [(algo, precision) for precision in ("default", "f32") for algo in ("sft", "reward", "dpo")]
# A tokenizer whose pad is its EOS (TRL's fallback when it has no pad token): transformers'
# score head then skips the appended EOS, and so must jaxrl's.
CASES.append(("reward", "f32, pad = eos"))


# TRL's default precision is bf16: torch autocast (on CPU here), which jaxrl's bf16 follows (f32
# residual stream, bf16 matmuls and logits). Measured max gaps over the 5 steps: SFT 1.3e-3,
# reward 1.3e-3, DPO 4e-4 (bf16 gradients round differently); in f32 (`bf16=False` on both)
# under 1e-6.
@pytest.mark.slow
def test_cli_defaults_reproduce_trl_losses(tmp_path):
    """SFT, reward and DPO, each in TRL's default precision and in f32. One test for the six
    cases, plus reward with pad = eos: the jaxrl CLI runs share one process."""
    from transformers import AutoTokenizer

    data = {name: _dataset(tmp_path, name) for name in ("sft", "dpo")}
    rm = _reward_model(tmp_path)
    eos = AutoTokenizer.from_pretrained(str(rm)).eos_token
    assert AutoTokenizer.from_pretrained(str(rm)).pad_token != eos

    def flags(precision: str) -> tuple[str, ...]:
        f32 = ("--bf16", "false") if precision.startswith("f32") else ()
        return f32 + (("--pad_token", eos) if "pad = eos" in precision else ())

    runs = [
        (
            algo,
            rm if algo == "reward" else MODEL,
            data["sft" if algo == "sft" else "dpo"],
            tmp_path / f"jaxrl-{algo}-{precision.replace(' ', '')}",
            flags(precision),
        )
        for algo, precision in CASES
    ]
    # The jaxrl runs go in their own process while TRL's run here.
    import torch

    log = tmp_path / "jaxrl.log"
    proc = _start_jaxrl(runs, log)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core each: TRL here, jaxrl there
    try:
        all_theirs = []
        for (algo, precision), (_, model, dataset, _, _) in zip(CASES, runs, strict=True):
            f32 = precision.startswith("f32")
            out = tmp_path / f"trl-{algo}-{precision.replace(' ', '')}"
            pad = eos if "pad = eos" in precision else None
            bf16 = False if f32 else None
            all_theirs.append(_trl_losses(algo, model, dataset, out, bf16=bf16, pad_token=pad))
    except BaseException:
        proc.kill()
        raise
    finally:
        torch.set_num_threads(threads)
    all_ours = _jaxrl_losses(proc, log, runs)
    for (algo, precision), ours, theirs in zip(CASES, all_ours, all_theirs, strict=True):
        case = f"{algo}, {precision} precision"
        assert len(ours) == len(theirs) == STEPS, case
        np.testing.assert_allclose(ours, theirs, atol=2e-3, rtol=0, err_msg=case)
        assert theirs[-1] < theirs[0], case  # the five steps do train
