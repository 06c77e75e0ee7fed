//! A ChatML byte-level BPE tokenizer built in the test (no model file needed) and a
//! Qwen-style template that renders tools, for the forged-turn tests of fak-model and
//! fak-engine.
#![allow(dead_code)]

use fak_model::Tokenizer;
use serde_json::{json, Value};
use std::path::Path;

/// `<|im_start|>`'s id.
pub const IM_START: u32 = 1;
/// `<|im_end|>`'s id.
pub const IM_END: u32 = 2;

/// A Qwen 2.5 / Qwen 3 style template (Hermes tool format) that renders every request
/// field it is given: tools as JSON and, as some templates do, their names,
/// descriptions and parameter names as text; calls' names and arguments (a string
/// as is, an object as JSON); tool results with their names and call ids.
pub const QWEN_STYLE: &str = r#"{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\n\n# Tools\n\nFunction signatures are inside <tools></tools>:\n<tools>" }}
{%- for tool in tools %}
{{- "\n" }}{{- tool | tojson }}
{%- endfor %}
{{- "\n</tools>\n\nIn short:" }}
{%- for tool in tools %}
{{- "\n- " + tool.function.name + ": " + tool.function.description }}
{%- for key, p in tool.function.parameters.properties.items() %}
{{- "\n  - " + key + ": " + p.description }}
{%- endfor %}
{%- endfor %}
{{- "\nCall one inside <tool_call></tool_call> tags.<|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response name="' + message.name + '" id="' + message.tool_call_id + '">\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"#;

/// GPT-2's byte alphabet (`bytes_to_unicode`).
fn byte_chars() -> Vec<char> {
    let mut n = 0;
    (0..256u32)
        .map(|b| {
            if (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b) {
                char::from_u32(b).unwrap()
            } else {
                n += 1;
                char::from_u32(255 + n).unwrap()
            }
        })
        .collect()
}

/// A byte-level BPE `tokenizer.json`: three control tokens (`<|endoftext|>`,
/// `<|im_start|>`, `<|im_end|>`), the 256 bytes, and merges for a few words.
pub fn tokenizer(dir: &Path) -> Tokenizer {
    let mut vocab = serde_json::Map::new();
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    for (i, t) in specials.iter().enumerate() {
        vocab.insert(t.to_string(), json!(i));
    }
    for c in byte_chars() {
        let id = vocab.len();
        vocab.insert(c.to_string(), json!(id));
    }
    let mut merges = Vec::new();
    for w in ["im", "user", "system", "assistant", "tool"] {
        let cs: Vec<String> = w.chars().map(String::from).collect();
        let mut acc = cs[0].clone();
        for c in &cs[1..] {
            merges.push(format!("{acc} {c}"));
            acc.push_str(c);
            if !vocab.contains_key(&acc) {
                let id = vocab.len();
                vocab.insert(acc.clone(), json!(id));
            }
        }
    }
    let added: Vec<Value> = specials
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tk = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "vocab": vocab, "merges": merges}
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tk.to_string()).unwrap();
    let tok = Tokenizer::from_file(&path, None, vec![IM_END]).unwrap();
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(IM_END));
    assert!(tok.is_special(IM_START) && tok.is_special(IM_END));
    tok
}
