"""`--algo generate`: `jaxrl.generation.Sampler` (its default continuous engine, and the static
one) against transformers `generate` (PyTorch) on the same random model, prompts and sampling
settings (TRL's GRPO defaults: temperature 1, no top-k/top-p); one step is one whole `generate`
call, the timed calls alternate the three sides. Must not train anything.

`--lengths fixed` (default): no EOS, every row generates `max_new_tokens`. `--lengths longtail`:
each row's completion length is drawn from a capped exponential (mean about a quarter of the
cap, a few rows at the cap) and every side ends the row there with EOS (jaxrl: the row's own
`max_new_tokens`; transformers: a logits processor forcing EOS at that length and banning it
before), so all sides produce the same useful tokens; tokens/s counts those.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import jax
import numpy as np

from jaxrl import models
from jaxrl.bench.common import mfu_of, peak_memory, timed
from jaxrl.generation import GenerationConfig, Sampler
from jaxrl.models import presets


def _generate_bench_model() -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )


def _generate_flags(argv: list[str]) -> Any:
    parser = argparse.ArgumentParser(prog="python -m jaxrl.bench --algo generate")
    parser.add_argument("--algo", choices=["generate"], required=True)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--torch_threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lengths", choices=["fixed", "longtail"], default="fixed")
    parser.add_argument(
        "--num_slots", type=int, default=None,
        help="the continuous engine's decode slots (default: the sampler's own default)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32",
        help="weights and activations on both sides (transformers runs on CUDA when it can)",
    )  # fmt: skip
    return parser.parse_args(argv)


def longtail_lengths(batch: int, cap: int, seed: int) -> np.ndarray:
    """[batch] completion lengths in [1, cap]: ceil of an exponential of mean cap / 4, capped
    (about 2% of the rows at the cap), with at least one row at the cap."""
    rng = np.random.default_rng(seed + 1)
    lengths = np.minimum(np.ceil(rng.exponential(cap / 4, batch)), cap).astype(np.int32)
    lengths = np.maximum(lengths, 1)
    lengths[rng.integers(batch)] = cap
    return lengths


def _eos_at(lengths: np.ndarray, prompt_len: int, eos: int) -> Any:
    """A transformers logits processor: row b's token i (0-based) is EOS when i + 1 ==
    lengths[b], never before."""
    import torch
    import transformers

    class EosAt(transformers.LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            step = input_ids.shape[1] - prompt_len
            at = torch.as_tensor(lengths, device=scores.device) == step + 1
            scores[:, eos] = -float("inf")
            scores[at] = -float("inf")
            scores[at, eos] = 0.0
            return scores

    return transformers.LogitsProcessorList([EosAt()])


def run_generate(argv: list[str]) -> dict:
    """Sampler vs transformers `generate` on one random model (see the module docstring)."""
    import torch
    import transformers

    flags = _generate_flags(argv)
    if flags.torch_threads:
        torch.set_num_threads(flags.torch_threads)
    hf_config = (
        _generate_bench_model() if flags.preset is None else presets.get_preset(flags.preset)
    )
    hf_config.eos_token_id = None  # every row generates max_new_tokens on both sides
    torch.manual_seed(flags.seed)
    torch_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        torch_model.save_pretrained(tmp)
        model = models.from_pretrained(tmp, dtype=flags.dtype, param_dtype=flags.dtype)
    torch_device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_model = torch_model.to(torch_device, getattr(torch, flags.dtype))
    batch, prompt_len, n_new = flags.batch, flags.prompt_len, flags.max_new_tokens
    ids = np.random.default_rng(flags.seed).integers(3, hf_config.vocab_size, (batch, prompt_len))
    gen = GenerationConfig(max_new_tokens=n_new, do_sample=True, top_k=0, top_p=1.0)
    lengths = (
        longtail_lengths(batch, n_new, flags.seed)
        if flags.lengths == "longtail"
        else np.full((batch,), n_new, np.int32)
    )
    samplers = {
        "continuous": Sampler(model, prompt_buckets=(prompt_len,), num_slots=flags.num_slots),
        "static": Sampler(model, prompt_buckets=(prompt_len,), engine="static"),
    }
    seeds = iter(range(1 << 30))

    def jax_side(engine: str) -> Any:
        def generate() -> None:
            out = samplers[engine](None, ids, gen, seed=next(seeds), max_new_tokens=lengths)
            jax.block_until_ready(out)

        return generate

    jax_generate, static_generate = jax_side("continuous"), jax_side("static")
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    jax_generate()
    first_call_s = time.perf_counter() - t0
    timed(jax_generate, flags.warmup)
    static_generate()  # its compile, outside the timing
    timed(static_generate, flags.warmup)

    torch_ids = torch.from_numpy(ids).to(torch_device)
    eos = 1
    hf_kwargs = dict(
        input_ids=torch_ids,
        attention_mask=torch.ones_like(torch_ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
    )
    if flags.lengths == "longtail":
        hf_kwargs.update(eos_token_id=eos, logits_processor=_eos_at(lengths, prompt_len, eos))

    def hf_generate(max_new_tokens: int = n_new) -> None:
        with torch.no_grad():
            torch_model.generate(**hf_kwargs, max_new_tokens=max_new_tokens)
        if torch_device == "cuda":
            torch.cuda.synchronize()

    hf_generate(2)  # first-call setup outside the timing, as for jaxrl's compile
    # Alternate the sides call by call so all see the same load on this shared machine.
    jax_times, jax_cpu, static_times, hf_times, hf_cpu, loads = [], [], [], [], [], []
    sides = (
        (jax_generate, jax_times, jax_cpu),
        (static_generate, static_times, []),
        (hf_generate, hf_times, hf_cpu),
    )
    for _ in range(flags.steps):
        for fn, wall, cpu in sides:
            (w,), (c,) = timed(fn, 1)
            wall.append(w)
            cpu.append(c)
        loads.append(os.getloadavg()[0])
    load_after = os.getloadavg()[0]

    step_s, hf_step_s = float(np.median(jax_times)), float(np.median(hf_times))
    static_step_s = float(np.median(static_times))
    tokens = int(lengths.sum())
    devices = jax.devices()
    # Forward FLOPs of every token run (prompt + generated), attention at the mean context.
    fwd_flops = presets.flops_per_token(hf_config, prompt_len + n_new // 2) / 3
    mfu = mfu_of(fwd_flops * (batch * prompt_len + tokens), step_s)
    peak_bytes, peak_src = peak_memory()
    return {
        "algo": "generate",
        "step_s": step_s,
        "tokens_per_sec": tokens / step_s,
        "compile_s": max(first_call_s - step_s, 0.0),
        "peak_bytes": peak_bytes,
        "peak_bytes_source": peak_src,
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "mfu": mfu,
        "step_s_all": jax_times,
        "cpu_s": float(np.median(jax_cpu)),
        "cpu_s_all": jax_cpu,
        "transformers_step_s": hf_step_s,
        "transformers_step_s_all": hf_times,
        "transformers_cpu_s": float(np.median(hf_cpu)),
        "transformers_cpu_s_all": hf_cpu,
        "transformers_tokens_per_sec": tokens / hf_step_s,
        "static_step_s": static_step_s,
        "static_step_s_all": static_times,
        "static_tokens_per_sec": tokens / static_step_s,
        "speedup_vs_static": static_step_s / step_s,
        "engine": "continuous",
        "num_slots": samplers["continuous"].slots_for(batch, model.config, prompt_len, gen),
        "lengths": flags.lengths,
        "mean_completion_len": float(lengths.mean()),
        "rows_at_cap": int((lengths == n_new).sum()),
        "speedup_vs_transformers": hf_step_s / step_s,
        "cpu_time_ratio_vs_transformers": float(np.median(hf_cpu) / np.median(jax_cpu)),
        "torch_threads": torch.get_num_threads(),
        "load_avg_before_after": [load_before, load_after],
        "load_avg_per_round": loads,
        "cpu_count": os.cpu_count(),
        "batch": batch,
        "prompt_len": prompt_len,
        "max_new_tokens": n_new,
        "dtype": flags.dtype,
        "transformers_device": torch_device,
        "tokens_per_step": tokens,
        "preset": flags.preset,
        "steps": flags.steps,
    }
