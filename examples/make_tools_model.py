"""Regenerate the tool-use task's assets under `jaxrl/assets/arith/` (`jaxrl.data.tool_task`).

1. `tools_task/train.jsonl`, `tools_task/test.jsonl`: the conversational prompts of
   `python -m jaxrl.train --algo grpo --config arith_tools` (5-digit sums).
2. `tools_tokenizer/`: its character-level tokenizer with the tool-capable chat template and
   response template (a directory of its own: see `tool_task.TOOLS_TOKENIZER_DIR`).
3. `tools_model/`: a tiny Qwen2-shaped model (0.2M parameters) fine-tuned from scratch with SFT on a few
   hundred demonstrations, only a `CALL_FRACTION` of which call the `calculator` tool; the rest
   answer directly (and a model this small cannot add 6-digit numbers in its head). So the
   shipped model calls the tool now and then, and GRPO has room to teach it to call always.

Deterministic: the same files on every run (CPU, one minute or two).

    python examples/make_tools_model.py [--max_steps N]
"""

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import datasets
from transformers import Qwen2Config

from jaxrl import SFTConfig, SFTTrainer
from jaxrl.data import tool_task

NUM_DEMOS = 800
CALL_FRACTION = 0.5
NUM_TRAIN_PROMPTS, NUM_TEST_PROMPTS = 4000, 128


def model_config(vocab_size: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
    )


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(max_steps: int) -> None:
    data = tool_task.TOOLS_DATA_DIR
    write_jsonl(data / "train.jsonl", tool_task.prompts("train", NUM_TRAIN_PROMPTS))
    write_jsonl(data / "test.jsonl", tool_task.prompts("test", NUM_TEST_PROMPTS))
    tok = tool_task.build_tool_tokenizer()
    shutil.rmtree(tool_task.TOOLS_TOKENIZER_DIR, ignore_errors=True)
    tok.save_pretrained(str(tool_task.TOOLS_TOKENIZER_DIR))
    schema = json.dumps([tool_task.calculator_schema()])
    demos = [
        {**row, "tools": schema}
        for row in tool_task.demonstrations(NUM_DEMOS, CALL_FRACTION, seed=0)
    ]
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="jaxrl_make_tools_model_"),
        max_steps=max_steps,
        learning_rate=3e-3,
        per_device_train_batch_size=16,
        assistant_only_loss=True,
        mesh_fsdp=1,
        mesh_data=-1,
        bf16=False,
        logging_steps=100,
        save_strategy="no",
        warmup_steps=50,
        lr_scheduler_type="cosine",
        weight_decay=0.01,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = SFTTrainer(
        model_config(len(tok)),
        args=args,
        train_dataset=datasets.Dataset.from_list(demos),
        processing_class=tok,
    )
    trainer.train()
    out = tool_task.TOOLS_MODEL_DIR
    shutil.rmtree(out, ignore_errors=True)
    trainer.save_model(str(out))
    # Run details and library versions are not shipped; the tokenizer lives in tools_tokenizer/.
    for name in ("jaxrl_config.json", "README.md", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):  # fmt: skip
        (out / name).unlink(missing_ok=True)
    print("final train loss:", trainer.state.log_history[-2])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=1500)
    main(parser.parse_args().max_steps)
