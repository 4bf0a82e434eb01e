"""The embedded arithmetic task: the offline default job of `python -m jaxrl.train`.

Prompts are two-digit additions such as `"12+35="` with completion `"47"`. Every operand pair
(a, b) with 10 <= a, b <= 99 lands in exactly one of two disjoint pools (held-out pairs are
never trained on), so held-out accuracy measures generalisation. Progress is measured by
`exact_match`: with teacher forcing, a prompt counts as solved when the argmax prediction at
every completion target (answer digits and EOS) is right, which equals greedy-decoding accuracy.

The shipped files under `jaxrl/assets/arith/` are produced by `examples/make_task_assets.py`
from the functions here; this module only reads them.
"""

from pathlib import Path
from typing import Any

import numpy as np

from jaxrl.data.char_tokenizer import build_char_tokenizer

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets" / "arith"
CHARS = "0123456789+="
# Difficulty, measured with a 0.8M-parameter transformer (PyTorch reference, one CPU thread,
# batch 64, AdamW lr 1e-3): two-digit operands reach ~16% held-out accuracy after 200 steps,
# ~76% after 400 and 100% after 600 (~100 s); three-digit operands (100..999) reach ~50% after
# 400 steps and ~90% after 650. Changing these constants changes every shipped asset.
OPERAND_MIN, OPERAND_MAX = 10, 99
NUM_HELD_OUT_PAIRS = 900  # of 90 * 90 pairs
SPLIT_SEED = 1234  # fixes which pairs are held out; changing it changes the task


def build_tokenizer() -> Any:
    """The task's character-level tokenizer (`<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3, digits,
    `+`, `=`)."""
    return build_char_tokenizer(CHARS)


def asset_path(name: str) -> Path:
    """Path of a shipped task asset, e.g. `"sft_train.jsonl"`, `"dpo_test.jsonl"`, `"tokenizer"`."""
    path = ASSETS_DIR / name
    if not path.exists():
        available = sorted(p.name for p in ASSETS_DIR.iterdir()) if ASSETS_DIR.exists() else []
        raise FileNotFoundError(
            f"No task asset {name!r} in {ASSETS_DIR} (available: {available}). Regenerate the "
            "assets with `python examples/make_task_assets.py`."
        )
    return path


def load_tokenizer() -> Any:
    """The shipped tokenizer, loaded offline with `AutoTokenizer.from_pretrained`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(asset_path("tokenizer")))


def operand_pairs(split: str) -> np.ndarray:
    """All `[n, 2]` operand pairs of `split` ("train" or "test"), in a fixed order."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    values = np.arange(OPERAND_MIN, OPERAND_MAX + 1)
    pairs = np.stack(np.meshgrid(values, values, indexing="ij"), axis=-1).reshape(-1, 2)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(pairs))
    held_out = order[:NUM_HELD_OUT_PAIRS]
    return pairs[held_out] if split == "test" else pairs[order[NUM_HELD_OUT_PAIRS:]]


def _sample_pairs(split: str, n: int, seed: int) -> np.ndarray:
    pool = operand_pairs(split)
    if n > len(pool):
        raise ValueError(
            f"Asked for {n} {split} examples but the {split} pool has {len(pool)} pairs."
        )
    return pool[np.random.default_rng([seed, len(pool)]).permutation(len(pool))[:n]]


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def wrong_answer(a: int, b: int, rng: np.random.Generator) -> str:
    """A plausible wrong sum: a dropped carry, one digit off by one, or off by ten."""
    correct = a + b
    width = len(str(OPERAND_MAX))
    no_carry = int(
        "".join(
            str((int(x) + int(y)) % 10)
            for x, y in zip(f"{a:0{width}d}", f"{b:0{width}d}", strict=True)
        )
    )
    digits = str(correct)
    candidates = {no_carry, correct + 10, correct - 10}
    for i in range(len(digits)):
        for delta in (-1, 1):
            d = int(digits[i]) + delta
            if 0 <= d <= 9 and not (i == 0 and d == 0):
                candidates.add(int(digits[:i] + str(d) + digits[i + 1 :]))
    options = sorted(c for c in candidates if c != correct and c >= 0)
    return str(options[rng.integers(len(options))])


def sft_examples(split: str, n: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` distinct prompt-completion examples `{"prompt": "12+35=", "completion": "47"}`."""
    return [
        {"prompt": prompt_text(a, b), "completion": str(a + b)}
        for a, b in _sample_pairs(split, n, seed).tolist()
    ]


def preference_examples(split: str, n: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` distinct `{"prompt", "chosen", "rejected"}` triples; chosen is the correct sum,
    rejected a plausible wrong one (`wrong_answer`)."""
    rng = np.random.default_rng([seed, 1])
    return [
        {"prompt": prompt_text(a, b), "chosen": str(a + b), "rejected": wrong_answer(a, b, rng)}
        for a, b in _sample_pairs(split, n, seed).tolist()
    ]


def is_correct(prompt: str, completion: str) -> bool:
    """Whether `completion` (special tokens already stripped) is the sum asked by `prompt`."""
    a, b = prompt.rstrip("=").split("+")
    return completion.strip() == str(int(a) + int(b))


def reward_fn(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """TRL reward-function signature: 1.0 for a correct sum, else 0.0."""
    return [float(is_correct(p, c)) for p, c in zip(prompts, completions, strict=True)]


def exact_match(pred_ids: Any, targets: Any, loss_mask: Any) -> np.ndarray:
    """Per-row `[B]` bool: the teacher-forced argmax `pred_ids` `[B, T]` equals `targets` `[B, T]`
    at every position where `loss_mask` `[B, T]` is set (the batch layout of `collate_sft`).
    Rows with no target count as wrong."""
    pred, tgt = np.asarray(pred_ids), np.asarray(targets)
    mask = np.asarray(loss_mask) > 0
    return np.all((pred == tgt) | ~mask, axis=-1) & mask.any(axis=-1)
