"""Tokenizers: train a byte-level BPE offline for a checkpoint, load a checkpoint's tokenizer, decode incrementally.

No hub is reachable where the workbench is tested, so ``workbench checkpoint`` writes its own tokenizer beside the
weights: a byte-level BPE (GPT-2's scheme: bytes mapped to printable characters, merges learnt from pair counts)
trained with Hugging Face ``tokenizers`` on ``data/text/public_domain_en.txt`` (sources in ``data/text/README.md``).
It is saved the way transformers saves a fast tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``), so ``transformers.AutoTokenizer.from_pretrained(DIR)`` loads it too.

Ids fit the model: the special tokens sit at the config's ``bos_token_id`` / ``eos_token_id`` and every other id is
below ``vocab_size``. A vocabulary of 256 + specials or more holds all 256 bytes (any text encodes); a smaller one
(the tiny test presets have 256) holds printable ASCII, tab and newline, and other characters encode as
``<unk>``. Ids the BPE never assigned (a few KB of text learn a few thousand merges, not 32,000) decode to nothing.

The chat template is plain text (``role: content`` lines, then ``assistant:``), so it needs no extra tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workbench.config import ModelConfig
from workbench.errors import CheckpointError, RequestError

TRAINING_TEXT = Path(__file__).resolve().parents[2] / "data" / "text" / "public_domain_en.txt"
TOKENIZER_FILE = "tokenizer.json"
BOS, EOS, UNK = "<s>", "</s>", "<unk>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _special_ids(cfg: ModelConfig) -> dict[int, str]:
    """Special token id -> text: BOS and EOS at the config's ids (one token when they are the same id)."""
    specials: dict[int, str] = {}
    for tok in cfg.eos_token_ids:
        specials[tok] = EOS if tok == cfg.eos_token_ids[0] else f"</s{len(specials)}>"
    if cfg.bos_token_id is not None and cfg.bos_token_id not in specials:
        specials[cfg.bos_token_id] = BOS
    return specials


def train_tokenizer(cfg: ModelConfig, text: str | None = None, chat_template: str | None = CHAT_TEMPLATE):  # noqa: ANN201
    """A ``transformers.PreTrainedTokenizerFast`` for ``cfg``: byte-level BPE trained on ``text`` (default: the
    shipped public-domain text), special tokens at the config's ids, every id below ``cfg.vocab_size``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = TRAINING_TEXT.read_text(encoding="utf-8") if text is None else text
    specials = _special_ids(cfg)
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    all_bytes = cfg.vocab_size >= len(byte_alphabet) + len(specials)
    free_ids = cfg.vocab_size - len(specials) - (0 if all_bytes else 1)  # room for <unk> when bytes can be missing
    if free_ids < 2:
        raise CheckpointError(f"{cfg.name}: vocab_size {cfg.vocab_size} is too small for a tokenizer")

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # a small vocabulary still holds every printable ASCII character, tab and newline (chat templates need ':')
    ascii_alphabet = [byte_level.pre_tokenize_str(chr(b))[0][0] for b in (9, 10, *range(32, 127))]
    trainer = trainers.BpeTrainer(
        vocab_size=free_ids, show_progress=False, special_tokens=[],
        initial_alphabet=byte_alphabet if all_bytes else ascii_alphabet,
    )  # fmt: skip
    draft = Tokenizer(models.BPE())
    draft.pre_tokenizer = byte_level
    draft.train_from_iterator([text], trainer=trainer)
    trained = json.loads(draft.to_str())["model"]
    # the trained tokens, in their own id order, placed at the ids the special tokens leave free
    names = ([] if all_bytes else [UNK]) + sorted(trained["vocab"], key=trained["vocab"].__getitem__)
    free = (i for i in range(cfg.vocab_size) if i not in specials)
    vocab = {name: i for name, i in zip(names, free)} | {name: i for i, name in specials.items()}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    merges = [m for m in merges if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None if all_bytes else UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials.values()])
    kwargs: dict[str, Any] = {}
    if cfg.bos_token_id is not None:
        kwargs["bos_token"] = specials[cfg.bos_token_id]
    if cfg.eos_token_ids:
        kwargs["eos_token"] = specials[cfg.eos_token_ids[0]]
    if not all_bytes:
        kwargs["unk_token"] = UNK
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=cfg.max_position_embeddings, **kwargs)
    if chat_template is not None:
        hf.chat_template = chat_template
    return hf


def has_tokenizer(path: str | Path) -> bool:
    return (Path(path) / TOKENIZER_FILE).is_file()


class TextCodec:
    """A checkpoint's tokenizer, as the engine's callers use it: text -> ids, ids -> text, chat -> ids."""

    def __init__(self, hf_tokenizer: Any) -> None:  # a transformers PreTrainedTokenizerFast
        self.hf = hf_tokenizer

    @classmethod
    def from_dir(cls, path: str | Path) -> TextCodec:
        """Load ``path``'s tokenizer; CheckpointError when it has none."""
        if not has_tokenizer(path):
            raise CheckpointError(
                f"{path}: no {TOKENIZER_FILE}: this model has no tokenizer, so pass prompts as token ids "
                "(--prompt-ids, or a list of ids as the prompt)"
            )
        from transformers import PreTrainedTokenizerFast

        fix = "write it again (workbench checkpoint), or remove the tokenizer files to pass token ids"
        for name in (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json"):
            file = Path(path) / name
            if file.exists():
                try:
                    json.loads(file.read_bytes().decode("utf-8"))
                except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                    raise CheckpointError(f"{file}: not a readable tokenizer file ({exc}); {fix}") from None
        try:
            return cls(PreTrainedTokenizerFast.from_pretrained(str(path)))
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file; transformers ValueError/OSError
            raise CheckpointError(
                f"{Path(path) / TOKENIZER_FILE}: not a usable tokenizer ({type(exc).__name__}: {str(exc)[:200]}); {fix}"
            ) from None

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (no special tokens added)."""
        if not isinstance(text, str) or text == "":
            raise RequestError(f"a text prompt must be a non-empty string, got {text!r}")
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens skipped (vLLM's default)."""
        return self.hf.decode(ids, skip_special_tokens=True)

    @property
    def max_token_bytes(self) -> int:
        """The UTF-8 length of the vocabulary's longest token string: an upper bound on the bytes of text one token
        covers (a byte-level BPE writes each byte as one 1-2 byte character, SentencePiece a space as 3 bytes), so
        text of ``n`` bytes has at least ``n / max_token_bytes`` tokens (unless a normalizer deletes text)."""
        vocab = self.hf.get_vocab()
        return max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=1)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt ids of a chat, rendered by the tokenizer's chat template with the generation prompt."""
        if not self.has_chat_template:
            raise RequestError("this model's tokenizer has no chat template; use /v1/completions with a prompt")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.encode(text)


class IncrementalDetokenizer:
    """Text deltas of a growing list of output ids, whose concatenation is always ``decode(all ids)``.

    Byte-level BPE can end a step in the middle of a UTF-8 character (the decode ends in U+FFFD); such text is
    held back until a later token completes it, or until ``finish``. ``stop`` strings end the text before the
    first occurrence; text that could still become the start of one is held back too.
    """

    def __init__(self, codec: TextCodec, stop: list[str] | None = None) -> None:
        self.codec = codec
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""  # decode(ids), cut at a stop string once one is found
        self.emitted = 0  # characters of ``text`` already returned
        self.stopped = False

    def push(self, new_ids: list[int]) -> str:
        """Add output ids; return the text that is now final. Sets ``stopped`` when a stop string appeared."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        full = self.codec.decode(self.ids)
        for s in self.stop:
            # a stop string can only be completed by the text after what was already emitted minus its length
            at = full.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1 and (not self.stopped or at < len(self.text)):
                self.text, self.stopped = full[:at], True
        if self.stopped:
            return self._take(len(self.text))
        self.text = full
        ready = len(full) - 1 if full.endswith("\ufffd") else len(full)
        if self.stop:
            hold = max(len(s) for s in self.stop) - 1
            ready = min(ready, max(self.emitted, len(full) - hold))
        return self._take(ready)

    def finish(self) -> str:
        """The rest of the text, once no more ids will come."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted : upto], upto
        return delta
