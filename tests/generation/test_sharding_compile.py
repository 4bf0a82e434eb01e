"""The sampler on an 8-device (data=2, fsdp=2, tensor=2) mesh gives the unsharded results, keeps
its cache sharded by batch and kv heads, and compiles once per prompt bucket."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxrl import models
from jaxrl.generation import GenerationConfig, Sampler
from jaxrl.models.kv_cache import cache_shardings
from jaxrl.parallel import make_mesh
from tests.generation.conftest import PAD, ragged_prompts

N_NEW = 6


@pytest.mark.slow
def test_sharded_equals_unsharded(hf_causal):
    path = hf_causal("qwen3").path
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded_model = models.from_pretrained(path, mesh=mesh, scan_layers=True)
    sharded = Sampler(sharded_model, mesh=mesh)
    plain = Sampler(models.from_pretrained(path))
    prompts = ragged_prompts(seed=4)
    for config, seed in [
        (GenerationConfig(max_new_tokens=N_NEW, pad_token_id=PAD), 0),
        (GenerationConfig(max_new_tokens=N_NEW, pad_token_id=PAD, do_sample=True, top_p=0.9), 3),
    ]:
        got, want = (
            sharded(None, prompts, config, seed=seed),
            plain(None, prompts, config, seed=seed),
        )
        np.testing.assert_array_equal(np.asarray(got.completion_ids_BN), want.completion_ids_BN)
        np.testing.assert_array_equal(np.asarray(got.completion_mask_BN), want.completion_mask_BN)
        np.testing.assert_allclose(np.asarray(got.logprobs_BN), want.logprobs_BN, atol=1e-5)
        assert got.completion_ids_BN.sharding.spec[0] == ("data", "fsdp")
    # The (scanned: layer-stacked) cache is split by batch over data x fsdp, kv heads over tensor.
    spec = cache_shardings(sharded_model.config, 4, 21, mesh).k.spec
    assert spec == PartitionSpec(None, ("data", "fsdp"), "tensor", None, None)
    with pytest.raises(ValueError, match="data-parallel size 4"):
        sharded(None, prompts[:3], config)


def test_compiles_once_per_prompt_bucket(hf_causal):
    # An executable is either compiled by XLA or, with the persistent cache on (the test suite
    # turns it on), read from it: count both.
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: (
            compiles.append(event)
            if event == "/jax/core/compile/backend_compile_duration"
            else None
        )
    )
    jax.monitoring.register_event_listener(
        lambda event, **kw: (
            compiles.append(event) if event == "/jax/compilation_cache/cache_hits" else None
        )
    )
    sampler = Sampler(models.from_pretrained(hf_causal("gpt2").path), prompt_buckets=(8, 16))
    config = GenerationConfig(max_new_tokens=N_NEW, pad_token_id=PAD)

    def new_compiles(lengths: tuple[int, ...]) -> int:
        before = len(compiles)
        jax.block_until_ready(sampler(None, ragged_prompts(seed=0, lengths=lengths), config))
        return len(compiles) - before

    assert new_compiles((3, 5)) > 0  # bucket 8: prefill and decode compile
    assert new_compiles((8, 1)) == 0
    assert new_compiles((2, 7)) == 0
    assert new_compiles((9, 4)) > 0  # bucket 16
    assert new_compiles((16, 12)) == 0
    assert new_compiles((6, 6)) == 0


@pytest.mark.slow
def test_continuous_on_a_mesh_equals_static_unsharded(hf_causal):
    """4 slots for 8 rows (refills mid-decode) on the 8-device mesh: the unsharded static
    engine's completions, sampled, with long-tailed per-row limits."""
    path = hf_causal("qwen3").path
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded = Sampler(models.from_pretrained(path, mesh=mesh), mesh=mesh, num_slots=4)
    plain = Sampler(models.from_pretrained(path), engine="static")
    config = GenerationConfig(max_new_tokens=N_NEW, pad_token_id=PAD, do_sample=True)
    kwargs = dict(seed=5, group_size=2, max_new_tokens=[1, 6, 2, 1, 6, 3, 2, 1])
    got = sharded(None, ragged_prompts(seed=4), config, **kwargs)
    want = plain(None, ragged_prompts(seed=4), config, **kwargs)
    np.testing.assert_array_equal(np.asarray(got.completion_ids_BN), want.completion_ids_BN)
    np.testing.assert_array_equal(np.asarray(got.completion_mask_BN), want.completion_mask_BN)
    np.testing.assert_allclose(np.asarray(got.logprobs_BN), want.logprobs_BN, atol=1e-5)
