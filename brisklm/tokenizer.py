"""One tokenizer interface over the libraries that real checkpoints need.

Backends: Hugging Face `tokenizers` (tokenizer.json, and the vocabularies
stored inside GGUF files, which are rebuilt as `tokenizers` objects),
`sentencepiece` (Llama-2 / Mistral tokenizer.model) and `tiktoken` (Llama-3
tokenizer.model). No hand-written BPE.

Conventions, matching llama.cpp and transformers:
- special-token text inside a prompt ("<|im_end|>") becomes that token;
- a BOS is prepended only when the checkpoint says so (`add_bos`);
- `StreamDecoder` turns a growing id list into text pieces, holding back
  bytes until they form whole UTF-8 characters.
"""
from __future__ import annotations

import json
import os
import re
import shutil

END_TOKEN_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>",
                   "<|eom_id|>", "</s>", "<end_of_turn>")

# Pre-tokenizer regexes, by the name GGUF files give them (tokenizer.ggml.pre).
_GPT2_RE = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_RE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
              r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2_RE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
             r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# name -> (regexes applied in turn, ignore_merges)
GGUF_PRE_TOKENIZERS = {
    "default": ([_GPT2_RE], False),
    "gpt-2": ([_GPT2_RE], False),
    # SmolLM: every numeric character is isolated before the GPT-2 split.
    "smollm": ([r"\p{N}", _GPT2_RE], False),
    "llama-bpe": ([_LLAMA3_RE], True),
    "llama3": ([_LLAMA3_RE], True),
    "qwen2": ([_QWEN2_RE], False),
}


class Tokenizer:
    """encode/decode plus the special tokens generation needs."""

    def __init__(self, backend, bos_id=None, eos_ids=(), add_bos=False, chat_template=None):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = sorted(set(i for i in eos_ids if i is not None))
        self.add_bos = add_bos
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.backend.encode(text)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id] + ids
        return ids

    def encode_literal(self, text: str, literal: list[tuple[int, int]]) -> list[int]:
        """The ids of text (a rendered chat, no BOS added) in which the
        character spans `literal` (the messages' contents) are text whatever
        they hold: a special token's text counts as the token only outside
        them, so a user cannot write the template's role markers. Elsewhere
        the split is the tokenizers' own: at each special token, the text
        between encoded on its own."""
        ids, start = [], 0
        for match in self.backend.special_pattern().finditer(text):
            if any(a < match.end() and match.start() < b for a, b in literal):
                continue
            ids += self.backend.encode_text(text[start:match.start()])
            ids.append(self.backend.token_id(match.group()))
            start = match.end()
        return ids + self.backend.encode_text(text[start:])

    def decode(self, ids) -> str:
        return self.backend.decode(list(ids))

    def token_text(self, token_id: int) -> str:
        return self.backend.decode([token_id])

    def stream(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def save(self, folder: str) -> dict:
        """Write the backend's files into folder; return the JSON that reloads them."""
        return {"backend": self.backend.save(folder), "bos_id": self.bos_id,
                "eos_ids": self.eos_ids, "add_bos": self.add_bos,
                "chat_template": self.chat_template}

    @classmethod
    def from_saved(cls, folder: str, info: dict) -> "Tokenizer":
        b = info["backend"]
        backend = {"tokenizers": HFBackend.from_file, "sentencepiece": SentencePieceBackend,
                   "tiktoken": TiktokenBackend}[b["type"]](os.path.join(folder, b["file"]))
        return cls(backend, info.get("bos_id"), info.get("eos_ids", ()),
                   info.get("add_bos", False), info.get("chat_template"))


class StreamDecoder:
    """Incremental detokenization: push ids, get the new text they complete.

    Decoding a window of recent ids (not each id alone) keeps the spacing that
    depends on neighbours (SentencePiece's leading space), and text ending in
    U+FFFD is held back until the rest of its UTF-8 bytes arrive."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # ids up to here have been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read])
        text = decode(self.ids[self.prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]


class HFBackend:
    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.literal = None  # a copy that reads special tokens' text as text (made when first needed)

    @classmethod
    def from_file(cls, path):
        from tokenizers import Tokenizer as _Tok
        return cls(_Tok.from_file(path))

    def encode(self, text):  # (encode_batch lets go of the GIL: a long prompt does not stall other threads)
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids if text else []

    def encode_text(self, text):
        """Ids of text in which special tokens' text is text."""
        if not text:
            return []
        if self.literal is None:
            from tokenizers import Tokenizer as _Tok
            self.literal = _Tok.from_str(self.tok.to_str())
            self.literal.encode_special_tokens = True
        return self.literal.encode_batch([text], add_special_tokens=False)[0].ids

    def special_pattern(self):
        specials = [t.content for t in self.tok.get_added_tokens_decoder().values() if t.special]
        return special_pattern(specials)

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_id(self, text):
        return self.tok.token_to_id(text)

    def save(self, folder):
        self.tok.save(os.path.join(folder, "tokenizer.json"))
        return {"type": "tokenizers", "file": "tokenizer.json"}


class SentencePieceBackend:
    def __init__(self, path):
        import sentencepiece as spm
        self.path = path
        self.sp = spm.SentencePieceProcessor(model_file=path)
        self.vocab_size = self.sp.get_piece_size()
        specials = {self.sp.id_to_piece(i): i for i in range(self.vocab_size)
                    if self.sp.is_control(i) or self.sp.is_unknown(i)}
        specials = {k: v for k, v in specials.items() if k}
        self.specials = specials
        self.special_ids = set(specials.values())
        self.split = (re.compile("(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")")
                      if specials else None)

    def encode_text(self, text):
        return self.sp.encode(text) if text else []

    def special_pattern(self):
        return special_pattern(self.specials)

    def encode(self, text):
        if not self.split:
            return self.sp.encode(text)
        ids = []
        for i, part in enumerate(self.split.split(text)):
            if i % 2:
                ids.append(self.specials[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids):
        # sentencepiece drops control tokens when decoding; render them as text.
        out, run = [], []
        for i in ids:
            if i in self.special_ids:
                if run:
                    out.append(self.sp.decode(run))
                    run = []
                out.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            out.append(self.sp.decode(run))
        return "".join(out)

    def token_id(self, text):
        i = self.sp.piece_to_id(text)
        return None if i == self.sp.unk_id() and text != self.sp.id_to_piece(i) else i

    def save(self, folder):
        shutil.copyfile(self.path, os.path.join(folder, "tokenizer.model"))
        return {"type": "sentencepiece", "file": "tokenizer.model"}


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                   "<|python_tag|>"]


class TiktokenBackend:
    """Llama-3's original tokenizer.model: base64 ranks + 256 special tokens."""

    def __init__(self, path):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
        self.path = path
        ranks = load_tiktoken_bpe(path)
        names = LLAMA3_SPECIALS + [f"<|reserved_special_token_{i}|>"
                                   for i in range(2, 256 - len(LLAMA3_SPECIALS) + 2)]
        self.specials = {name: len(ranks) + i for i, name in enumerate(names)}
        self.enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=_LLAMA3_RE,
                                     mergeable_ranks=ranks, special_tokens=self.specials)
        self.vocab_size = self.enc.n_vocab

    def encode(self, text):
        return self.enc.encode(text, allowed_special="all")

    def encode_text(self, text):
        return self.enc.encode_ordinary(text)

    def special_pattern(self):
        return special_pattern(self.specials)

    def decode(self, ids):
        return self.enc.decode(ids, errors="replace")

    def token_id(self, text):
        if text in self.specials:
            return self.specials[text]
        ids = self.enc.encode(text, allowed_special="all")
        return ids[0] if len(ids) == 1 else None

    def save(self, folder):
        shutil.copyfile(self.path, os.path.join(folder, "tokenizer.model"))
        return {"type": "tiktoken", "file": "tokenizer.model"}


def special_pattern(specials) -> re.Pattern:
    """A pattern that finds any of the special tokens' texts, longest first (none: matches nothing)."""
    names = sorted((t for t in specials if t), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, names)) if names else r"(?!x)x")


def load_tokenizer_model_file(path):
    """tokenizer.model is either a SentencePiece protobuf or tiktoken's base64 ranks."""
    with open(path, "rb") as f:
        head = f.read(64)
    first = head.split(b"\n", 1)[0].split(b" ")
    if len(first) == 2 and first[1].strip().isdigit():
        return TiktokenBackend(path)
    return SentencePieceBackend(path)


def find_end_ids(backend, configured=()) -> list[int]:
    ids = set(i for i in configured if i is not None)
    for text in END_TOKEN_TEXTS:
        i = backend.token_id(text)
        if i is not None:
            ids.add(i)
    return sorted(ids)


# --- GGUF vocabularies ------------------------------------------------------

GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_UNUSED, GGUF_BYTE = 3, 4, 5, 6


def from_gguf_vocab(model: str, pre: str | None, tokens: list[str], token_types: list[int],
                    merges: list[str] | None, scores: list[float] | None,
                    add_space_prefix: bool = True, unk_id: int | None = None):
    """Rebuild a GGUF file's vocabulary as a `tokenizers` object (HFBackend)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as _Tok

    vocab = {t: i for i, t in enumerate(tokens)}
    types = token_types or [1] * len(tokens)
    if model == "gpt2":
        pre = pre or "default"
        if pre not in GGUF_PRE_TOKENIZERS:
            raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r} "
                             f"(known: {', '.join(sorted(GGUF_PRE_TOKENIZERS))})")
        regexes, ignore_merges = GGUF_PRE_TOKENIZERS[pre]
        pairs = [tuple(m.split(" ", 1)) for m in merges or []]
        tok = _Tok(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    elif model == "llama":
        pairs = _merges_from_scores(tokens, types, scores)
        unk = tokens[unk_id] if unk_id is not None else None
        tok = _Tok(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
        steps = [normalizers.Prepend("▁")] if add_space_prefix else []
        tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
        strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()] + strip)
    else:
        raise ValueError(f"unsupported tokenizer.ggml.model {model!r} (known: gpt2, llama)")
    specials = [AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types) if ty in (GGUF_CONTROL, GGUF_USER_DEFINED)]
    tok.add_special_tokens(specials)
    return HFBackend(tok)


def _merges_from_scores(tokens, types, scores):
    """SentencePiece-BPE merges: a pair merges in the order of its result's score."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    scored = []
    for piece, i in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                scored.append((-scores[i], vocab[left], vocab[right], left, right))
    scored.sort()
    return [(left, right) for *_, left, right in scored]


def load_hf_tokenizer(folder: str) -> Tokenizer | None:
    """The tokenizer of a Hugging Face folder, or None when it has none."""
    cfg = _read_json(os.path.join(folder, "tokenizer_config.json")) or {}
    gen = _read_json(os.path.join(folder, "generation_config.json")) or {}
    tj, tm = os.path.join(folder, "tokenizer.json"), os.path.join(folder, "tokenizer.model")
    if os.path.exists(tj):
        backend = HFBackend.from_file(tj)
    elif os.path.exists(tm):
        backend = load_tokenizer_model_file(tm)
    else:
        tk = [f for f in os.listdir(folder) if f.endswith(".tiktoken")]
        if not tk:
            return None
        backend = TiktokenBackend(os.path.join(folder, tk[0]))

    def token(key):
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return backend.token_id(value) if value else None

    eos = gen.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos]
    bos = token("bos_token")
    if bos is None and isinstance(gen.get("bos_token_id"), int):
        bos = gen["bos_token_id"]
    add_bos = cfg.get("add_bos_token")
    if add_bos is None:  # tokenizer.json may hold a post-processor that adds it
        add_bos = _adds_bos(backend, bos)
    template = cfg.get("chat_template")
    jinja = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    if isinstance(template, list):  # named templates: take the default
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return Tokenizer(backend, bos, find_end_ids(backend, eos + [token("eos_token")]),
                     bool(add_bos), template)


def _adds_bos(backend, bos):
    """Whether tokenizer.json's post-processor prepends BOS on its own."""
    if bos is None or not isinstance(backend, HFBackend):
        return False
    ids = backend.tok.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos


def _read_json(path):
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
