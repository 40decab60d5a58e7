"""Tokenizers written by ``workbench checkpoint``: loadable by transformers, ids that fit the model, text round trips,
incremental detokenization with stop strings, and ``generate --prompt``."""

import json

import pytest

from workbench.cli import main
from workbench.config import ModelConfig
from workbench.model.tokenizer import TRAINING_TEXT, IncrementalDetokenizer, TextCodec, train_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint):
    return tiny_checkpoint("tiny-gqa")


@pytest.mark.parametrize("preset", ["tiny-gqa", "SmolLM2-135M", "tiny-qwen2"])
def test_special_tokens_sit_at_the_config_ids_and_every_id_fits(preset):
    cfg = ModelConfig.resolve(preset)
    tok = train_tokenizer(cfg)
    ids = tok.get_vocab().values()
    assert max(ids) < cfg.vocab_size and len(set(ids)) == len(ids)
    assert tok.eos_token_id == cfg.eos_token_ids[0]
    assert tok.bos_token_id == cfg.bos_token_id


def test_transformers_loads_the_saved_tokenizer_and_encodes_the_same(tiny_dir):
    from transformers import AutoTokenizer

    peer = AutoTokenizer.from_pretrained(str(tiny_dir))
    ours = TextCodec.from_dir(tiny_dir)
    text = "Four score and seven years ago"
    assert ours.encode(text) == peer.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == text


def test_a_vocabulary_with_every_byte_round_trips_any_text():
    codec = TextCodec(train_tokenizer(ModelConfig.resolve("SmolLM2-135M")))
    for text in (TRAINING_TEXT.read_text(encoding="utf-8"), "naïve café, 20 €, 東京 🙂"):
        ids = codec.encode(text)
        assert codec.decode(ids) == text
    # BPE merges make the training text shorter in tokens than in bytes
    assert len(codec.encode("Four score and seven years ago")) < len("Four score and seven years ago")


def test_a_256_token_vocabulary_round_trips_its_training_text():
    codec = TextCodec(train_tokenizer(ModelConfig.resolve("tiny-gqa")))
    text = TRAINING_TEXT.read_text(encoding="utf-8")
    assert codec.decode(codec.encode(text)) == text


class CharCodec:
    """One id per character: decode is a join, so the expected deltas can be written by hand."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _push_all(detok, text):
    return [detok.push([ord(c)]) for c in text] + [detok.finish()]


def test_stop_string_ends_the_text_before_it_and_holds_back_a_possible_start():
    detok = IncrementalDetokenizer(CharCodec(), stop=["cd"])
    deltas = _push_all(detok, "abcdef")
    # the last character is always held (len('cd') - 1 = 1 could start the stop string): 'a' comes out with 'b',
    # 'b' with 'c'; 'd' completes 'cd', so the text ends at 'ab' and nothing more comes
    assert deltas == ["", "a", "b", "", "", "", ""]
    assert detok.text == "ab" and detok.stopped


def test_without_stop_strings_every_character_is_final_at_once():
    detok = IncrementalDetokenizer(CharCodec())
    assert _push_all(detok, "abc") == ["a", "b", "c", ""]


def test_a_character_split_over_byte_tokens_is_held_until_complete():
    codec = TextCodec(train_tokenizer(ModelConfig.resolve("SmolLM2-135M")))
    ids = codec.encode("€")  # three bytes, never merged in the English training text
    assert len(ids) == 3
    detok = IncrementalDetokenizer(codec)
    assert [detok.push([i]) for i in ids] == ["", "", "€"]


def test_generate_takes_text_prompts_and_returns_ids_and_text(tiny_dir, capsys):
    args = ["generate", "--model", str(tiny_dir), "--max-new-tokens", "6", "--ignore-eos", "--json"]
    assert main([*args, "--prompt", "We the People"]) == 0
    by_text = json.loads(capsys.readouterr().out)["requests"][0]
    codec = TextCodec.from_dir(tiny_dir)
    ids = codec.encode("We the People")
    assert main([*args, "--prompt-ids", ",".join(map(str, ids))]) == 0
    by_ids = json.loads(capsys.readouterr().out)["requests"][0]
    assert by_text["prompt_ids"] == ids and by_text["tokens"] == by_ids["tokens"]
    assert by_text["text"] == by_ids["text"] == codec.decode(by_ids["tokens"])


def test_generate_text_prompt_without_a_tokenizer_says_to_pass_prompt_ids(capsys):
    assert main(["generate", "--model", "tiny-gqa", "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer" in err and "--prompt-ids" in err


def test_checkpoint_without_tokenizer(tmp_path, capsys):
    assert main(["checkpoint", "--model", "tiny-mha", "--out", str(tmp_path / "c"), "--no-tokenizer", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokenizer"] is False
    assert not (tmp_path / "c" / "tokenizer.json").exists() and (tmp_path / "c" / "config.json").exists()


def test_a_256_token_vocabulary_holds_printable_ascii():
    codec = TextCodec(train_tokenizer(ModelConfig.resolve("tiny-gqa")))
    text = "".join(chr(c) for c in range(32, 127)) + "\n\t"
    assert codec.decode(codec.encode(text)) == text
    assert codec.decode(codec.encode("café")) == "caf"  # 'é' is two bytes outside the alphabet: <unk>, skipped
