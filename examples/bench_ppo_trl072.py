"""TRL v0.7.2 side of `python -m jaxrl.bench --algo ppo` (run with the old-TRL venv:
`/work/.peer-trl072/bin/python examples/bench_ppo_trl072.py --out DIR ...`).

Builds the benchmark's tiny random GPT-2 and word-level tokenizer, saves both to `DIR/model`
(jaxrl loads the same weights from there), then times TRL's PPO loop as its examples write it:
`generate` (sampling, top-k/top-p off, exactly `max_new_tokens` per row), a Python reward on
the response ids, and `step()` (its own `time/ppo/*` split). Prints one JSON line of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import GPT2Config, PreTrainedTokenizerFast
from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer


def reward(responses: list) -> list:
    """The benchmark's score: the fraction of even token ids in each response."""
    return [torch.tensor(float((r % 2 == 0).float().mean())) for r in responses]


def build(out: str, vocab: int, seed: int) -> str:
    path = os.path.join(out, "model")
    words = {"<eos>": 0, **{f"t{i}": i for i in range(1, vocab)}}
    tok = Tokenizer(WordLevel(words, unk_token="<eos>"))
    tok.pre_tokenizer = WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab, n_positions=128, n_embd=128, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        __import__("transformers").GPT2LMHeadModel(cfg)
    )
    model.save_pretrained(path, safe_serialization=True)
    hf_tok.save_pretrained(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--mini_batch", type=int, default=8)
    p.add_argument("--ppo_epochs", type=int, default=4)
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch_threads", type=int, default=0, help="0: PyTorch's default")
    a = p.parse_args()
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    path = build(a.out, a.vocab, a.seed)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    config = PPOConfig(
        batch_size=a.batch, mini_batch_size=a.mini_batch, ppo_epochs=a.ppo_epochs,
        learning_rate=1.41e-5, seed=a.seed,
    )  # fmt: skip
    trainer = PPOTrainer(config, model, tokenizer=tokenizer)
    rng = np.random.default_rng(a.seed)
    gen_kwargs = dict(
        min_length=-1, top_k=0.0, top_p=1.0, do_sample=True, pad_token_id=0,
        max_new_tokens=a.max_new_tokens, min_new_tokens=a.max_new_tokens,
    )  # fmt: skip
    rows = {k: [] for k in ("generate", "score", "forward_pass", "update", "step", "total")}
    for step in range(a.steps + 1):  # step 0: warm-up
        queries = [torch.tensor(q) for q in rng.integers(1, a.vocab, (a.batch, a.prompt_len))]
        t0 = time.perf_counter()
        responses = trainer.generate(queries, batch_size=a.batch, return_prompt=False, **gen_kwargs)
        t1 = time.perf_counter()
        scores = reward(responses)
        t2 = time.perf_counter()
        stats = trainer.step(queries, responses, scores)
        t3 = time.perf_counter()
        if step == 0:
            continue
        rows["generate"].append(t1 - t0)
        rows["score"].append(t2 - t1)
        rows["forward_pass"].append(stats["time/ppo/forward_pass"])
        rows["update"].append(stats["time/ppo/total"] - stats["time/ppo/forward_pass"])
        rows["step"].append(t3 - t2)
        rows["total"].append(t3 - t0)
    result = {k: float(np.median(v)) for k, v in rows.items()}
    result["torch_threads"] = torch.get_num_threads()
    result["response_lengths"] = sorted({len(r) for r in responses})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
