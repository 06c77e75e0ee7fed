#!/usr/bin/env python3
"""Print what is in fak's oracle fixtures: every tensor's name, dtype and shape, and the key
metadata. A reader for humans; it checks nothing beyond the files' own internal consistency.

    python oracle-export/check_fixtures.py                 # every fixture under testdata/
    python oracle-export/check_fixtures.py testdata/oracles/smollm2-135m-instruct
    python oracle-export/check_fixtures.py path/to/file.safetensors --meta   # all metadata too
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
KEY_META = ["model_name", "qtype", "n_blocks", "prompt_id", "prompt_text", "eos_token_id", "bos_token_id",
            "n_layers", "hidden", "vocab", "greedy_text", "case", "poison_text", "eviction",
            "greedy_first_diff_index", "clean_greedy_text", "poisoned_greedy_text", "command"]


def shown(path: Path) -> Path:
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def show(path: Path, all_meta: bool) -> None:
    print(f"== {shown(path)}  ({path.stat().st_size} B)")
    with safe_open(str(path), framework="pt") as f:
        md = f.metadata() or {}
        names = list(f.keys())
        for name in names:
            sl = f.get_slice(name)
            print(f"   {name:18s} {sl.get_dtype():5s} {sl.get_shape()}")
        if "prompt_ids" in names:
            print(f"   prompt_ids = {f.get_tensor('prompt_ids').tolist()}")
        if "greedy_ids" in names:
            print(f"   greedy_ids = {f.get_tensor('greedy_ids').tolist()}")
        for name in ("prefix_ids", "poison_ids", "query_ids", "clean_greedy_ids", "poisoned_greedy_ids"):
            if name in names:
                print(f"   {name} = {f.get_tensor(name).tolist()}")
    for k in (md if all_meta else KEY_META):
        if k in md:
            v = md[k]
            quoted = ("prompt_text", "greedy_text", "poison_text", "clean_greedy_text", "poisoned_greedy_text")
            print(f"   [{k}] {v!r}" if k in quoted else f"   [{k}] {v}")


def show_json(path: Path) -> None:
    d = json.loads(path.read_text())
    if path.name == "state_dict.json":
        print(f"== {shown(path)}: {len(d['tensors'])} tensors, n_params = {d['n_params']:,}")
    elif path.name == "config.json":
        keys = ["model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"]
        print(f"== {shown(path)}: " + ", ".join(f"{k}={d.get(k)}" for k in keys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", default=[str(REPO / "testdata")])
    ap.add_argument("--meta", action="store_true", help="print every metadata entry")
    args = ap.parse_args()
    found = 0
    for p in map(Path, args.paths):
        p = p.resolve()
        files = [p] if p.is_file() else sorted(p.rglob("*"))
        for f in files:
            if f.suffix == ".safetensors":
                show(f, args.meta)
                found += 1
            elif f.name in ("state_dict.json", "config.json") and "oracles" in f.parts:
                show_json(f)
    if not found:
        sys.exit(f"no .safetensors under {args.paths}")


if __name__ == "__main__":
    main()
