"""Character-level tokenizers built offline with the `tokenizers` library.

Used for the embedded arithmetic task (shipped under `jaxrl/assets/arith/tokenizer/`) and by tests
that need a real `transformers` tokenizer without network access. One token per character, plus
special tokens; decoding concatenates characters back without separators.
"""

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN)


def build_char_tokenizer(
    chars: Iterable[str], *, chat_template: str | None = None
) -> PreTrainedTokenizerFast:
    """Return a tokenizer with one id per character in `chars` after the special tokens.

    Ids: `<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3, then `chars` in the given order (duplicates
    dropped). No special tokens are added automatically when encoding (like most decoder-only
    tokenizers, EOS is appended by the data pipeline, not by the tokenizer).
    """
    ordered = list(dict.fromkeys(chars))
    if any(len(c) != 1 for c in ordered):
        raise ValueError("build_char_tokenizer expects single characters; got multi-char entries.")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in ordered:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Every character is its own pre-token, so WordLevel maps it directly to its id.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=chat_template,
    )
