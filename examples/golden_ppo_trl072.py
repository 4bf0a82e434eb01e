"""Golden numbers for jaxrl's PPOTrainer from TRL v0.7.2's PPOTrainer (transformers 4.36).

Run with the peer environment that has TRL v0.7.2 installed:

    /work/.peer-trl072/bin/python examples/golden_ppo_trl072.py

For a tiny GPT-2 and a tiny Llama with a value head (seeded weights, saved with TRL's own
`save_pretrained`, so the files are exactly TRL's layout), fixed queries/responses/scores and
several configs, it runs three `PPOTrainer.step()` calls and writes under
`tests/golden/ppo_trl072_{gpt2,llama}/`:

- `init/`: config.json, model.safetensors (LM keys + `v_head.summary.*`), tokenizer files;
- `<case>.json`: the config overrides, every step's stats (scalars and arrays), and the
  `np.random.permutation` draws TRL used for minibatch order (so jaxrl replays the same order);
- `<case>_final/model.safetensors` for the base case: the weights after the three steps.

`max_grad_norm` cases rebuild TRL's one-shot parameter iterator before every step so that
clipping applies to every update (jaxrl's semantics; TRL v0.7.2 clips only the first one).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

OUT = Path(__file__).resolve().parent.parent / "tests" / "golden"
VOCAB = 64
BATCH = 4
STEPS = 3

QUERIES = [[5, 9, 13], [7, 3], [11, 12, 14, 20, 8], [30, 31, 2, 4]]
RESPONSES = [[21, 22, 23, 24], [40, 41, 42], [50, 51], [60, 61, 62, 63, 33]]
RESPONSE_MASKS = [[1, 1, 0, 1], [1, 0, 1], [1, 1], [0, 1, 1, 1, 1]]
SCORES = [[1.5, -0.5, 0.25, 2.0], [0.3, 1.2, -1.0, 0.7], [-0.2, 0.9, 1.1, -1.3]]

BASE = dict(
    batch_size=BATCH,
    mini_batch_size=BATCH,
    ppo_epochs=2,
    learning_rate=3e-3,
    seed=0,
)
CASES = {
    "gpt2": {
        "base": {},
        "ga2": dict(mini_batch_size=2, gradient_accumulation_steps=2),
        "mb2": dict(mini_batch_size=2),
        "kl_abs": dict(kl_penalty="abs"),
        "kl_mse": dict(kl_penalty="mse"),
        "kl_full": dict(kl_penalty="full"),
        "score_scaling": dict(use_score_scaling=True, use_score_norm=True, score_clip=0.5),
        "score_scaling_no_norm": dict(use_score_scaling=True),
        "fixed_kl_gamma": dict(adap_kl_ctrl=False, init_kl_coef=0.05, gamma=0.9, lam=0.8),
        "clip_grad": dict(max_grad_norm=0.05),
        "early_stop": dict(ppo_epochs=3, early_stopping=True, target_kl=0.001),
        "ratio_skip": dict(ratio_threshold=1.0005),
        "response_masks": dict(),
    },
    "llama": {
        "base": {},
        "ga2": dict(mini_batch_size=2, gradient_accumulation_steps=2),
    },
}


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", eos_token="t0", unk_token="t1"
    )


def base_model(family: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0 if family == "gpt2" else 1)
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, eos_token_id=0,
            bos_token_id=0, pad_token_id=0,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
            pad_token_id=0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # HF zero-inits biases and sets norms to 1: perturb to test mapping
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def to_jsonable(stats: dict) -> dict:
    out = {}
    for k, v in stats.items():
        if isinstance(v, np.ndarray):
            out[k] = np.asarray(v, np.float64).tolist()
        elif isinstance(v, (np.floating, np.integer, float, int)):
            out[k] = float(v)
        elif isinstance(v, torch.Tensor):
            out[k] = v.double().numpy().tolist()
        else:
            raise TypeError(f"{k}: {type(v)}")
    return out


def run_case(family: str, case: str, overrides: dict, init_dir: Path, out_dir: Path) -> None:
    config = PPOConfig(**{**BASE, **overrides})
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(init_dir))
    # v0.7.2's from_pretrained reads the value head only from pytorch_model.bin; the directory
    # holds what its save_pretrained writes under transformers 4.36 (model.safetensors), so
    # load the value head through TRL's own post_init.
    model.post_init(state_dict=load_file(str(init_dir / "model.safetensors")))
    tok = tokenizer()
    perms: list[list[int]] = []
    real_permutation = np.random.permutation

    def recording_permutation(n):
        p = real_permutation(n)
        perms.append(p.tolist())
        return p

    np.random.permutation = recording_permutation
    try:
        trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tok)
        steps = []
        for step in range(STEPS):
            if config.max_grad_norm is not None:
                # TRL v0.7.2 keeps a one-shot `filter` iterator; rebuild it so every update clips.
                trainer.model_params = [p for p in trainer.model.parameters() if p.requires_grad]
            masks = [torch.tensor(m) for m in RESPONSE_MASKS] if case == "response_masks" else None
            stats = trainer.step(
                [torch.tensor(q) for q in QUERIES],
                [torch.tensor(r) for r in RESPONSES],
                [torch.tensor(s) for s in SCORES[step]],
                response_masks=masks,
            )
            steps.append(to_jsonable(stats))
    finally:
        np.random.permutation = real_permutation
    record = {
        "config": {**BASE, **overrides},
        "queries": QUERIES,
        "responses": RESPONSES,
        "response_masks": RESPONSE_MASKS if case == "response_masks" else None,
        "scores": SCORES,
        "permutations": perms,
        "steps": steps,
    }
    (out_dir / f"{case}.json").write_text(json.dumps(record))
    if case == "base":
        final = out_dir / "base_final"
        model.save_pretrained(str(final))
        (final / "config.json").unlink()
    print(f"{family}/{case}: kl={steps[-1]['objective/kl']:.6f} "
          f"loss={steps[-1]['ppo/loss/total']:.6f}")  # fmt: skip


def main(families: list[str]) -> None:
    for family in families:
        out_dir = OUT / f"ppo_trl072_{family}"
        shutil.rmtree(out_dir, ignore_errors=True)
        init_dir = out_dir / "init"
        init_dir.mkdir(parents=True)
        model = AutoModelForCausalLMWithValueHead.from_pretrained(base_model(family))
        model.save_pretrained(str(init_dir))
        tokenizer().save_pretrained(str(init_dir))
        for case, overrides in CASES[family].items():
            run_case(family, case, overrides, init_dir, out_dir)


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
