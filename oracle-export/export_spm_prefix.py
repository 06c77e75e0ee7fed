"""Fixture for `tokenizer.ggml.add_space_prefix` on a SentencePiece (`llama`) GGUF.

Writes `testdata/text/spm-prefix/vocab.gguf` (a tokenizer-only GGUF, written with gguf-py)
and `testdata/text/spm-prefix/encode.json`: ids from transformers' own GGUF tokenizer
builder (`convert_gguf_tokenizer`, fed the file's metadata as gguf-py reads it), the oracle
fak's tokenizer is checked against in `crates/fak-model/tests/hostile_text.rs`.

    pip install transformers==5.24.0 tokenizers==0.23.3 gguf==0.19.0   (torch not needed)
    python oracle-export/export_spm_prefix.py
"""

import json
from pathlib import Path

import gguf
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_TOKENIZER_MAPPING,
    convert_gguf_tokenizer,
)

OUT = Path(__file__).resolve().parent.parent / "testdata" / "text" / "spm-prefix"

# Control tokens, the 256 byte-fallback tokens, then pieces in merge order (a piece's
# score is minus its position, as in Llama 2's vocabulary, so position and score agree).
WORDS = ["Hello", "world", "the", "cat", "sat", "on", "mat", "Hi"]


def pieces() -> list[str]:
    out: list[str] = ["\u2581"] + sorted(set("".join(WORDS)))
    for w in WORDS:
        for word in (w, "\u2581" + w):
            for n in range(1, len(word) + 1):
                p = word[:n]
                if p not in out:
                    out.append(p)
    return out


def build() -> Path:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces()
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_tokenizer(path: Path):
    """transformers' builder, given the metadata its GGUF reader would hand it."""
    r = gguf.GGUFReader(str(path))
    meta = {}
    for name, field in r.fields.items():
        if not name.startswith("tokenizer.") and name != "general.architecture":
            continue
        meta[name] = field.contents()
    d = {
        new: meta[f"tokenizer.{key}"]
        for key, new in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    tok, _ = convert_gguf_tokenizer(meta["general.architecture"], d)
    return tok, meta


def main() -> None:
    path = build()
    tok, meta = hf_tokenizer(path)
    texts = [
        "Hello world",
        "Hello",
        "the cat sat on the mat",
        " Hello",
        "  two spaces",
        "Hi\nthe cat",
        "world Hello",
        "",
        "unknown \u00e9 bytes",
        "Hello</s> world",
        "<s>Hi the cat",
    ]
    entries = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in texts]
    (OUT / "encode.json").write_text(
        json.dumps(
            {
                "witness": "transformers convert_gguf_tokenizer on the metadata gguf-py reads from vocab.gguf",
                "command": "python oracle-export/export_spm_prefix.py",
                "add_space_prefix": bool(meta["tokenizer.ggml.add_space_prefix"]),
                "normalizer": json.loads(tok.to_str()).get("normalizer"),
                "pre_tokenizer": json.loads(tok.to_str()).get("pre_tokenizer"),
                "entries": entries,
            },
            indent=1,
            ensure_ascii=False,
        )
        + "\n"
    )
    for e in entries:
        print(repr(e["text"]), e["ids"], tok.encode(e["text"], add_special_tokens=False).tokens)


if __name__ == "__main__":
    main()
