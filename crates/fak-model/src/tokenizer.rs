//! The tokenizer that travels inside the checkpoint, as an HF `tokenizers` pipeline.
//!
//! From a GGUF file the tokenizer is rebuilt from its metadata (GGUF spec, "Tokenizer"
//! keys): `tokenizer.ggml.model` chooses the model (`gpt2`: byte-level BPE with merges;
//! `llama`: SentencePiece-style BPE with byte fallback, merges derived from the token
//! scores, a leading `▁` unless `tokenizer.ggml.add_space_prefix` is false),
//! `tokenizer.ggml.pre` chooses the pre-tokenizer pattern (an unknown `pre` is an error,
//! never a silent default), `tokenizer.ggml.token_type` marks control tokens
//! (special) and user-defined tokens (added, not special). From a safetensors folder the
//! `tokenizer.json` beside it is read as is.
//!
//! Security rule, beyond HF: [`Tokenizer::encode`] encodes text with special-token
//! parsing off, so `<|im_end|>` typed inside a message is ordinary text and can never
//! forge a turn boundary; only [`Tokenizer::encode_with_special`], used for the text a
//! chat template itself emits, turns control-token text into control tokens.

use aho_corasick::{AhoCorasick, MatchKind};
use fak_weights::{GgufFile, MetaValue};
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::Path;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, DecoderWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

/// Errors building or using a tokenizer. Each names the key, value or file at fault.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A GGUF tokenizer key is missing or has the wrong type.
    #[error("tokenizer metadata: {0}")]
    Metadata(String),
    /// `tokenizer.ggml.model` names a model fak does not build.
    #[error("unsupported tokenizer model '{0}' (fak builds: gpt2, llama)")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer fak does not know.
    #[error(
        "unknown pre-tokenizer '{0}' (fak knows: default, gpt2, smollm, llama-bpe, llama3, qwen2)"
    )]
    UnknownPre(String),
    /// The `tokenizers` library refused the pipeline or the input.
    #[error("tokenizer: {0}")]
    Library(String),
    /// The vocabulary would cost more to build than fak allows (a hostile model file).
    #[error("tokenizer: {what} is {value}, over the limit of {limit}")]
    Limit {
        /// What was measured, with its unit.
        what: &'static str,
        /// Its value for this vocabulary.
        value: u64,
        /// The limit ([`MAX_SPM_MERGE_WORK`], [`MAX_CONTROL_TEXT_WORK`]).
        limit: u64,
    },
    /// `tokenizer.json` could not be read.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// What went wrong.
        reason: String,
    },
}

fn lib_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Library(e.to_string())
}

/// Llama 3's pattern (`llama-bpe` in llama.cpp).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's pattern: Llama 3's with single digits.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Most bytes fak hashes deriving a SentencePiece vocabulary's merges: the sum over its
/// distinct pieces of (bytes × (characters − 1)), every way of cutting a piece in two.
/// It also bounds the merges' text (each merge holds at most its piece's bytes), so the
/// build's time and memory stay linear in it. A vocabulary of 262,144 pieces (Gemma 3's
/// size) fits with pieces averaging 22 bytes and 22 characters; SentencePiece pieces
/// average far less.
pub const MAX_SPM_MERGE_WORK: u64 = 128 << 20;

/// Most bytes of control-token text heads and tails fak indexes (the sum over control
/// tokens of their length squared): Gemma 3's 6,249 control tokens use 0.87 MB of it,
/// SmolLM2's 17 under 3 KB.
pub const MAX_CONTROL_TEXT_WORK: u64 = 16 << 20;

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// A model's tokenizer plus the ids the engine needs (BOS, EOS, end of turn).
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same pipeline with special-token parsing on (for template text).
    with_special: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Vec<u32>,
    add_bos: bool,
    /// Raw bytes of every token, for the streaming decoder.
    token_bytes: Vec<Vec<u8>>,
    special_ids: Vec<bool>,
    /// Finds control-token text in request strings (see [`Tokenizer::control_text_ranges`]).
    control: ControlText,
}

/// The texts of a vocabulary's control tokens, to find them (or a piece that could
/// join template text into one) inside a request string.
#[derive(Clone, Debug, Default)]
struct ControlText {
    /// Every control token's text, leftmost-longest (as the added-token split matches).
    matcher: Option<AhoCorasick>,
    /// Proper non-empty prefixes of control texts (`<|im_` of `<|im_end|>`).
    heads: HashSet<String>,
    /// Proper non-empty suffixes of control texts (`end|>` of `<|im_end|>`).
    tails: HashSet<String>,
    /// Longest control text, in bytes.
    longest: usize,
}

impl ControlText {
    fn new<'a>(texts: impl IntoIterator<Item = &'a str>) -> Result<Self, TokenizerError> {
        let texts: Vec<&str> = texts.into_iter().filter(|t| !t.is_empty()).collect();
        let work: u64 = texts.iter().map(|t| (t.len() as u64).pow(2)).sum();
        if work > MAX_CONTROL_TEXT_WORK {
            return Err(TokenizerError::Limit {
                what: "the control tokens' text (sum of squared lengths, bytes^2)",
                value: work,
                limit: MAX_CONTROL_TEXT_WORK,
            });
        }
        let mut heads = HashSet::new();
        let mut tails = HashSet::new();
        for t in &texts {
            for (i, _) in t.char_indices().skip(1) {
                heads.insert(t[..i].to_string());
                tails.insert(t[i..].to_string());
            }
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&texts)
            .ok()
            .filter(|_| !texts.is_empty());
        Ok(ControlText {
            matcher,
            heads,
            tails,
            longest: texts.iter().map(|t| t.len()).max().unwrap_or(0),
        })
    }

    fn ranges(&self, s: &str) -> Vec<Range<usize>> {
        let Some(m) = &self.matcher else {
            return Vec::new();
        };
        let mut out: Vec<Range<usize>> = Vec::new();
        // A head of `s` that ends a control text (template text before it may start one).
        if let Some(n) = (1..self.longest.min(s.len() + 1))
            .rev()
            .find(|&n| s.is_char_boundary(n) && self.tails.contains(&s[..n]))
        {
            out.push(0..n);
        }
        out.extend(m.find_iter(s).map(|x| x.range()));
        // A tail of `s` that starts a control text.
        if let Some(n) = (1..self.longest.min(s.len() + 1))
            .rev()
            .find(|&n| s.is_char_boundary(s.len() - n) && self.heads.contains(&s[s.len() - n..]))
        {
            out.push(s.len() - n..s.len());
        }
        // Sorted by start already; merge overlaps.
        let mut merged: Vec<Range<usize>> = Vec::with_capacity(out.len());
        for r in out {
            match merged.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        merged
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.token_bytes.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

/// The byte-level alphabet of GPT-2 (`bytes_to_unicode`): byte -> char.
fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap_or('\0')
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    table
}

impl Tokenizer {
    /// Builds the tokenizer from a GGUF file's metadata.
    ///
    /// # Errors
    /// [`TokenizerError::Metadata`] for missing/mistyped keys,
    /// [`TokenizerError::UnsupportedModel`], [`TokenizerError::UnknownPre`].
    pub fn from_gguf(g: &GgufFile) -> Result<Self, TokenizerError> {
        let md = |e: fak_weights::GgufError| TokenizerError::Metadata(e.to_string());
        let model = g.get_str("tokenizer.ggml.model").map_err(md)?.to_string();
        let tokens: Vec<String> = g
            .get_array("tokenizer.ggml.tokens")
            .map_err(md)?
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                TokenizerError::Metadata("tokenizer.ggml.tokens holds a non-string".into())
            })?;
        let types: Vec<i64> = match g.get("tokenizer.ggml.token_type") {
            Some(MetaValue::Array(a)) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
            _ => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(TokenizerError::Metadata(format!(
                "{} token types for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let id = |k: &str| g.get(k).and_then(MetaValue::as_u64).map(|x| x as u32);
        let bos = id("tokenizer.ggml.bos_token_id");
        let eos: Vec<u32> = id("tokenizer.ggml.eos_token_id").into_iter().collect();
        let unk = id("tokenizer.ggml.unknown_token_id");
        for (name, t) in [("bos", bos), ("unknown", unk)]
            .into_iter()
            .chain(eos.iter().map(|&e| ("eos", Some(e))))
        {
            if let Some(t) = t {
                if t as usize >= tokens.len() {
                    return Err(TokenizerError::Metadata(format!(
                        "{name} token id {t} is outside the vocabulary of {}",
                        tokens.len()
                    )));
                }
            }
        }
        let add_space_prefix = g
            .get("tokenizer.ggml.add_space_prefix")
            .and_then(MetaValue::as_bool)
            .unwrap_or(true);
        let add_bos = g
            .get("tokenizer.ggml.add_bos_token")
            .and_then(MetaValue::as_bool)
            .unwrap_or(model == "llama");

        let (mut tk, token_bytes) = match model.as_str() {
            "gpt2" => {
                let pre = g
                    .get("tokenizer.ggml.pre")
                    .and_then(MetaValue::as_str)
                    .unwrap_or("default")
                    .to_string();
                let merges: Vec<(String, String)> = g
                    .get_array("tokenizer.ggml.merges")
                    .map_err(md)?
                    .iter()
                    .map(|m| {
                        let s = m.as_str()?;
                        let (a, b) = s.split_once(' ')?;
                        Some((a.to_string(), b.to_string()))
                    })
                    .collect::<Option<_>>()
                    .ok_or_else(|| TokenizerError::Metadata("a merge is not 'a b'".into()))?;
                // A token spelled outside GPT-2's byte alphabet is respelled byte by byte
                // (as HF's GGUF loader does).
                let alphabet = byte_to_char();
                let in_alphabet = |t: &str| t.chars().all(|c| alphabet.contains(&c));
                let vocab: Vocab = tokens
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        let key = if in_alphabet(t) {
                            t.clone()
                        } else {
                            t.bytes().map(|b| alphabet[b as usize]).collect()
                        };
                        (key, i as u32)
                    })
                    .collect();
                // Every merge must join two tokens into a token of the vocabulary: the
                // BPE builder of `tokenizers` indexes a buffer of the longest token's
                // length with the joined pair before it looks the pair up, so a merge
                // longer than every token panics there instead of erring.
                if let Some((a, b)) = merges
                    .iter()
                    .find(|(a, b)| !vocab.contains_key(&format!("{a}{b}")))
                {
                    return Err(TokenizerError::Metadata(format!(
                        "the merge '{a} {b}' joins to a token that is not in the vocabulary"
                    )));
                }
                let bpe = BPE::builder()
                    .vocab_and_merges(vocab, merges)
                    .build()
                    .map_err(lib_err)?;
                let mut tk = tokenizers::Tokenizer::new(bpe);
                tk.with_pre_tokenizer(Some(byte_level_pre(&pre)?));
                tk.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::default())));
                // Byte-level tokens map back to bytes through GPT-2's alphabet.
                let mut rev = HashMap::new();
                for (b, c) in byte_to_char().iter().enumerate() {
                    rev.insert(*c, b as u8);
                }
                let bytes = tokens
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        if types[i] == TOKEN_TYPE_CONTROL {
                            t.as_bytes().to_vec()
                        } else {
                            t.chars()
                                .map(|c| rev.get(&c).copied().unwrap_or(b'?'))
                                .collect()
                        }
                    })
                    .collect();
                (tk, bytes)
            }
            "llama" => {
                let respelled: Vec<String> = tokens.iter().map(|t| respell_spaces(t)).collect();
                let merges = spm_merges(&respelled)?;
                let vocab: Vocab = respelled
                    .iter()
                    .enumerate()
                    .map(|(i, t)| (t.clone(), i as u32))
                    .collect();
                let mut builder = BPE::builder()
                    .vocab_and_merges(vocab, merges)
                    .byte_fallback(true)
                    .fuse_unk(true);
                if let Some(u) = unk {
                    builder = builder.unk_token(tokens[u as usize].clone());
                }
                let bpe = builder.build().map_err(lib_err)?;
                let mut tk = tokenizers::Tokenizer::new(bpe);
                spm_pipeline(&mut tk, add_space_prefix)?;
                let bytes = tokens
                    .iter()
                    .map(|t| match byte_fallback_value(t) {
                        Some(b) => vec![b],
                        None => t.replace('▁', " ").into_bytes(),
                    })
                    .collect();
                (tk, bytes)
            }
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };

        // Control tokens become special added tokens, user-defined ones plain added tokens
        // (so both are matched whole), as HF's GGUF loader adds them: a byte-level control
        // token spelled outside the byte alphabet is a converter mislabel and is skipped; a
        // user-defined token is added only if the model's vocabulary holds it as spelled.
        let alphabet = byte_to_char();
        let mut special = Vec::new();
        let mut added = Vec::new();
        let mut special_ids = vec![false; tokens.len()];
        for (i, t) in tokens.iter().enumerate() {
            let in_vocab = tk.token_to_id(t) == Some(i as u32);
            match types[i] {
                TOKEN_TYPE_CONTROL
                    if model != "gpt2" || t.chars().all(|c| alphabet.contains(&c)) =>
                {
                    special.push(AddedToken::from(t.clone(), true).normalized(false));
                    special_ids[i] = true;
                }
                TOKEN_TYPE_USER_DEFINED if in_vocab => {
                    added.push(AddedToken::from(t.clone(), false).normalized(false))
                }
                _ => {}
            }
        }
        tk.add_special_tokens(special).map_err(lib_err)?;
        tk.add_tokens(added).map_err(lib_err)?;
        Self::finish(tk, bos, eos, add_bos, token_bytes, special_ids)
    }

    fn finish(
        mut tk: tokenizers::Tokenizer,
        bos: Option<u32>,
        eos: Vec<u32>,
        add_bos: bool,
        token_bytes: Vec<Vec<u8>>,
        special_ids: Vec<bool>,
    ) -> Result<Self, TokenizerError> {
        let texts: Vec<String> = special_ids
            .iter()
            .enumerate()
            .filter(|(_, &s)| s)
            .filter_map(|(i, _)| tk.id_to_token(i as u32))
            .collect();
        let control = ControlText::new(texts.iter().map(String::as_str))?;
        let with_special = tk.clone();
        tk.set_encode_special_tokens(true);
        Ok(Tokenizer {
            inner: tk,
            with_special,
            bos,
            eos,
            add_bos,
            token_bytes,
            special_ids,
            control,
        })
    }

    /// Reads a `tokenizer.json` (HF format) from `path`; BOS/EOS come from the caller's
    /// config.
    ///
    /// # Errors
    /// [`TokenizerError::File`] when it cannot be read or parsed.
    pub fn from_file(path: &Path, bos: Option<u32>, eos: Vec<u32>) -> Result<Self, TokenizerError> {
        let tk = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::File {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        let n = tk.get_vocab_size(true);
        let mut token_bytes = vec![Vec::new(); n];
        let mut special_ids = vec![false; n];
        for (id, t) in tk.get_added_tokens_decoder() {
            if t.special && (id as usize) < n {
                special_ids[id as usize] = true;
            }
        }
        for (i, b) in token_bytes.iter_mut().enumerate() {
            *b = tk
                .decode(&[i as u32], false)
                .unwrap_or_default()
                .into_bytes();
        }
        Self::finish(tk, bos, eos, false, token_bytes, special_ids)
    }

    /// Encodes message text with special-token parsing off: control-token text becomes
    /// ordinary tokens. No BOS is added.
    ///
    /// # Errors
    /// [`TokenizerError::Library`] if the pipeline fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(lib_err)?
            .get_ids()
            .to_vec())
    }

    /// Encodes text a chat template emitted: control-token text becomes control tokens.
    /// No BOS is added.
    ///
    /// # Errors
    /// [`TokenizerError::Library`] if the pipeline fails.
    pub fn encode_with_special(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        Ok(self
            .with_special
            .encode(text, false)
            .map_err(lib_err)?
            .get_ids()
            .to_vec())
    }

    /// Like [`Tokenizer::encode_with_special`], also returning each token's byte range in
    /// `text`.
    ///
    /// # Errors
    /// [`TokenizerError::Library`] if the pipeline fails.
    #[allow(clippy::type_complexity)]
    pub fn encode_with_special_offsets(
        &self,
        text: &str,
    ) -> Result<(Vec<u32>, Vec<(usize, usize)>), TokenizerError> {
        let e = self.with_special.encode(text, false).map_err(lib_err)?;
        Ok((e.get_ids().to_vec(), e.get_offsets().to_vec()))
    }

    /// Decodes ids to text (`skip_special`: drop control tokens). Invalid UTF-8 becomes
    /// U+FFFD, as HF does.
    ///
    /// # Errors
    /// [`TokenizerError::Library`] for an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.token_bytes.len()) {
            return Err(TokenizerError::Library(format!(
                "token id {bad} is outside the vocabulary"
            )));
        }
        self.inner.decode(ids, skip_special).map_err(lib_err)
    }

    /// The raw bytes a token stands for (byte-level tokens mapped back to bytes, byte
    /// fallback tokens to their byte, control tokens to their text).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// Whether `id` is a control (special) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.get(id as usize).copied().unwrap_or(false)
    }

    /// Byte ranges of `s` that must never join the template's text as control tokens,
    /// sorted and disjoint: each control token's text inside `s` (leftmost-longest, as
    /// the tokenizer splits them), a head of `s` that is the end of a control text (`|>`)
    /// and a tail of `s` that is the start of one (`<|im_`), since template text around
    /// `s` could complete those. Empty for a vocabulary without control tokens.
    pub fn control_text_ranges(&self, s: &str) -> Vec<Range<usize>> {
        self.control.ranges(s)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// The id of `token` if it is one token of the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.with_special.token_to_id(token)
    }

    /// The text of token `id`, as stored in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.with_special.id_to_token(id)
    }

    /// Beginning-of-sequence id.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence ids.
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    /// Whether a plain prompt gets BOS prepended (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Encodes a plain (non-chat) prompt: BOS when the model asks for it, then the text
    /// with special-token parsing off.
    ///
    /// # Errors
    /// As [`Tokenizer::encode`].
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend(self.encode(text)?);
        Ok(ids)
    }
}

/// The normalizer, pre-tokenizer and decoder of a SentencePiece (`llama`) vocabulary.
/// `tokenizer.ggml.add_space_prefix` (default true, as llama.cpp has it) gives the text a
/// leading `▁` the way transformers builds a `llama` GGUF's tokenizer (Metaspace, prepended
/// to the first piece of text only), stripped again on decode. Gemma's files say false:
/// spaces become `▁` and nothing is prepended.
fn spm_pipeline(
    tk: &mut tokenizers::Tokenizer,
    add_space_prefix: bool,
) -> Result<(), TokenizerError> {
    let mut decoders = vec![
        DecoderWrapper::Replace(Replace::new("▁", " ").map_err(lib_err)?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if add_space_prefix {
        let prefix = Metaspace::new('▁', PrependScheme::First, false);
        tk.with_pre_tokenizer(Some(PreTokenizerWrapper::Metaspace(prefix)));
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    } else {
        tk.with_normalizer(Some(Replace::new(" ", "▁").map_err(lib_err)?))
            .map_err(lib_err)?;
    }
    tk.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(
        decoders,
    ))));
    Ok(())
}

/// `<0xAB>` -> 0xAB.
fn byte_fallback_value(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The byte-level pre-tokenizer of `tokenizer.ggml.pre`.
fn byte_level_pre(pre: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    let split = |pattern: &str| -> Result<PreTokenizerWrapper, TokenizerError> {
        // HF: Split(pattern, isolated) then ByteLevel without its own regex.
        let s = Split::new(
            SplitPattern::Regex(pattern.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(lib_err)?;
        Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Split(s),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
        ])))
    };
    match pre {
        // GPT-2's split. `smollm` is built as HF transformers builds it from a GGUF (GPT-2's
        // pattern); the hub's SmolLM2 tokenizer.json splits digits first, which differs only
        // for a run of spaces before a digit. HF's build is the witness the tests check.
        "default" | "gpt2" | "smollm" => Ok(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
            false, true, true,
        ))),
        "llama-bpe" | "llama3" => split(LLAMA3_PATTERN),
        "qwen2" => split(QWEN2_PATTERN),
        other => Err(TokenizerError::UnknownPre(other.to_string())),
    }
}

/// Gemma-style SentencePiece vocabularies store a token of spaces (or spaces mixed with
/// other whitespace) with real spaces; the normalizer writes spaces as `▁`, so such a
/// token is looked up as `▁` repeated once per character (as HF's GGUF loader respells it).
fn respell_spaces(t: &str) -> String {
    if t.contains(' ') && t.trim().is_empty() {
        "▁".repeat(t.chars().count())
    } else {
        t.to_string()
    }
}

/// Merges of a SentencePiece BPE vocabulary that ships none, derived as HF's GGUF
/// loader does (`generate_merges` with Gemma's positional scores): every way of writing
/// a token as two vocabulary pieces is a merge; merges are ranked by the merged token's
/// position in the file (earlier first), then by the left piece's length (longer first).
/// `tokens` are the respelled pieces; a piece that occurs twice takes its last position.
///
/// # Errors
/// [`TokenizerError::Limit`] when deriving them would hash more than
/// [`MAX_SPM_MERGE_WORK`] bytes (checked first, in one pass over the pieces).
fn spm_merges(tokens: &[String]) -> Result<Vec<(String, String)>, TokenizerError> {
    let index: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let work = index.keys().fold(0u64, |acc, p| {
        let splits = p.chars().count().saturating_sub(1) as u64;
        acc.saturating_add((p.len() as u64).saturating_mul(splits))
    });
    if work > MAX_SPM_MERGE_WORK {
        return Err(TokenizerError::Limit {
            what: "deriving the SentencePiece merges (bytes hashed)",
            value: work,
            limit: MAX_SPM_MERGE_WORK,
        });
    }
    // (merged token's position, left length in chars, right length, left id, right id)
    let mut merges: Vec<(usize, usize, usize, usize, usize)> = Vec::new();
    for (piece, &pos) in &index {
        let n = piece.chars().count();
        for (k, (split, _)) in piece.char_indices().enumerate().skip(1) {
            let (a, b) = piece.split_at(split);
            if let (Some(&ia), Some(&ib)) = (index.get(a), index.get(b)) {
                merges.push((pos, k, n - k, ia, ib));
            }
        }
    }
    merges.sort_by(|x, y| {
        x.0.cmp(&y.0)
            .then(y.1.cmp(&x.1))
            .then(y.2.cmp(&x.2))
            .then(x.3.cmp(&y.3))
            .then(x.4.cmp(&y.4))
    });
    Ok(merges
        .into_iter()
        .map(|(_, _, _, a, b)| (tokens[a].clone(), tokens[b].clone()))
        .collect())
}

/// Streaming detokenizer: turns token ids into text pieces as they arrive, never
/// emitting a broken UTF-8 sequence. The bytes of a character split across tokens (an
/// emoji over byte-fallback or byte-level tokens) are held back until it is complete;
/// bytes that can never become valid UTF-8 are emitted as U+FFFD, as HF's decode does.
#[derive(Clone, Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    skip_special: bool,
}

impl StreamDecoder {
    /// A decoder; `skip_special` drops control tokens (EOS, end of turn) from the text.
    pub fn new(skip_special: bool) -> Self {
        StreamDecoder {
            pending: Vec::new(),
            skip_special,
        }
    }

    /// Adds one token and returns the text that is now complete (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        if self.skip_special && tokenizer.is_special(id) {
            return String::new();
        }
        self.pending.extend_from_slice(tokenizer.token_bytes(id));
        self.drain(false)
    }

    /// Ends the stream: returns what is held back, an incomplete sequence as U+FFFD.
    pub fn finish(&mut self) -> String {
        self.drain(true)
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    fn drain(&mut self, end: bool) -> String {
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // The prefix up to `good` was just validated by from_utf8.
                    out.push_str(std::str::from_utf8(&self.pending[..good]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..good + bad);
                        }
                        None if end => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.clear();
                            return out;
                        }
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_pre_tokenizer_is_an_error_not_a_default() {
        for known in ["default", "gpt2", "smollm", "llama-bpe", "llama3", "qwen2"] {
            assert!(byte_level_pre(known).is_ok(), "{known}");
        }
        assert!(
            matches!(byte_level_pre("deepseek-coder"), Err(TokenizerError::UnknownPre(p)) if p == "deepseek-coder")
        );
    }

    #[test]
    fn byte_fallback_tokens_and_space_respelling() {
        assert_eq!(byte_fallback_value("<0x0A>"), Some(10));
        assert_eq!(byte_fallback_value("<0xZZ>"), None);
        assert_eq!(byte_fallback_value("<0x0A0>"), None);
        assert_eq!(respell_spaces("   "), "▁▁▁");
        assert_eq!(respell_spaces(" \n"), "▁▁");
        assert_eq!(respell_spaces("a b"), "a b");
    }

    #[test]
    fn spm_merges_rank_by_position_then_longer_left_piece() {
        let toks: Vec<String> = ["a", "b", "c", "ab", "abc", "bc"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let m = spm_merges(&toks).unwrap();
        // "ab" (position 3) first; then "abc" (4) as ab+c before a+bc; "bc" (5) last.
        let want: Vec<(String, String)> = [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")]
            .iter()
            .map(|(x, y)| (x.to_string(), y.to_string()))
            .collect();
        assert_eq!(m, want);
    }
}
