"""Export the prefill oracle (Anthropic prefill = HF's `continue_final_message`) for fak.

For SmolLM2-135M-Instruct: the chat template stored in the GGUF (read with gguf-py), rendered by
HF transformers' own `render_jinja_template(..., continue_final_message=True)` -- the function
`apply_chat_template` calls -- for a few conversations ending in a partial assistant message.
It needs no torch: only transformers, jinja2 and gguf.

    python oracle-export/export_prefill.py --smollm2 PATH/SmolLM2-135M-Instruct.Q4_1.gguf

writes testdata/text/smollm2-135m-instruct/prefill.json, read by
crates/fak-model/tests/text_oracle.rs (`smollm2_prefill_continues_as_hf`). The test encodes HF's
rendered text with fak's tokenizer (proven equal to HF's on the corpus by the same file's
`smollm2_tokenizer_matches_hf_on_the_corpus`) and compares it with fak's own continuation.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CASES = [
    ("user_then_partial", [{"role": "user", "content": "Name a colour."},
                           {"role": "assistant", "content": "The colour is"}]),
    ("system_and_trailing_space", [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is 2+2?"},
                                   {"role": "assistant", "content": "The answer is "}]),
    ("multi_turn", [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello! How can I help?"},
                    {"role": "user", "content": "Give me a JSON object with a key a."},
                    {"role": "assistant", "content": "{\"a\":"}]),
    ("repeated_content", [{"role": "user", "content": "Say yes."},
                          {"role": "assistant", "content": "yes"},
                          {"role": "user", "content": "Again: yes"},
                          {"role": "assistant", "content": "yes"}]),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2", required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default=str(REPO / "testdata"))
    args = ap.parse_args()

    import gguf
    from transformers.utils.chat_template_utils import render_jinja_template

    r = gguf.GGUFReader(args.smollm2)
    f = r.fields["tokenizer.chat_template"]
    template = bytes(f.parts[f.data[0]]).decode("utf-8")
    cases = []
    for name, messages in CASES:
        out = render_jinja_template(conversations=[messages], chat_template=template,
                                    continue_final_message=True, add_generation_prompt=False)
        rendered = out[0][0] if isinstance(out, tuple) else out[0]
        cases.append({"name": name, "messages": messages, "rendered": rendered})
    d = Path(args.out) / "text" / "smollm2-135m-instruct"
    d.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": "fak prefill oracle v1",
        "witness": "transformers.utils.chat_template_utils.render_jinja_template(..., continue_final_message=True) "
                   "(what apply_chat_template(continue_final_message=True) renders) of the GGUF's chat template",
        "command": "python oracle-export/export_prefill.py --smollm2 \"$(fak model path smollm2-135m-instruct)\"",
        "versions": {k: importlib.metadata.version(k) for k in ("transformers", "jinja2", "gguf")},
        "cases": cases,
    }
    (d / "prefill.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {d / 'prefill.json'} ({len(cases)} cases)")


if __name__ == "__main__":
    main()
