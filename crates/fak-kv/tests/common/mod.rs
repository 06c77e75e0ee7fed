//! What the real-SmolLM2 tests of this crate share: finding the model file, loading it
//! on a weight path with its tokenizer and chat template, and a one-turn prompt's ids.

#![allow(dead_code)] // each test file uses its own part

use fak_model::{ChatTemplate, Message, Model, Tokenizer, WeightMode};
use std::path::PathBuf;
use std::sync::Arc;

/// The SmolLM2-135M-Instruct GGUF: `FAK_SMOLLM2_GGUF` when set, else the model cache
/// (a panic with the fetch command when it is not there).
pub fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FAK_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    fak_catalog::require_cached("smollm2-135m-instruct").unwrap_or_else(|m| panic!("{m}"))
}

/// The model on weight path `mode`, with the tokenizer and chat template of its file.
pub fn load(mode: WeightMode) -> (Arc<Model>, Tokenizer, ChatTemplate) {
    let path = smollm2_path();
    let model = Arc::new(Model::load_with(&path, mode).unwrap());
    let (tok, tmpl) = fak_model::load_text(&path, model.config()).unwrap();
    (model, tok, tmpl)
}

/// The ids of one user turn `text`, rendered by the chat template with the assistant's
/// turn opened (special tokens read as such).
pub fn prompt_ids(tok: &Tokenizer, tmpl: &ChatTemplate, text: &str) -> Vec<u32> {
    let messages = [Message::new("user", text)];
    tok.encode_with_special(&tmpl.render(&messages, true, None).unwrap())
        .unwrap()
}
