//! llama.cpp (GGUF) tensor naming to HuggingFace naming: the family-independent split
//! of a name and the Llama family's block parts (each family's own parts are in
//! fak-model's `family/` files), and the Q/K row permutation llama.cpp's converter
//! applies.

/// Map a Llama-family GGUF tensor name to its HuggingFace `transformers` name.
///
/// Source of the pairs: llama.cpp `gguf-py/gguf/tensor_mapping.py` (LLAMA block and
/// model tensors) and transformers' `LlamaForCausalLM` state dict:
///
/// | GGUF | HF |
/// |---|---|
/// | `token_embd.weight` | `model.embed_tokens.weight` |
/// | `output_norm.weight` | `model.norm.weight` |
/// | `output.weight` | `lm_head.weight` |
/// | `blk.N.attn_q.weight` | `model.layers.N.self_attn.q_proj.weight` |
/// | `blk.N.attn_k.weight` | `model.layers.N.self_attn.k_proj.weight` |
/// | `blk.N.attn_v.weight` | `model.layers.N.self_attn.v_proj.weight` |
/// | `blk.N.attn_output.weight` | `model.layers.N.self_attn.o_proj.weight` |
/// | `blk.N.ffn_gate.weight` | `model.layers.N.mlp.gate_proj.weight` |
/// | `blk.N.ffn_up.weight` | `model.layers.N.mlp.up_proj.weight` |
/// | `blk.N.ffn_down.weight` | `model.layers.N.mlp.down_proj.weight` |
/// | `blk.N.attn_norm.weight` | `model.layers.N.input_layernorm.weight` |
/// | `blk.N.ffn_norm.weight` | `model.layers.N.post_attention_layernorm.weight` |
///
/// The `.weight` suffix may also be `.bias` (mapped the same way). Returns `None`
/// for any other name, including a layer index that is not a plain decimal number.
pub fn gguf_to_hf_name(gguf_name: &str) -> Option<String> {
    gguf_to_hf_name_with(gguf_name, gguf_llama_block_part)
}

/// The HF name (after `model.layers.N.`, without `.weight` / `.bias`) of a Llama GGUF
/// block tensor part, e.g. `attn_q` → `self_attn.q_proj` (the table above). The other
/// Llama-like families share these parts and map a few of their own (fak-model's
/// `family/` files).
pub fn gguf_llama_block_part(part: &str) -> Option<&'static str> {
    Some(match part {
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        _ => return None,
    })
}

/// Maps a GGUF tensor name to its HF name, the family-independent part: the model
/// tensors (`token_embd` → `model.embed_tokens`, `output_norm` → `model.norm`,
/// `output` → `lm_head`) and `blk.N.<part>` → `model.layers.N.<block_part(part)>`, with
/// a `.weight` or `.bias` suffix kept. `block_part` is the family's table of block
/// parts (e.g. [`gguf_llama_block_part`]). Returns `None` for any other name, a part
/// `block_part` does not know, or a layer index that is not a plain decimal number.
pub fn gguf_to_hf_name_with(
    gguf_name: &str,
    block_part: impl Fn(&str) -> Option<&'static str>,
) -> Option<String> {
    let (stem, suffix) = gguf_name.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let top = match stem {
        "token_embd" => Some("model.embed_tokens"),
        "output_norm" => Some("model.norm"),
        "output" => Some("lm_head"),
        _ => None,
    };
    if let Some(hf) = top {
        return Some(format!("{hf}.{suffix}"));
    }
    let rest = stem.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let hf = block_part(part)?;
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// Why a Q/K row permutation could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot (un)permute Q/K rows: {len} values as [n_head={n_head} x head_dim, cols={cols}]: {reason}")]
pub struct PermuteError {
    /// Length of the weight slice.
    pub len: usize,
    /// Heads given.
    pub n_head: usize,
    /// Columns given.
    pub cols: usize,
    /// Which condition failed.
    pub reason: &'static str,
}

fn head_dim(len: usize, n_head: usize, cols: usize) -> Result<usize, PermuteError> {
    let err = |reason| PermuteError {
        len,
        n_head,
        cols,
        reason,
    };
    if n_head == 0 || cols == 0 {
        return Err(err("n_head and cols must be nonzero"));
    }
    if !len.is_multiple_of(cols) {
        return Err(err("length is not a multiple of cols"));
    }
    let rows = len / cols;
    if !rows.is_multiple_of(n_head) {
        return Err(err("rows are not a multiple of n_head"));
    }
    let hd = rows / n_head;
    if !hd.is_multiple_of(2) {
        return Err(err("head_dim is odd"));
    }
    Ok(hd)
}

/// Undo llama.cpp's Q/K row permutation, giving rows in HF rotate-half order.
///
/// llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel.permute`) reorders the rows of
/// `q_proj`/`k_proj` within each head so that RoPE can rotate adjacent pairs: HF row
/// `h*hd + half*(hd/2) + i` is stored at GGUF row `h*hd + 2*i + half`. This inverts
/// that (transformers does the same in `reverse_permute_weights`,
/// `modeling_gguf_pytorch_utils.py`): output row `h*hd + half*(hd/2) + i` = input row
/// `h*hd + 2*i + half`.
///
/// `w` is row-major `[n_head * head_dim, cols]` f32 (a dequantized GGUF `attn_q` /
/// `attn_k`); `n_head` is the query heads for Q and the KV heads for K. Returns a
/// new buffer of the same shape.
///
/// # Errors
/// [`PermuteError`] if `n_head` or `cols` is 0, `w.len()` is not `rows * cols`, rows
/// do not divide into `n_head` heads, or the head dimension is odd.
pub fn unpermute_qk_rows(w: &[f32], n_head: usize, cols: usize) -> Result<Vec<f32>, PermuteError> {
    let hd = head_dim(w.len(), n_head, cols)?;
    let half = hd / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..n_head {
        for s in 0..2 {
            for i in 0..half {
                let dst = (h * hd + s * half + i) * cols;
                let src = (h * hd + 2 * i + s) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    Ok(out)
}

/// Apply llama.cpp's Q/K row permutation (the inverse of [`unpermute_qk_rows`]):
/// output row `h*hd + 2*i + half` = input row `h*hd + half*(hd/2) + i`. Useful when
/// writing a GGUF from HF weights.
///
/// # Errors
/// As [`unpermute_qk_rows`].
pub fn permute_qk_rows(w: &[f32], n_head: usize, cols: usize) -> Result<Vec<f32>, PermuteError> {
    let hd = head_dim(w.len(), n_head, cols)?;
    let half = hd / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..n_head {
        for s in 0..2 {
            for i in 0..half {
                let src = (h * hd + s * half + i) * cols;
                let dst = (h * hd + 2 * i + s) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The converter's `permute` written as its numpy ops: reshape to
    /// `(n_head, 2, hd/2, cols)`, swap axes 1 and 2, reshape back. Index form: the
    /// element at `[h, i, s, c]` of the swapped array comes from `[h, s, i, c]`.
    fn converter_permute(w: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
        let rows = w.len() / cols;
        let hd = rows / n_head;
        let half = hd / 2;
        let mut out = Vec::with_capacity(w.len());
        for h in 0..n_head {
            for i in 0..half {
                for s in 0..2 {
                    let src_row = h * hd + s * half + i;
                    out.extend_from_slice(&w[src_row * cols..(src_row + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn one_head_by_hand() {
        // head_dim 4, 1 column: HF rows [a0, a1, b0, b1] (rotate-half: first half,
        // second half) are stored by llama.cpp as [a0, b0, a1, b1].
        let hf = [10.0, 11.0, 20.0, 21.0];
        let gguf = converter_permute(&hf, 1, 1);
        assert_eq!(gguf, vec![10.0, 20.0, 11.0, 21.0]);
        assert_eq!(unpermute_qk_rows(&gguf, 1, 1).unwrap(), hf.to_vec());
    }

    #[test]
    fn permute_then_unpermute_is_identity() {
        for (n_head, hd, cols) in [(1, 2, 3), (3, 8, 5), (9, 64, 4), (2, 6, 1)] {
            let w: Vec<f32> = (0..n_head * hd * cols).map(|x| x as f32).collect();
            let p = converter_permute(&w, n_head, cols);
            assert_eq!(permute_qk_rows(&w, n_head, cols).unwrap(), p);
            assert_eq!(unpermute_qk_rows(&p, n_head, cols).unwrap(), w);
        }
    }

    #[test]
    fn bad_shapes() {
        assert!(unpermute_qk_rows(&[0.0; 12], 0, 3).is_err());
        assert!(unpermute_qk_rows(&[0.0; 12], 1, 0).is_err());
        assert!(unpermute_qk_rows(&[0.0; 12], 1, 5).is_err());
        assert!(unpermute_qk_rows(&[0.0; 12], 5, 1).is_err());
        assert!(unpermute_qk_rows(&[0.0; 12], 4, 1).is_err()); // head_dim 3
    }

    #[test]
    fn names() {
        let cases = [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output_norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.0.attn_q.weight",
                "model.layers.0.self_attn.q_proj.weight",
            ),
            (
                "blk.12.attn_k.weight",
                "model.layers.12.self_attn.k_proj.weight",
            ),
            (
                "blk.1.attn_v.weight",
                "model.layers.1.self_attn.v_proj.weight",
            ),
            (
                "blk.1.attn_output.weight",
                "model.layers.1.self_attn.o_proj.weight",
            ),
            (
                "blk.29.ffn_gate.weight",
                "model.layers.29.mlp.gate_proj.weight",
            ),
            ("blk.2.ffn_up.weight", "model.layers.2.mlp.up_proj.weight"),
            (
                "blk.2.ffn_down.weight",
                "model.layers.2.mlp.down_proj.weight",
            ),
            (
                "blk.3.attn_norm.weight",
                "model.layers.3.input_layernorm.weight",
            ),
            (
                "blk.3.ffn_norm.weight",
                "model.layers.3.post_attention_layernorm.weight",
            ),
        ];
        for (g, h) in cases {
            assert_eq!(gguf_to_hf_name(g).as_deref(), Some(h), "{g}");
        }
        for g in [
            "rope_freqs.weight",
            "blk.x.attn_q.weight",
            "blk..attn_q.weight",
            "blk.0.attn_q",
            "blk.0.foo.weight",
            "",
        ] {
            assert_eq!(gguf_to_hf_name(g), None, "{g}");
        }
    }
}
