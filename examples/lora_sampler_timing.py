"""Time GRPO-style sampling from a LoRA policy two ways, on CPU: through the adapter forward
(`x W + s x A B` in every adapted layer, what the online trainers do) and from a merged copy of
the weights (`W + s A B` folded in by one jitted call per generation, then the plain model).

    PYTHONPATH=. python examples/lora_sampler_timing.py [--hidden 32] [--layers 2]

Prints one JSON line per setting: median seconds per generation batch over interleaved repeats.
"""

import argparse
import json
import statistics
import time

import jax
import numpy as np
from flax import nnx
from transformers import Qwen2Config

from jaxrl import lora, models
from jaxrl.generation import GenerationConfig, Sampler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new_tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    hf = Qwen2Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=1,
    )
    model = models.from_config(hf, seed=0)
    cfg = lora.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    lora.apply_lora(model, cfg, nnx.Rngs(0))
    graphdef, adapter, base = lora.split_lora(model)
    plain_graphdef = nnx.graphdef(lora.merge_lora(model))
    merge = jax.jit(lambda ad, b: nnx.state(lora.merge_lora(nnx.merge(graphdef, ad, b))))
    adapter_sampler, merged_sampler = Sampler(graphdef), Sampler(plain_graphdef)
    gen = GenerationConfig(
        max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=True, eos_token_id=1
    )
    prompts = [list(range(3, 3 + 5 + i)) for i in range(a.prompts)]

    def through_adapter(seed):
        out = adapter_sampler(
            nnx.merge_state(adapter, base), prompts, gen, seed=seed, group_size=a.group
        )
        return jax.block_until_ready(out.completion_ids_BN)

    def merged(seed):
        out = merged_sampler(merge(adapter, base), prompts, gen, seed=seed, group_size=a.group)
        return jax.block_until_ready(out.completion_ids_BN)

    # Same tokens both ways (same model, same keys), up to float rounding of the merge.
    same = np.mean(np.asarray(through_adapter(0)) == np.asarray(merged(0)))
    times = {"adapter_forward": [], "merged": []}
    for i in range(a.repeats):
        for name, fn in (("adapter_forward", through_adapter), ("merged", merged)):
            t = time.perf_counter()
            fn(i + 1)
            times[name].append(time.perf_counter() - t)
    print(
        json.dumps(
            {
                "hidden": a.hidden,
                "layers": a.layers,
                "rows": a.prompts * a.group,
                "new_tokens": a.new_tokens,
                "token_agreement": float(same),
                **{f"{k}_s": statistics.median(v) for k, v in times.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
