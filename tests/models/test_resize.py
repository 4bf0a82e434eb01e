"""`jaxrl.models.resize.resize_token_embeddings` against transformers' `resize_token_embeddings`
(mean resizing, pad_to_multiple_of, shrinking) on a tiny untied Qwen2 with more tokens than
hidden units (so the old rows' covariance is positive definite and new rows are sampled)."""

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxrl.models import from_pretrained, save_pretrained
from jaxrl.models.resize import resize_token_embeddings, resized_vocab_size
from tests.model_calls import jit_call

VOCAB, HIDDEN = 96, 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("resize_qwen2")
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def _theirs(model_dir, new_num_tokens, pad_to_multiple_of):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.resize_token_embeddings(new_num_tokens, pad_to_multiple_of=pad_to_multiple_of)
    return model


def _tables(model):
    embed = np.asarray(model.model.embed_tokens.embedding.get_value())
    return embed, np.asarray(model.lm_head.kernel.get_value()).T


def test_grow_and_shrink_like_transformers(model_dir, tmp_path):
    ids = np.arange(VOCAB, dtype=np.int32)[None, :48]
    for new_num_tokens, multiple, size in ((130, 64, 192), (40, 64, 64), (100, None, 100)):
        assert resized_vocab_size(new_num_tokens, multiple) == size
        theirs = _theirs(model_dir, new_num_tokens, multiple)
        ours = from_pretrained(str(model_dir))
        assert resize_token_embeddings(ours, new_num_tokens, pad_to_multiple_of=multiple) == size
        assert ours.config.vocab_size == ours.config.hf_config.vocab_size == size
        for got, want in zip(
            _tables(ours),
            (theirs.get_input_embeddings().weight, theirs.lm_head.weight),
            strict=True,
        ):
            want = want.detach().numpy()
            assert got.shape == want.shape == (size, HIDDEN)
            kept = min(size, VOCAB)
            np.testing.assert_array_equal(got[:kept], want[:kept])
            if size > VOCAB:
                # Sampled around the old rows' mean with 1e-9 x their covariance: ~1e-6 apart
                # from transformers' own draw, and not all equal (the sampled branch ran).
                np.testing.assert_allclose(got[VOCAB:], want[VOCAB:], atol=1e-5)
                assert np.ptp(got[VOCAB:], axis=0).max() > 0
        logits = np.asarray(jit_call(ours, ids))
        with torch.no_grad():
            want_logits = theirs(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
        np.testing.assert_allclose(logits, want_logits, atol=2e-5)
    # The export is a checkpoint of the new size that transformers loads as it is.
    save_pretrained(ours, tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.config.vocab_size == 100
    np.testing.assert_array_equal(loaded.lm_head.weight.detach().numpy(), _tables(ours)[1])


def test_resize_on_a_mesh_keeps_the_vocab_sharding(model_dir):
    from jaxrl import parallel

    mesh = parallel.config_mesh(1, 2, 2, devices=jax.devices()[:4])
    ours = from_pretrained(str(model_dir), mesh=mesh)
    before = ours.lm_head.kernel.get_value().sharding.spec
    resize_token_embeddings(ours, 130, pad_to_multiple_of=64)
    embed, head = ours.model.embed_tokens.embedding, ours.lm_head.kernel
    assert head.get_value().sharding.spec == before and "tensor" in str(before)
    assert embed.get_value().shape == (192, HIDDEN) and embed.get_value().sharding.mesh == mesh


def test_refusals():
    with pytest.raises(ValueError, match="positive"):
        resized_vocab_size(0, 64)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        resized_vocab_size(10, 0)
