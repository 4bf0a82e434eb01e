"""`python -m jaxrl.bench` keeps its JSON contract (keys and types; never timing thresholds)."""

import json

import pytest

from jaxrl.bench import main

CONTRACT = ("algo", "step_s", "tokens_per_sec", "compile_s", "peak_bytes", "devices", "mfu")


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        [
            "--algo",
            "forward",
            "--preset",
            "llama-tiny",
            "--seq_len",
            "16",
            "--per_device_train_batch_size",
            "1",
            "--mesh_data",
            "-1",
            "--mesh_fsdp",
            "1",
        ],
        [
            "--algo",
            "dpo",
            "--preset",
            "qwen2-tiny",
            "--seq_len",
            "16",
            "--per_device_train_batch_size",
            "1",
            "--mesh_data",
            "-1",
            "--mesh_fsdp",
            "1",
            "--loss_type",
            "sigmoid",
            "--loss_weights",
            "null",
        ],
    ],
)
def test_last_line_is_the_json_contract(capsys, argv, tmp_path):
    assert main([*argv, "--steps", "1", "--warmup", "0", "--output_dir", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(CONTRACT) <= set(result)
    assert result["algo"] == argv[1] and result["devices"] == 8
    assert result["step_s"] > 0 and result["tokens_per_sec"] > 0 and result["peak_bytes"] > 0
    assert result["mfu"] is None  # CPU: peak FLOP/s unknown
    if argv[1] == "dpo":  # the embedded DPO config shares each prompt between the completions
        assert result["prefix_sharing"] is True
        # 8 pairs of 8 prompt + 8 + 8 completion tokens: TRL would count 8 * 32 tokens.
        assert result["computed_tokens_per_step"] == 8 * 24
        assert result["tokens_per_step"] == 8 * 32


def test_distill_divergence_memory_stays_below_the_full_logits():
    """`--algo distill`'s memory probe on jaxrl's side: the compiled forward+backward of the
    chunked divergence plans far less temporary memory than one full f32 `[B, C, V]` logits
    array (two such arrays, student and teacher, are what an unchunked divergence holds)."""
    from jaxrl.bench.distill import memory_child

    B, C, V = 2, 4096, 4000
    out = memory_child("jaxrl", f"{B},{C},32,48,{V}")
    full = B * C * V * 4
    assert 0 < out["xla_temp_bytes"] < full / 4
    assert out["peak_rss_delta_bytes"] >= 0
