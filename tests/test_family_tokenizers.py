"""The tokenizers of the families brisk-lm runs beside Llama: Qwen3, SmolLM3,
Gemma 3 and Phi-3.

The hub is out of reach here, so each family's tokenizer is rebuilt at test
time in the form its checkpoints ship it, trained on a small corpus: the
same model kind, normalizer, pre-tokenizer split, decoder and special tokens
(Qwen3: byte-level BPE after NFC and Qwen2's split, no BOS, <|im_end|> and
<think>; SmolLM3: Llama-3's split and its ignore_merges, no BOS; Gemma 3:
SentencePiece BPE with byte fallback and no dummy prefix, <bos> added,
<end_of_turn>; Phi-3: SentencePiece BPE with the dummy prefix, <|end|>).
Each is read by brisk-lm from a Hugging Face folder (tokenizer.json for the
byte-level ones, tokenizer.model for the SentencePiece ones, with
tokenizer_config.json and generation_config.json) and from a GGUF file
written by the gguf library in llama.cpp's keys; the ids must equal those of
the reference (transformers' reading of the same folder, or SentencePiece
itself) on strings chosen to break tokenizers, decode back to the text, and
the end and BOS tokens must be the family's. Not covered: the real files'
vocabularies (not reachable here), and the NFC that Qwen's tokenizer.json
applies and llama.cpp does not (a GGUF Qwen3 reads such text unnormalized)."""
import json

import pytest

from brisklm.checkpoints.gguf import load_tokenizer, metadata, open_reader
from brisklm.tokenizer import _LLAMA3_RE, _QWEN2_RE, load_hf_tokenizer

gguf = pytest.importorskip("gguf")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 3.14159 and 2026-12-02, isn't it?",
    "def tokenize(text):\n    return [t for t in text.split() if t]  # 42 items\n",
    "Tokenizers split text into pieces; models read the pieces. They'll see what we've done.",
    "東京は日本の首都です。 naïve café résumé Ωμέγα привет мир",
    "Numbers: 1234567890, 12,345.67 and ½ ① Ⅻ; emoji 👍🏽 🇫🇷 and tabs\tand\r\nbreaks.",
    "<html><body class=\"x\">Hello, World!</body></html>   trailing spaces   ",
] * 30

TRICKY = ["Hello world", "  leading and trailing  ", "It's WE'LL they'RE", "numbers 1234567 and 3.14",
          "line\nbreak\r\n\ttab", "東京 naïve café", "👨‍👩‍👧‍👦 family 🇫🇷 👍🏽", "unseen: zyxwvut qqq",
          "   ", "a<|im_end|>b", "x\n\n\ny", "ǅ ﬁ ẞ ℌ", ""]


def write_json(path, value):
    path.write_text(json.dumps(value))


# --- byte-level BPE: Qwen3, SmolLM3 -------------------------------------------------

BYTE_LEVEL = {
    # family: (split regex, ignore_merges, NFC, special tokens, tokenizer_config, eos, GGUF pre)
    "qwen3": (_QWEN2_RE, False, True, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
              {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "add_bos_token": False}, ["<|im_end|>", "<|endoftext|>"], "qwen2"),
    "smollm3": (_LLAMA3_RE, True, False, ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"],
                {"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False},
                ["<|im_end|>", "<|end_of_text|>"], "llama-bpe"),
}


@pytest.fixture(scope="module", params=sorted(BYTE_LEVEL))
def byte_level(request, tmp_path_factory):
    """(family, HF folder, GGUF path) of a byte-level BPE tokenizer built as the family's."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    family = request.param
    regex, ignore_merges, nfc, specials, config, eos, pre = BYTE_LEVEL[family]
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    folder = tmp_path_factory.mktemp(family)
    tok.save(str(folder / "tokenizer.json"))
    write_json(folder / "tokenizer_config.json", {**config, "tokenizer_class": "PreTrainedTokenizerFast"})
    write_json(folder / "generation_config.json", {"eos_token_id": [tok.token_to_id(t) for t in eos]})

    spec = json.loads(tok.to_str())
    path = folder / f"{family}.gguf"
    w = gguf.GGUFWriter(str(path), family)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])  # (llama.cpp: control)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    w.add_eos_token_id(vocab[config["eos_token"]])
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return family, folder, path


@pytest.mark.parametrize("text", TRICKY)
def test_byte_level_families_encode_as_transformers_does(byte_level, text):
    from transformers import AutoTokenizer
    family, folder, path = byte_level
    reference = AutoTokenizer.from_pretrained(str(folder))
    want = reference.encode(text, add_special_tokens=False)
    ours = load_hf_tokenizer(str(folder))
    assert ours.encode(text) == want, family
    assert ours.decode(want) == reference.decode(want)
    from_gguf = load_tokenizer(metadata(open_reader(str(path))), str(path))
    if family == "qwen3" and text == "ǅ ﬁ ẞ ℌ":  # (llama.cpp applies no NFC; these change under it)
        return
    assert from_gguf.encode(text) == want, family
    assert from_gguf.decode(want) == ours.decode(want)


def test_byte_level_families_round_trip_and_name_their_end_tokens(byte_level):
    family, folder, path = byte_level
    _, _, nfc, specials, config, eos, _ = BYTE_LEVEL[family]
    for tok in (load_hf_tokenizer(str(folder)), load_tokenizer(metadata(open_reader(str(path))), str(path))):
        assert not tok.add_bos and tok.encode("hi") == tok.encode("hi", add_bos=False)
        assert config["eos_token"] in [tok.token_text(i) for i in tok.eos_ids]
        for text in TRICKY + CORPUS[:6]:
            if not (nfc and text == "ǅ ﬁ ẞ ℌ"):  # (NFC changes these: no round trip by design)
                assert tok.decode(tok.encode(text)) == text, (family, text)
        ids = tok.encode("<|im_start|>user\nhi<|im_end|>")  # special-token text is the special token
        assert ids[0] == tok.backend.token_id("<|im_start|>") and ids[-1] in tok.eos_ids
    if family == "qwen3":
        assert len(load_hf_tokenizer(str(folder)).encode("<think>")) == 1


# --- SentencePiece BPE with byte fallback: Gemma 3 (no dummy prefix), Phi-3 ----------

SENTENCEPIECE = {
    # family: (dummy prefix, user-defined specials, BOS added, end tokens, GGUF add_space_prefix)
    "gemma3": (False, ["<start_of_turn>", "<end_of_turn>"], True, ["<end_of_turn>", "<eos>"]),
    "phi3": (True, ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"], True, ["<|end|>", "<|endoftext|>"]),
}


@pytest.fixture(scope="module", params=sorted(SENTENCEPIECE))
def sentencepiece_family(request, tmp_path_factory):
    """(family, folder with tokenizer.model, GGUF path, SentencePieceProcessor)."""
    spm = pytest.importorskip("sentencepiece")
    family = request.param
    prefix, user_defined, add_bos, ends = SENTENCEPIECE[family]
    folder = tmp_path_factory.mktemp(family)
    ids = {"pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3} if family == "gemma3" else \
          {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1}
    names = {"pad_piece": "<pad>", "eos_piece": "<eos>", "bos_piece": "<bos>"} if family == "gemma3" else {}
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(folder / "tokenizer"), vocab_size=600,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, add_dummy_prefix=prefix,
        user_defined_symbols=user_defined, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=family == "gemma3", minloglevel=2, **ids, **names)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    bos, eos = sp.id_to_piece(sp.bos_id()), sp.id_to_piece(sp.eos_id())
    write_json(folder / "tokenizer_config.json", {"bos_token": bos, "eos_token": eos, "add_bos_token": add_bos})
    write_json(folder / "generation_config.json", {"eos_token_id": [sp.piece_to_id(t) for t in ends]})

    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
             else 4 if sp.id_to_piece(i) in user_defined else 1 for i in range(n)]
    path = folder / f"{family}.gguf"
    w = gguf.GGUFWriter(str(path), family)
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types(types)
    w.add_add_space_prefix(prefix)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.piece_to_id(ends[0]))
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return family, folder, path, sp


@pytest.mark.parametrize("text", TRICKY)
def test_sentencepiece_families_encode_as_sentencepiece_does(sentencepiece_family, text):
    family, folder, path, sp = sentencepiece_family
    want = sp.encode(text)
    for tok in (load_hf_tokenizer(str(folder)), load_tokenizer(metadata(open_reader(str(path))), str(path))):
        if "<|im_end|>" in text:  # (not a special token of these families: plain text)
            assert tok.decode(tok.encode(text, add_bos=False)) == sp.decode(want)
            continue
        assert tok.encode(text, add_bos=False) == want, (family, type(tok.backend).__name__, text)
        assert tok.decode(want) == sp.decode(want), (family, text)


def test_sentencepiece_families_add_bos_and_name_their_end_tokens(sentencepiece_family):
    family, folder, path, sp = sentencepiece_family
    prefix, user_defined, add_bos, ends = SENTENCEPIECE[family]
    special = sp.piece_to_id(user_defined[-1])
    turn = f"{user_defined[-1]}hello"  # a user-defined special inside a prompt is one token
    for tok in (load_hf_tokenizer(str(folder)), load_tokenizer(metadata(open_reader(str(path))), str(path))):
        assert tok.add_bos == add_bos and tok.encode("hi")[0] == sp.bos_id()
        assert ends[0] in [tok.token_text(i) for i in tok.eos_ids], (family, tok.eos_ids)
        ids = tok.encode(turn, add_bos=False)
        if tok.backend.__class__.__name__ == "SentencePieceBackend":
            assert special in ids and ids == sp.encode(turn)
        else:  # llama.cpp splits special tokens out first, then prefixes the text after one with its space
            assert ids[0] == special and ids[1:] == sp.encode("hello")
        for text in CORPUS[:6]:
            assert tok.decode(tok.encode(text, add_bos=False)) == text, (family, text)
