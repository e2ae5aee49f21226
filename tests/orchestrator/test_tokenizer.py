"""The orchestrator's tokenizer (orchestrator/rendering/tokenizer.py): tokenizer.json read without
transformers gives the ids transformers' AutoTokenizer gave on every text the shipped tasks make,
and on any text at all the ids of the tokenizer the tiny model was trained with."""

from __future__ import annotations

import importlib.util
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from conftest import ROOT, TINY_MODEL
from tasks import count, echo, guess_letter, reverse
from orchestrator.rendering.tokenizer import load_tokenizer

OURS = load_tokenizer(str(TINY_MODEL))
HF = AutoTokenizer.from_pretrained(TINY_MODEL)


def trained_with():
    """The tokenizer scripts/make_tiny_model.py built and trained the tiny model with."""
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_tokenizer().backend_tokenizer


def task_texts() -> list[str]:
    texts = ["guess=", "up=", "down=", "<eos>", "abc<eos>="]
    for dataset in (reverse.dataset, echo.dataset, count.dataset):
        for row in itertools.islice(dataset(0), 200):
            texts += [row["prompt"], row.get("answer", "")]
    rows = guess_letter.GuessLetter().dataset(0)
    return texts + [next(rows)["secret"] for _ in range(50)]


def test_it_is_the_rust_tokenizer_from_the_file():
    assert isinstance(OURS, Tokenizer)


def test_the_tasks_texts_get_the_ids_autotokenizer_gave():
    for text in task_texts():
        for special in (True, False):
            ids = OURS.encode(text, add_special_tokens=special).ids
            assert ids == HF(text, add_special_tokens=special)["input_ids"], text
            assert ids == HF.backend_tokenizer.encode(text, add_special_tokens=special).ids, text


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, HF.vocab_size - 1), max_size=40))
def test_any_ids_decode_as_autotokenizer_decoded_them(ids):
    assert OURS.decode(ids, skip_special_tokens=True) == HF.decode(ids, skip_special_tokens=True)


TRAINED = trained_with()


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30))
def test_any_text_gets_the_ids_the_model_was_trained_with(text):
    # AutoTokenizer (transformers 5) differs here: it rebuilds this tokenizer as a byte-level
    # BPE, which drops a character outside the vocabulary where training mapped it to <unk>.
    assert OURS.encode(text).ids == TRAINED.encode(text).ids
