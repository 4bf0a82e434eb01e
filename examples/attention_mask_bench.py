"""Does passing the key-visibility mask cost cuDNN flash attention time? One JSON line per way of
stating the same visibility, forward + backward:

    python examples/attention_mask_bench.py [--impl cudnn] [--batch 8] [--seq_len 1024]
        [--heads 14] [--kv_heads 2] [--head_dim 64] [--steps 20] [--warmup 3]

- `dense_mask`: causal plus a `[B, 1, T, S]` boolean mask, as jaxrl's models pass a packing or
  left-padding mask (cuDNN receives it as a bias, `fmhaScaleBiasSoftmax`, read per head, and
  writes its gradient);
- `causal_only`: causality alone (`fmhaSoftmax`), which for right-padded rows holding one
  document each is exact at every real token (their keys never lie after a real query): what
  the SFT, DPO and reward trainers now run for unpacked batches (`algos.masks.model_masks`);
- `seq_lengths`: causality plus per-row lengths (cuDNN's padding-causal mask, no bias).

Every row is full length here, so the three must agree: each line reports the largest
difference of its output and gradients from `dense_mask`'s. Defaults are Qwen2.5-0.5B's
attention at B=8, T=1024 in bf16 (`--impl xla` runs the same comparison through XLA's
attention, e.g. on CPU).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp


def variants(batch: int, seq_len: int) -> dict[str, dict]:
    mask = jnp.ones((batch, 1, seq_len, seq_len), bool)
    lengths = jnp.full((batch,), seq_len, jnp.int32)
    return {
        "dense_mask": {"mask": mask},
        "causal_only": {},
        "seq_lengths": {"query_seq_lengths": lengths, "key_value_seq_lengths": lengths},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default="cudnn", choices=("cudnn", "xla"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    o = p.parse_args(argv)
    dtype = jnp.dtype(o.dtype)
    kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (o.batch, o.seq_len, o.heads, o.head_dim), dtype)
    k = jax.random.normal(kk, (o.batch, o.seq_len, o.kv_heads, o.head_dim), dtype)
    v = jax.random.normal(kv, (o.batch, o.seq_len, o.kv_heads, o.head_dim), dtype)
    g = jax.random.normal(kg, q.shape, dtype)  # the output's cotangent
    reference = None
    for name, kwargs in variants(o.batch, o.seq_len).items():

        def attention(q, k, v, kwargs=kwargs):
            return jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation=o.impl, **kwargs
            )

        @jax.jit
        def step(q, k, v, attention=attention):
            out, vjp = jax.vjp(attention, q, k, v)
            return out, vjp(g)

        result = step(q, k, v)
        for _ in range(o.warmup):
            result = step(q, k, v)
        jax.block_until_ready(result)
        t0 = time.perf_counter()
        for _ in range(o.steps):
            result = step(q, k, v)
        jax.block_until_ready(result)
        ms = (time.perf_counter() - t0) / o.steps * 1e3
        arrays = [x.astype(jnp.float32) for x in jax.tree.leaves(result)]  # output, dq, dk, dv
        reference = arrays if reference is None else reference
        diff = max(float(jnp.max(jnp.abs(a - r))) for a, r in zip(arrays, reference, strict=True))
        print(json.dumps({"variant": name, "impl": o.impl, "ms": round(ms, 4), "max_diff": diff}))


if __name__ == "__main__":
    main()
