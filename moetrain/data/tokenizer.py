"""Tokenizers: one small interface over SentencePiece `.model` files and Hugging Face `tokenizer.json`.

    tok = load_tokenizer("data/kjv_tiny/kjv_tiny.model")       # or ".../tokenizer.json", or a model folder
    ids = tok.encode("In the beginning"); text = tok.decode(ids)
    tok.eos_id, tok.vocab_size, tok.name, tok.checksum, tok.encode_batch(texts)

Both classes offer exactly that interface (plus `path`, `kind`); `load_tokenizer` picks one by file.
`vocab_size` is the number of ids the tokenizer can emit (the largest id + 1), which token shards
record and `model.vocab_size` must cover. `checksum` is the sha256 of the file, which shards record
to catch data encoded with another tokenizer.

SentencePiece models trained here (`train_tokenizer`) have fixed special ids. Special ids are the same in every model this project trains, so data, configs and models can
rely on them: unk=0, bos=1, eos=2, pad=3 (pieces <unk>, <s>, </s>, <pad>). User special tokens
(`special_tokens`) follow at 4, 5, ... in the order given. Normalisation is off ("identity",
whitespace kept), so `decode(encode(text)) == text` for any text made of characters seen in
training; unseen characters become unk unless the model was trained with byte fallback.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, List, Optional, Sequence

import sentencepiece as spm
from tokenizers import Tokenizer as RustTokenizer

from moetrain.fileio import sha256_of

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
_SNIFF_BYTES = 1 << 20


def check_text_file(path: str, what: str = "input text",
                    fix: str = "give a UTF-8 text file with one document or sentence a line") -> None:
    """Refuse a file that is missing, empty, blank, or not UTF-8 text (NUL bytes or invalid UTF-8
    in its first MiB), naming the file, what was found and `fix`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path!r} does not exist")
    with open(path, "rb") as fh:
        head = fh.read(_SNIFF_BYTES)
    if not head.strip() and os.path.getsize(path) == len(head):
        raise ValueError(f"{what} {path!r} is empty" + (" (only blank lines)" if head else "") + f": {fix}")
    nul = head.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{what} {path!r} is binary, not text (a NUL byte at offset {nul}): give a UTF-8 text "
                         f"file (extract the text first, e.g. from a PDF or archive)")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:       # not just a character cut at the end of the sniffed block
            raise ValueError(f"{what} {path!r} is not UTF-8 text (byte {exc.start}: {exc.reason}); convert it, "
                             f"e.g. with iconv -f <encoding> -t utf-8") from None


def train_tokenizer(input_files: Sequence[str], model_prefix: str, vocab_size: int,
                    model_type: str = "bpe", special_tokens: Sequence[str] = (),
                    byte_fallback: bool = False, character_coverage: float = 1.0) -> str:
    """Train a SentencePiece model on the lines of `input_files`; returns `model_prefix + '.model'`.

    Training is deterministic (one thread, every line used), so the same inputs give a
    byte-identical model and therefore the same checksum in the token shards.
    """
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
    if not 0 < character_coverage <= 1:
        raise ValueError(f"character_coverage must be in (0, 1] (the share of the input's characters the vocabulary "
                         f"covers; 1.0 for small alphabets, 0.9995 for CJK), got {character_coverage}")
    for path in input_files:
        check_text_file(path, "tokenizer training input")
    reserved = 4 + len(special_tokens) + (256 if byte_fallback else 0)   # unk bos eos pad, specials, bytes
    what = "unk, bos, eos, pad" + (f", {len(special_tokens)} special token(s)" if special_tokens else "") + \
        (", 256 byte pieces (byte_fallback)" if byte_fallback else "")
    if vocab_size <= reserved:
        raise ValueError(f"vocab_size={vocab_size} is too small: {reserved} ids are reserved ({what}) before any "
                         f"learned piece; use a vocab_size above {reserved} plus one per distinct character of the "
                         f"input (e.g. {max(reserved + 256, 512)})")
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            input=list(input_files), model_prefix=model_prefix, vocab_size=vocab_size,
            model_type=model_type, character_coverage=character_coverage,
            byte_fallback=byte_fallback, user_defined_symbols=list(special_tokens),
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            input_sentence_size=0, shuffle_input_sentence=False, num_threads=1,
            minloglevel=2)
    except RuntimeError as e:  # e.g. "Vocabulary size too high (X). Please set it to a value <= Y."
        if "required_chars_" in str(e):   # fewer ids than the reserved ones plus one per character
            chars = set()
            for path in input_files:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    for line in fh:
                        chars.update(line.rstrip("\n"))
            raise ValueError(f"vocab_size={vocab_size} is too small for {list(input_files)}: it needs the {reserved} "
                             f"reserved ids ({what}) plus one per distinct character of the input ({len(chars)}"
                             + (f" at character_coverage={character_coverage:g}" if character_coverage < 1 else "")
                             + f"): use a vocab_size of at least {reserved + len(chars)}") from None
        raise ValueError(f"sentencepiece could not train on {list(input_files)} with "
                         f"vocab_size={vocab_size}: {e}") from e
    return model_prefix + ".model"


class SentencePieceTokenizer:
    """A SentencePiece `.model`; `checksum` (sha256 of the file) identifies it in data shards."""

    kind = "sentencepiece"

    def __init__(self, model_path: str):
        self.path = os.fspath(model_path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(
                f"tokenizer model {self.path!r} does not exist; train one with "
                f"tools/train_tokenizer.py or fix the path (config key data.tokenizer)")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.load(self.path)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{self.path!r} is not a valid sentencepiece model ({e}); "
                             f"retrain it with tools/train_tokenizer.py") from e
        self.checksum = sha256_of(self.path)

    @property
    def name(self) -> str:
        return self.path

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    def encode(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: List[str], num_threads: int = -1) -> List[List[int]]:
        """Encode many texts at once in C++ (`num_threads=-1`: all cores; 1: this thread only)."""
        return self._sp.encode(texts, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))


Tokenizer = SentencePieceTokenizer   # the name before tokenizer.json support


HF_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>", "[SEP]")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (the `tokenizers` library).

    Text is encoded without the template's special tokens (no BOS/CLS added), so documents are
    joined only by the EOS that preprocessing appends, and `decode` keeps special tokens, so
    `decode(encode(text)) == text` for byte-level models. EOS: `eos_token` if given, else the
    `eos_token` of a `tokenizer_config.json` beside the file, else the first of
    HF_EOS_CANDIDATES in the vocabulary.
    """

    kind = "huggingface"

    def __init__(self, path: str, eos_token: Optional[str] = None):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"tokenizer {self.path!r} does not exist; fix the path (config key data.tokenizer)")
        try:
            self._tok = RustTokenizer.from_file(self.path)
        except Exception as e:  # the library raises a plain Exception for malformed files
            raise ValueError(f"{self.path!r} is not a valid Hugging Face tokenizer.json ({e})") from e
        self.checksum = sha256_of(self.path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        eos_token = eos_token or self._configured_eos()
        candidates = [eos_token] if eos_token else [t for t in HF_EOS_CANDIDATES if t in vocab]
        if not candidates or candidates[0] not in vocab:
            raise ValueError(
                f"cannot tell the end-of-document token of {self.path!r}: "
                + (f"eos_token {eos_token!r} is not in its vocabulary" if eos_token else
                   f"no tokenizer_config.json with eos_token beside it and none of {HF_EOS_CANDIDATES} "
                   f"in its vocabulary") + "; name it with --eos-token (tools/preprocess_data.py)")
        self.eos_token = candidates[0]
        self._eos_id = vocab[self.eos_token]

    def _configured_eos(self) -> Optional[str]:
        config_path = os.path.join(os.path.dirname(os.path.abspath(self.path)), "tokenizer_config.json")
        if not os.path.isfile(config_path):
            return None
        with open(config_path, encoding="utf-8") as f:
            token = json.load(f).get("eos_token")
        return token.get("content") if isinstance(token, dict) else token

    @property
    def name(self) -> str:
        return self.path

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        return self._eos_id

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: List[str], num_threads: int = -1) -> List[List[int]]:
        """Encode many texts (the library's own thread pool; TOKENIZERS_PARALLELISM=false: one thread)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_piece(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id))


def resolve_tokenizer_path(path: str) -> str:
    """The tokenizer file `path` names: itself, or a model folder's tokenizer.json / tokenizer.model."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model"):
            if os.path.isfile(os.path.join(path, name)):
                return os.path.join(path, name)
        raise FileNotFoundError(f"tokenizer folder {path!r} holds neither tokenizer.json nor tokenizer.model "
                                f"(config key data.tokenizer)")
    return path


def load_tokenizer(path: str, eos_token: Optional[str] = None):
    """An HFTokenizer for a `.json` file, else a SentencePieceTokenizer (a `.model`); a model folder
    stands for the tokenizer.json (or tokenizer.model) in it. `eos_token` applies to tokenizer.json only."""
    path = resolve_tokenizer_path(path)
    if path.endswith(".json"):
        return HFTokenizer(path, eos_token)
    if eos_token is not None:
        raise ValueError(f"--eos-token applies to tokenizer.json only; {path!r} is a sentencepiece model "
                         f"whose eos id is fixed in the model")
    return SentencePieceTokenizer(path)
