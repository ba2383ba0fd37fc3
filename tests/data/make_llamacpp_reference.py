"""Write llama.cpp's tokenization of tricky strings as a JSON test fixture.

Usage:
    python make_llamacpp_reference.py MODEL.gguf OUT.json

Loads the GGUF's vocabulary with llama.cpp (through llama-cpp-python, which is
NOT a dependency of this project: install it in a scratch virtual environment
only to regenerate the fixture) and, for each string in CASES, records

  * ids:     llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
  * decoded: llm.detokenize(ids, special=True).decode("utf-8", errors="replace")

The output (tests/data/llamacpp_smollm2_tokens.json for the bundled
SmolLM2-135M-Instruct.Q4_1.gguf) lets our own tokenizer be checked against
llama.cpp in CI without llama.cpp installed.
"""

import hashlib
import json
import sys
from importlib.metadata import version

import llama_cpp

CASES = [
    # empty / whitespace
    "",
    " ",
    "  ",
    "   ",
    "        ",
    "a  b",
    "a   b",
    "a        b",
    "word  ",
    "  word",
    " leading space",
    "trailing space ",
    "   leading and trailing   ",
    "\n",
    "\n\n",
    "\r\n",
    "line1\r\n\r\nline2",
    "\t\tx",
    "a\n\n\n  b\t c",
    # numbers
    "12345",
    "3.14159",
    "1,000,000",
    "2024-01-15",
    "Call 555-0199 at 10:30pm, room 42B.",
    # non-ASCII numerals
    " ½ ①",
    "٣٤٥",
    "一二三",
    "Ⅻ",
    "x²",
    "E = mc² and H₂O",
    # emoji
    "👨‍👩‍👧‍👦",
    "🇫🇷",
    "👍🏽",
    "I love 🍕 and 🎉!",
    # CJK
    "我喜欢自然语言处理。",
    "今日はいい天気ですね。",
    "안녕하세요, 만나서 반갑습니다.",
    # RTL
    "שלום עולם, מה שלומך?",
    "مرحبا بالعالم، كيف حالك؟",
    # Cyrillic
    "Привет, мир! Как дела?",
    # accented Latin, combining marks
    "café naïve résumé Ærøskøbing",
    "cafe\u0301",
    "e\u0301",
    "\u0301",
    "a\u0308\u0304",
    # code
    "def f(x):\n    if x > 0:\n        return x * 2\n    return None\n",
    "int main(void) {\n\tfor (int i = 0; i < 10; i++) { printf(\"%d\\n\", i); }\n\treturn 0;\n}",
    # URL, email
    "https://example.com/path/to?query=1&x=%20y#frag",
    "john.doe+test@example.co.uk",
    # contractions, case
    "I'm sure they'll say don't, we've, she's, I'd.",
    "I'M DON'T they'LL WE'Ve",
    "HeLLo WoRLD, camelCase and snake_case and SCREAMING_CASE",
    "Hello world",
    # special tokens
    "Hi<|im_end|>there",
    "<|im_start|>user\nHello<|im_end|>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "<|im_end|>",
    "<|im_endx|>",
    "< |im_end| >",
    "<|im_end",
    # repetition
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "!!!!!!!!!!!!????????",
    # The next two hit vocab pieces longer than 32 bytes: llama-cpp-python
    # 0.3.36's detokenize uses a 32-byte buffer and silently drops such
    # pieces, so their "decoded" differs from the text (llama.cpp's own
    # llama_detokenize returns them correctly). The ids are still right.
    "----------------------------------------",
    "if x:\n" + " " * 40 + "pass",
    # invisible characters
    "zero\u200bwidth",
    "non\u00a0breaking space",
    "\ufeffBOM at start",
    # math
    "∑∫√∞≠≤",
    "∀x ∈ ℝ: x² ≥ 0",
    # paragraph
    "The quick brown fox jumps over the lazy dog. Meanwhile, in 1999, "
    "researchers at three universities quietly published a 42-page report "
    "on tokenization; nobody read it until the 2020s, when it mattered.",
]


def main():
    gguf_path, out_path = sys.argv[1], sys.argv[2]
    with open(gguf_path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    llm = llama_cpp.Llama(model_path=gguf_path, vocab_only=True, verbose=False)
    cases = []
    for text in CASES:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        decoded = llm.detokenize(ids, special=True).decode("utf-8", errors="replace")
        cases.append({"text": text, "ids": ids, "decoded": decoded})
    header = {"gguf_sha256": sha, "llama_cpp_python": version("llama_cpp_python")}
    # One case per line keeps the fixture readable and its diffs small.
    lines = [json.dumps(c, ensure_ascii=False) for c in cases]
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header, ensure_ascii=False)[:-1])
        f.write(', "cases": [\n ' + ",\n ".join(lines) + "\n]}\n")


if __name__ == "__main__":
    main()
