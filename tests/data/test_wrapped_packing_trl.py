"""`packing_strategy="wrapped"` against TRL 1.16: its `_prepare_dataset` (called on a stand-in
trainer) packs the token stream and its `DataCollatorForLanguageModeling` collates the rows. TRL
does not turn padding-free on for wrapped packing, so each row is one ordinary causal sequence:
positions 0..L-1, attention across the documents of a row, and a document's first token trained
from the end of the one before it. jaxrl's collated batch must give the same rows, positions and
trained targets, and the same loss from the same weights."""

import string
import types

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import Qwen2ForCausalLM
from trl.data_utils import pack_dataset
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
from trl.trainer.sft_trainer import SFTTrainer as TRLSFTTrainer

from jaxrl.algos.masks import model_masks
from jaxrl.data import build_char_tokenizer, collate_sft, pack_wrapped, prepare_sft_dataset
from tests.trainers.trainer_utils import tiny_config

L = 8  # packed row length
# "U:<user text>\n" and "A:<assistant text><eos>", the assistant text and EOS marked as generated
# (tests/data/conftest.py's template, repeated: `conftest` is another module when the trainer
# tests are collected in the same run).
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}A:{% generation %}{{ m['content'] }}"
    "<eos>{% endgeneration %}{% else %}U:{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)

DATASETS = {
    "text": {"text": ["abcdef", "ab", "abcdefghijk", "xyz", "q"]},
    "prompt_completion": {
        "prompt": ["1+2=", "10+20=", "7+8=", "3+3="],
        "completion": ["3", "30", "15", "6"],
    },
    "messages": {
        "messages": [
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}],
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "abcdefg"}],
        ]
    },
}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(string.printable, chat_template=CHAT_TEMPLATE)


def trl_wrapped(ds, tok, *, completion_only_loss=False, assistant_only_loss=False):
    """TRL 1.16's prepared, wrapped-packed dataset (`input_ids`, `labels`)."""
    args = types.SimpleNamespace(
        dataset_num_proc=None,
        dataset_text_field="text",
        assistant_only_loss=assistant_only_loss,
        max_length=L,
        truncation_mode="keep_start",
        shuffle_dataset=False,
        packing_strategy="wrapped",
        seed=0,
    )
    fake = types.SimpleNamespace(
        _tokenizer=tok, completion_only_loss=completion_only_loss, chat_template=None
    )
    packed = TRLSFTTrainer._prepare_dataset(fake, ds, tok, args, True, None, "t")
    assert "seq_lengths" not in packed.column_names  # nothing marks the documents of a row
    return packed


def trl_wrapped_batch(ds, tok, *, completion_only_loss, assistant_only_loss, padding_free):
    """TRL's wrapped rows collated by its LM collator: per row the token ids, position ids, and
    which inputs are trained targets (`labels != -100` after the model's one-token shift: HF's
    causal-LM loss scores `labels[:, 1:]`)."""
    packed = trl_wrapped(
        ds, tok, completion_only_loss=completion_only_loss, assistant_only_loss=assistant_only_loss
    )
    rows = [packed[i] for i in range(len(packed))]
    collator = DataCollatorForLanguageModeling(
        pad_token_id=tok.pad_token_id, padding_free=padding_free
    )
    out = collator(rows)
    lengths = [len(r["input_ids"]) for r in rows]
    if padding_free:  # one flattened row: split it back into the packed rows
        splits = np.cumsum(lengths)[:-1]
        ids = np.split(out["input_ids"][0].numpy(), splits)
        labels = np.split(out["labels"][0].numpy(), splits)
        positions = np.split(out["position_ids"][0].numpy(), splits)
    else:
        assert "position_ids" not in out  # the model counts positions 0..L-1 itself
        ids = [out["input_ids"][b, :n].numpy() for b, n in enumerate(lengths)]
        labels = [out["labels"][b, :n].numpy() for b, n in enumerate(lengths)]
        positions = [np.arange(n) for n in lengths]
        assert out["attention_mask"].sum(1).tolist() == lengths
    # Input t predicts input t + 1; the row's first token has no predecessor in the row.
    targets = [np.r_[lab[1:] != -100, False] for lab in labels]
    return ids, positions, targets


def jaxrl_wrapped_batch(ds, tok, **kw):
    """jaxrl's wrapped rows collated: per row the token ids, positions and trained targets, and
    the packed dataset's columns and the batch (to check how the model is called)."""
    packed = prepare_sft_dataset(ds, tok, packing=True, packing_strategy="wrapped", max_length=L, **kw)  # fmt: skip
    batch = collate_sft(list(packed), seq_len=L, pad_token_id=tok.pad_token_id)
    lengths = batch["attention_mask"].sum(1)
    rows = (
        [batch["input_ids"][b, :n] for b, n in enumerate(lengths)],
        [batch["positions"][b, :n] for b, n in enumerate(lengths)],
        [batch["loss_mask"][b, :n] > 0 for b, n in enumerate(lengths)],
    )
    return rows, packed.column_names, batch


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize(
    ("kind", "completion_only_loss", "assistant_only_loss"),
    [
        ("text", False, False),
        ("prompt_completion", True, False),
        ("prompt_completion", False, False),
        ("messages", False, False),
        ("messages", False, True),
    ],
)
def test_wrapped_batch_matches_trl_collator(
    tok, kind, completion_only_loss, assistant_only_loss, padding_free
):
    """Rows, positions and trained targets of TRL's wrapped packing, with or without its
    `padding_free=True` (TRL warns; positions are then arange per row and each row's first
    label is masked, which gives the same targets)."""
    ds = Dataset.from_dict(DATASETS[kind])
    theirs = trl_wrapped_batch(
        ds,
        tok,
        completion_only_loss=completion_only_loss,
        assistant_only_loss=assistant_only_loss,
        padding_free=padding_free,
    )
    ours, columns, batch = jaxrl_wrapped_batch(
        ds, tok, completion_only_loss=completion_only_loss, assistant_only_loss=assistant_only_loss
    )
    assert len(ours[0]) == len(theirs[0]) > 1
    for name, a, b in zip(("input_ids", "positions", "targets"), ours, theirs, strict=True):
        for row, (x, y) in enumerate(zip(a, b, strict=True)):
            np.testing.assert_array_equal(x, y, err_msg=f"{name}, row {row}")
    # One plain causal sequence per row: no segment ids, so the model runs without a mask.
    assert columns == ["input_ids", "loss_mask"]
    assert "segment_ids" not in batch and model_masks(batch) == (None, None)


def test_wrapped_trains_across_documents_not_across_rows():
    """By hand: documents [1 2 3] [4 5] [6], rows of 4. The first token of [4 5] (4) is a
    target, predicted from 3; the continuation 5 starts a row and is not; 6 is, from 5."""
    docs = {"input_ids": [[1, 2, 3], [4, 5], [6]], "loss_mask": [[1, 1, 1], [1, 1], [1]]}
    packed = pack_wrapped(docs, 4)
    assert packed.to_dict() == {
        "input_ids": [[1, 2, 3, 4], [5, 6]],
        "loss_mask": [[1, 1, 1, 1], [1, 1]],
    }
    batch = collate_sft(list(packed), seq_len=4, pad_token_id=0)
    np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 3], [0, 1, 0, 0]])
    np.testing.assert_array_equal(batch["attention_mask"], [[1, 1, 1, 1], [1, 1, 0, 0]])
    np.testing.assert_array_equal(batch["targets"], [[2, 3, 4, 0], [6, 0, 0, 0]])
    np.testing.assert_array_equal(batch["loss_mask"], [[1, 1, 1, 0], [1, 0, 0, 0]])
    # TRL's rows and labels for the same documents
    theirs = pack_dataset(
        Dataset.from_dict({"input_ids": docs["input_ids"], "labels": docs["input_ids"]}),
        4,
        "wrapped",
    )
    assert theirs.column_names == ["input_ids", "labels"]
    assert theirs["input_ids"] == packed["input_ids"]


def test_wrapped_masked_first_token_stays_untrained():
    """A document whose first token is masked (a prompt) does not become a target at a
    document boundary; only its trained tokens do."""
    docs = {"input_ids": [[1, 2, 3], [4, 5, 6]], "loss_mask": [[0, 1, 1], [0, 0, 1]]}
    batch = collate_sft(list(pack_wrapped(docs, 6)), seq_len=6, pad_token_id=0)
    np.testing.assert_array_equal(batch["loss_mask"], [[1, 1, 0, 0, 1, 0]])


def test_wrapped_loss_matches_transformers_on_trl_batch(tok, tmp_path):
    """Same weights, same data: the token-mean NLL of jaxrl's wrapped batch equals the loss
    transformers computes on TRL's collated wrapped batch (attention crosses documents)."""
    import jax
    import jax.numpy as jnp

    from jaxrl import models
    from jaxrl.algos.sft import lm_forward

    config = tiny_config(vocab_size=len(tok))
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    ds = Dataset.from_dict(DATASETS["text"])

    packed = trl_wrapped(ds, tok)
    trl_batch = DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id)(list(packed))
    with torch.no_grad():
        want = hf(**trl_batch).loss.item()

    model = models.from_pretrained(str(tmp_path))
    ours = prepare_sft_dataset(ds, tok, packing=True, packing_strategy="wrapped", max_length=L)
    batch = collate_sft(list(ours), seq_len=L, pad_token_id=tok.pad_token_id)
    mb = {k: jnp.asarray(v) for k, v in batch.items()}
    logps = jax.jit(lambda mb: lm_forward(model, mb, None, False))(mb)
    mask = np.asarray(batch["loss_mask"])
    got = float(-(np.asarray(logps) * mask).sum() / mask.sum())
    np.testing.assert_allclose(got, want, rtol=1e-5)
