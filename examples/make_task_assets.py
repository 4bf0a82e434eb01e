"""Regenerate the embedded arithmetic task's assets under `jaxrl/assets/arith/`.

Deterministic: running it twice writes identical files. Writes the tokenizer directory and
`sft_train.jsonl`, `sft_test.jsonl`, `dpo_train.jsonl`, `dpo_test.jsonl`.

    python examples/make_task_assets.py [--out DIR]
"""

import argparse
import json
from pathlib import Path

from jaxrl.data import task

SIZES = {"sft_train": 4000, "sft_test": 500, "dpo_train": 2000, "dpo_test": 500}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=task.ASSETS_DIR)
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    task.build_tokenizer().save_pretrained(str(out / "tokenizer"))
    for name, n in SIZES.items():
        kind, split = name.split("_")
        make = task.sft_examples if kind == "sft" else task.preference_examples
        write_jsonl(out / f"{name}.jsonl", make(split, n, seed=0))
    print(f"wrote task assets to {out}")


if __name__ == "__main__":
    main()
