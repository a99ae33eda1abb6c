"""Incremental detokenization (minipaged.engine.detokenizer) against the oracle: the tokenizer's
own ``decode`` of the whole completion.

Two tokenizers with the two traps: the tiny checkpoints' byte-level one (a character may
take several tokens; stray bytes decode to U+FFFD) and a SentencePiece-style one trained
here (a token's leading space vanishes at the start of a decoded string).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import SentencePieceBPETokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from minipaged.engine.detokenizer import IncrementalDetokenizer
from minipaged.models import make_tiny_model
from minipaged.models.tiny import BOS_ID, EOS_ID

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine",
    "naïve café, señor — déjà vu",
    "emoji 🙂 and CJK 漢字 too",
]


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=0)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    spm = SentencePieceBPETokenizer()
    spm.train_from_iterator(
        TEXTS * 10, vocab_size=120, show_progress=False, special_tokens=["<s>", "</s>"]
    )
    return PreTrainedTokenizerFast(tokenizer_object=spm, bos_token="<s>", eos_token="</s>")


def stream(tokenizer, token_ids: list[int]) -> list[str]:
    """Feed ``token_ids`` one at a time, as the engine does, then end the completion."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.update(token_ids[: i + 1]) for i in range(len(token_ids))]
    return pieces + [detokenizer.update(token_ids, final=True)]


def full(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 255), st.sampled_from([BOS_ID, EOS_ID])), max_size=40))
def test_byte_tokens_any_sequence_streams_to_the_full_decode(byte_tokenizer, token_ids):
    """Random bytes (invalid UTF-8 included) and special tokens: the pieces join to
    exactly what decoding everything at once gives."""
    assert "".join(stream(byte_tokenizer, token_ids)) == full(byte_tokenizer, token_ids)


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_characters_wait_until_complete(byte_tokenizer, text):
    """No piece holds half a character: each piece is real text, never U+FFFD."""
    token_ids = byte_tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(byte_tokenizer, token_ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_spaces_survive_between_pieces(metaspace_tokenizer, text):
    """Decoding each token alone would drop the spaces SentencePiece marks with "▁"."""
    token_ids = metaspace_tokenizer.encode(text, add_special_tokens=False)
    alone = "".join(full(metaspace_tokenizer, [t]) for t in token_ids)
    assert alone != full(metaspace_tokenizer, token_ids)  # the trap is real
    assert "".join(stream(metaspace_tokenizer, token_ids)) == full(metaspace_tokenizer, token_ids)
