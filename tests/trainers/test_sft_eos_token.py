"""`SFTConfig.eos_token` as TRL 1.16's SFTTrainer applies it: the tokenizer's EOS becomes it (chat
templates that render `{{ eos_token }}` use it, the pad token defaults to it, the saved tokenizer
carries it), the model config's `eos_token_id` is its id, and the model generation config's EOS
ids get it first, ahead of the old ones."""

import json
import shutil

import pytest
from datasets import Dataset
from trainer_utils import base_args, tiny_config

from jaxrl import SFTConfig, SFTTrainer
from jaxrl.data import build_char_tokenizer

END = "<|end|>"
END_ID = 16  # the char tokenizer below has 16 tokens; END is added after them
OLD_EOS_ID = 1  # "<eos>"
# Renders each message followed by the tokenizer's EOS.
EOS_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
MESSAGES = {
    "messages": [
        [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}],
        [{"role": "user", "content": "3+4"}, {"role": "assistant", "content": "7"}],
    ]
}
_PAD = object()


def make_tok(pad=_PAD):
    tok = build_char_tokenizer("0123456789+=", chat_template=EOS_TEMPLATE)
    tok.add_special_tokens({"additional_special_tokens": [END]})
    assert tok.convert_tokens_to_ids(END) == END_ID
    if pad is not _PAD:
        tok.pad_token = pad
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 causal LM (vocab 32, config eos 1) saved by transformers, without a
    generation_config.json (tests add one where they want it)."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_qwen2_32")
    Qwen2ForCausalLM(tiny_config(vocab_size=32)).save_pretrained(path)
    (path / "generation_config.json").unlink()
    return path


def source_dir(model_dir, tmp_path, generation_eos):
    """`model_dir`, with a generation_config.json holding `generation_eos` unless it is None."""
    from transformers import GenerationConfig

    path = tmp_path / "source"
    shutil.copytree(model_dir, path)
    if generation_eos is not None:
        GenerationConfig(eos_token_id=generation_eos, pad_token_id=0).save_pretrained(path)
    return path


def jaxrl_trainer(model, tok, tmp_path, data=MESSAGES, **kw):
    return SFTTrainer(
        model,
        args=SFTConfig(**base_args(tmp_path / "jaxrl", eos_token=END, **kw)),
        train_dataset=Dataset.from_dict(data),
        processing_class=tok,
    )


def saved(out):
    from transformers import AutoTokenizer

    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(out)
    return {
        "config.eos_token_id": config["eos_token_id"],
        "generation.eos_token_id": generation["eos_token_id"],
        "tokenizer.eos_token": tok.eos_token,
        "tokenizer.pad_token": tok.pad_token,
    }


def test_chat_template_rows_and_saved_files_carry_the_new_eos(tmp_path):
    trainer = jaxrl_trainer(tiny_config(vocab_size=32), make_tok(), tmp_path)
    tok = trainer.processing_class
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token) == (END, END_ID, "<pad>")
    digits = {c: tok.convert_tokens_to_ids(c) for c in "12347+"}
    # "1+1" EOS "2" EOS: the template's {{ eos_token }} is the new one
    assert trainer.train_dataset["input_ids"] == [
        [digits["1"], digits["+"], digits["1"], END_ID, digits["2"], END_ID],
        [digits["3"], digits["+"], digits["4"], END_ID, digits["7"], END_ID],
    ]
    assert trainer.model.config.hf_config.eos_token_id == END_ID
    # A model built from a config: its generation config derives from it (eos 1), TRL's list
    # puts the new id first.
    assert trainer.generation_config().eos_token_id == (END_ID, OLD_EOS_ID)
    out = tmp_path / "export"
    trainer.save_model(str(out))
    assert saved(out) == {
        "config.eos_token_id": END_ID,
        "generation.eos_token_id": [END_ID, OLD_EOS_ID],
        "tokenizer.eos_token": END,
        "tokenizer.pad_token": "<pad>",
    }


def test_text_rows_end_with_the_new_eos(tmp_path):
    trainer = jaxrl_trainer(tiny_config(vocab_size=32), make_tok(), tmp_path, {"text": ["1+2"]})
    assert trainer.train_dataset["input_ids"][0][-1] == END_ID


def test_eos_token_not_in_vocab_is_a_clear_error(tmp_path):
    tok = make_tok()
    with pytest.raises(ValueError, match=r"eos_token='<\|nope\|>' is not in the tokenizer vocab"):
        SFTTrainer(
            tiny_config(vocab_size=32),
            args=SFTConfig(**base_args(tmp_path, eos_token="<|nope|>")),
            train_dataset=Dataset.from_dict(MESSAGES),
            processing_class=tok,
        )
    assert tok.eos_token == "<eos>"  # left as it was


# ------------------------------------------------------------------- against TRL's SFTTrainer


def trl_reference(source, tok, tmp_path):
    """TRL 1.16's SFTTrainer on the same model directory, tokenizer and data: its prepared rows,
    the model's generation-config EOS ids and the files `save_model` writes."""
    pytest.importorskip("trl")
    from transformers import Qwen2ForCausalLM
    from trl import SFTConfig as TRLSFTConfig
    from trl import SFTTrainer as TRLSFTTrainer

    model = Qwen2ForCausalLM.from_pretrained(source)
    trainer = TRLSFTTrainer(
        model,
        args=TRLSFTConfig(
            output_dir=str(tmp_path / "trl"), eos_token=END, report_to="none", use_cpu=True
        ),
        train_dataset=Dataset.from_dict(MESSAGES),
        processing_class=tok,
    )
    out = tmp_path / "trl_export"
    trainer.save_model(str(out))
    eos = model.generation_config.eos_token_id
    return trainer.train_dataset["input_ids"], tuple(eos if isinstance(eos, list) else [eos]), out


@pytest.mark.parametrize(
    ("pad", "generation_eos"),
    [
        ("<pad>", None),  # no generation_config.json: derived from config.json (eos 1)
        ("<eos>", None),  # the pad token is the old EOS: it stays the pad token
        (None, None),  # no pad token: the new EOS pads, as TRL picks it after the swap
        ("<pad>", [OLD_EOS_ID, 3]),  # the new id goes first
        ("<pad>", OLD_EOS_ID),  # one id
        ("<pad>", [OLD_EOS_ID, END_ID]),  # already there: left as it is
    ],
)
def test_eos_token_matches_trl(model_dir, tmp_path, pad, generation_eos):
    source = source_dir(model_dir, tmp_path, generation_eos)
    rows, generation_ids, trl_out = trl_reference(source, make_tok(pad), tmp_path)

    trainer = jaxrl_trainer(str(source), make_tok(pad), tmp_path)
    assert trainer.train_dataset["input_ids"] == rows
    assert END_ID in rows[0] and OLD_EOS_ID not in rows[0]
    assert trainer.generation_config().eos_token_id == generation_ids
    out = tmp_path / "jaxrl_export"
    trainer.save_model(str(out))
    ours, theirs = saved(out), saved(trl_out)
    assert ours == theirs
    assert ours["tokenizer.pad_token"] == (END if pad is None else pad)
