"""`python -m jaxrl.bench --algo generate` keeps the bench JSON contract and reports both sides."""

import json

import torch

from jaxrl.bench import main

CONTRACT = ("algo", "step_s", "tokens_per_sec", "compile_s", "peak_bytes", "devices", "mfu")


def test_generate_bench_prints_the_json_contract(capsys):
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
    assert result["tokens_per_sec"] == 6 / result["step_s"]
    assert result["transformers_tokens_per_sec"] == 6 / result["transformers_step_s"]
    ratio = result["transformers_step_s"] / result["step_s"]
    assert result["speedup_vs_transformers"] == ratio
    assert result["torch_threads"] == 1 and result["mfu"] is None
