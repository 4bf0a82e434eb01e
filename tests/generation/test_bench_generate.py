"""`python -m jaxrl.bench --algo generate` keeps the bench JSON contract and reports both sides."""

import json
import time

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxrl.bench import main
from jaxrl.generation import Sampler

CONTRACT = ("algo", "step_s", "tokens_per_sec", "compile_s", "peak_bytes", "devices", "mfu")
# What the bench's own timer adds around a call timed here (a function call, a finished
# block_until_ready), with room for descheduling on a loaded 2-core CI machine (a bound, not a
# speed: the bench's timer must enclose the call and not, e.g., its compilation).
SLACK_S = 0.5


def test_generate_bench_prints_the_json_contract(capsys, monkeypatch):
    """The reported times are those of the generate calls, timed here around the sampler and
    transformers' `generate` themselves: jaxrl's first call (compile) and its timed call,
    transformers' setup call (2 tokens) and its timed call; each side generated 2 x 3 tokens."""
    calls = {"continuous": [], "static": [], "transformers": []}
    sampler_call, hf_generate = Sampler.__call__, transformers.GenerationMixin.generate

    def timed(side, fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*a, **kw))
            calls[side or a[0].engine].append((time.perf_counter() - t0, out))
            return out

        return call

    monkeypatch.setattr(Sampler, "__call__", timed(None, sampler_call))
    monkeypatch.setattr(
        transformers.GenerationMixin, "generate", timed("transformers", hf_generate)
    )
    argv = ["--algo", "generate", "--preset", "llama-tiny", "--batch", "2", "--prompt_len", "4"]
    argv += ["--max_new_tokens", "3", "--steps", "1", "--warmup", "0", "--torch_threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # the flag sets it process-wide
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(CONTRACT) <= set(result)
    assert result["algo"] == "generate" and result["tokens_per_step"] == 2 * 3

    (first_s, _), (jax_s, out) = calls["continuous"]
    assert out.completion_ids_BN.shape == (2, 3)
    (_, _), (static_s, _) = calls["static"]
    assert static_s <= result["static_step_s"] <= static_s + SLACK_S
    (_, setup), (hf_s, hf_out) = calls["transformers"]
    assert tuple(setup.shape) == (2, 4 + 2) and tuple(hf_out.shape) == (2, 4 + 3)
    # The bench's timer encloses each call timed here, plus little else.
    assert jax_s <= result["step_s"] <= jax_s + SLACK_S
    assert hf_s <= result["transformers_step_s"] <= hf_s + SLACK_S
    assert 6 / (jax_s + SLACK_S) <= result["tokens_per_sec"] <= 6 / jax_s
    assert 6 / (hf_s + SLACK_S) <= result["transformers_tokens_per_sec"] <= 6 / hf_s
    assert result["compile_s"] == pytest.approx(first_s - result["step_s"], abs=SLACK_S)
    ratio = result["transformers_step_s"] / result["step_s"]
    assert result["speedup_vs_transformers"] == ratio
    assert result["torch_threads"] == 1 and result["mfu"] is None


def test_longtail_lengths_are_forced_alike_on_every_side(capsys, monkeypatch):
    """`--lengths longtail`: every side ends row b after exactly lengths[b] tokens (jaxrl's
    masks, transformers' first EOS), the lengths are long-tailed (mean well under the cap, one
    row at it) and tokens/s counts the useful tokens."""
    from jaxrl.bench.generate import longtail_lengths

    lengths = longtail_lengths(8, 16, seed=0)
    assert lengths.max() == 16 and lengths.min() >= 1 and lengths.mean() < 16 / 2
    big = longtail_lengths(4096, 64, seed=0)
    assert 14 <= big.mean() <= 18 and 0.005 < (big == 64).mean() < 0.05

    outs = {"jaxrl": [], "transformers": []}
    sampler_call, hf_generate = Sampler.__call__, transformers.GenerationMixin.generate

    def keep(side, fn):
        def call(*a, **kw):
            out = fn(*a, **kw)
            outs[side].append(out)
            return out

        return call

    monkeypatch.setattr(Sampler, "__call__", keep("jaxrl", sampler_call))
    monkeypatch.setattr(transformers.GenerationMixin, "generate", keep("transformers", hf_generate))
    argv = ["--algo", "generate", "--preset", "llama-tiny", "--batch", "8", "--prompt_len", "4"]
    argv += ["--max_new_tokens", "16", "--steps", "1", "--warmup", "0", "--lengths", "longtail"]
    argv += ["--num_slots", "3"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens_per_step"] == int(lengths.sum()) and result["num_slots"] == 3
    assert result["tokens_per_sec"] == pytest.approx(lengths.sum() / result["step_s"])
    assert result["static_tokens_per_sec"] == pytest.approx(
        lengths.sum() / result["static_step_s"]
    )
    for out in outs["jaxrl"]:
        assert np.asarray(out.completion_mask_BN).sum(axis=1).tolist() == lengths.tolist()
    hf = outs["transformers"][-1][:, 4:].numpy()
    first_eos = [int(np.flatnonzero(row == 1)[0]) + 1 for row in hf]
    assert first_eos == lengths.tolist()
