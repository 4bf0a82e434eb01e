"""`RewardConfig.eos_token` and `chat_template_path` (SFT and reward) as TRL 1.16 applies them:
the prepared rows and the saved model config / tokenizer equal TRL's own trainers' on the same
model, tokenizer and data."""

import json

import pytest
from datasets import Dataset
from test_sft_eos_token import END, END_ID, make_tok
from trainer_utils import base_args, tiny_config

from jaxrl import RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

# Puts "=" before each message; differs from make_tok's template in every row.
EQUALS_TEMPLATE = "{% for m in messages %}={{ m['content'] }}{% endfor %}{{ eos_token }}"
PAIRS = {"chosen": ["1+1=2", "3+4=7"], "rejected": ["1+1=3", "3+4=8"]}
CHAT = {
    "messages": [
        [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}],
        [{"role": "user", "content": "3+4"}, {"role": "assistant", "content": "7"}],
    ]
}


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    """A tiny Qwen2 sequence classifier (vocab 32, config eos 1) saved by transformers."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_qwen2_cls")
    config = tiny_config(vocab_size=32)
    config.num_labels = 1
    config.pad_token_id = 0
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "equals.jinja"
    path.write_text(EQUALS_TEMPLATE)
    return str(path)


def _trl(kind, model_dir, tmp_path, data, **options):
    import trl
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    tok = make_tok()
    if kind == "reward":
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
        config_cls, trainer_cls = trl.RewardConfig, trl.RewardTrainer
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        config_cls, trainer_cls = trl.SFTConfig, trl.SFTTrainer
    trainer = trainer_cls(
        model=model,
        args=config_cls(
            output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, **options
        ),
        train_dataset=Dataset.from_dict(data),
        processing_class=tok,
    )
    return trainer, model


def _jaxrl(kind, model_dir, tmp_path, data, **options):
    config_cls, trainer_cls = (
        (RewardConfig, RewardTrainer) if kind == "reward" else (SFTConfig, SFTTrainer)
    )
    return trainer_cls(
        model_dir,
        args=config_cls(**base_args(tmp_path / "jaxrl", **options)),
        train_dataset=Dataset.from_dict(data),
        processing_class=make_tok(),
    )


def test_reward_eos_token_matches_trl(reward_dir, tmp_path):
    theirs, model = _trl("reward", reward_dir, tmp_path, PAIRS, eos_token=END)
    ours = _jaxrl("reward", reward_dir, tmp_path, PAIRS, eos_token=END)
    for side in ("chosen", "rejected"):
        rows = ours.train_dataset[f"{side}_input_ids"]
        assert rows == theirs.train_dataset[f"{side}_ids"]
        assert all(row[-1] == END_ID for row in rows)
    assert ours.processing_class.eos_token == END
    assert model.config.eos_token_id == ours.model.config.hf_config.eos_token_id == END_ID
    out = tmp_path / "export"
    ours.save_model(str(out))
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == END_ID


@pytest.mark.parametrize("kind", ["sft", "reward"])
def test_chat_template_path_matches_trl(kind, reward_dir, hf_model_dir, template_file, tmp_path):
    if kind == "sft":
        model_dir, data, columns = hf_model_dir, CHAT, [("input_ids", "input_ids")]
    else:
        data = {
            "chosen": [m for m in CHAT["messages"]],
            "rejected": [[m[0], {"role": "assistant", "content": "9"}] for m in CHAT["messages"]],
        }
        model_dir = reward_dir
        columns = [(f"{side}_input_ids", f"{side}_ids") for side in ("chosen", "rejected")]
    theirs, _ = _trl(kind, model_dir, tmp_path, data, chat_template_path=template_file)
    ours = _jaxrl(kind, model_dir, tmp_path, data, chat_template_path=template_file)
    assert ours.processing_class.chat_template == EQUALS_TEMPLATE
    equals = ours.processing_class.convert_tokens_to_ids("=")
    for ours_column, theirs_column in columns:
        assert ours.train_dataset[ours_column] == theirs.train_dataset[theirs_column]
        assert all(row[0] == equals for row in ours.train_dataset[ours_column])


def test_chat_template_path_must_be_a_template_file(hf_model_dir, tmp_path):
    with pytest.raises(ValueError, match="from a .jinja or .j2 file"):
        _jaxrl("sft", hf_model_dir, tmp_path, CHAT, chat_template_path=hf_model_dir)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _jaxrl("sft", hf_model_dir, tmp_path, CHAT, chat_template_path=str(tmp_path / "x.jinja"))
