import pytest

from dcinterp import HookedDCFormer
from dcinterp.checks import find_word, word_token
from dcinterp.tokenizer import check_vocabulary


@pytest.fixture(scope="module")
def model():
    return HookedDCFormer.from_pretrained("dcpythia-synth")


def test_out_of_lexicon_words_are_an_error_not_unk(model):
    check_vocabulary(model.tokenizer, "Michelle has a burger. Michelle owns a kind of")
    with pytest.raises(
        ValueError,
        match=r"prompt: not in the tokenizer's vocabulary \(would become \[UNK\]\): "
        r"'quokka', 'zorblax'",
    ):
        check_vocabulary(model.tokenizer, ["Michelle has a quokka.", "zorblax"], name="prompt")


def test_words_resolve_to_one_token_or_a_stated_piece(model):
    assert word_token(model, "burger") == model.tokenizer.convert_tokens_to_ids("burger")
    with pytest.raises(ValueError, match="word='quokka' is not in the tokenizer's vocabulary"):
        word_token(model, "quokka")
    tokens = model.to_tokens("Michelle has a burger. Helen has a papaya.")[0]
    assert find_word(model, tokens, "burger") == 3 and find_word(model, tokens, "has", occurrence=0) == 1
    with pytest.raises(ValueError, match="occurs 2 times, there is no occurrence 2"):
        find_word(model, tokens, "has", occurrence=2)


def test_multi_token_words_with_a_byte_level_bpe_tokenizer(model):
    from tests.bpe import byte_level_bpe

    tokenizer = byte_level_bpe(["Michelle has a burger.", "Helen has a papaya."] * 20, vocab_size=300)
    model = HookedDCFormer(model.cfg, tokenizer=tokenizer)
    assert tokenizer.convert_ids_to_tokens(word_token(model, "burger", piece="only")) == "Ġburger"
    with pytest.raises(ValueError, match=r"word='hamburger' splits into 6 tokens \['Ġ', 'h', 'a', 'm', 'bu', 'rger'\]"):
        word_token(model, "hamburger")
    pieces = tokenizer(" hamburger", add_special_tokens=False)["input_ids"]
    assert word_token(model, "hamburger", piece="first") == pieces[0]
    assert word_token(model, "hamburger", piece="last") == pieces[-1]
    ids = tokenizer("Michelle has a hamburger. Michelle", add_special_tokens=False)["input_ids"]
    assert find_word(model, ids, "hamburger") == ids.index(pieces[-1], 3)
    assert find_word(model, ids, "Michelle") == len(ids) - 1
    assert find_word(model, ids, "Michelle", occurrence=0) == 0  # at the start: without a leading space
