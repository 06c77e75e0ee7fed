//! fak-tensor: the numeric primitives every model family is built from.
//!
//! One job: compute `dot`, matrix-vector / matrix-matrix products, RMSNorm, RoPE
//! (rotate-half, as HF's `apply_rotary_pos_emb`), softmax and SiLU on `f32` slices,
//! with a summation order that is fixed independently of batch size, sequence length
//! and thread count. That fixed order is the *exact path* contract of `docs/design.md`: a
//! token's logits are bit-identical whether it was computed in a prefill of 500 tokens
//! or in a single decode step, on one thread or many.
//!
//! The canonical order of a dot product (see [`dot::dot_ref`]) is: eight lane
//! accumulators, each fed by fused multiply-adds over the elements `i ≡ lane (mod 8)`
//! in ascending `i`; then the fixed tree `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`; then the
//! tail elements (`n mod 8`) fused in ascending order. Every kernel (the scalar
//! reference, the AVX2/FMA kernels, the multi-row and multi-token micro-kernels)
//! computes each output in exactly that order, so they agree bit for bit; tests check it.
//! The 512-bit kernels (chosen at run time when the CPU has AVX-512, off with
//! `FAK_NO_AVX512=1`) keep the order too: a 512-bit register holds the eight lanes of
//! two rows or of two tokens side by side, never sixteen lanes of one dot product. (The
//! quantized products have their own canonical order per block format, in the module
//! docs of [`quant`]: their tiles hold one accumulator of sixteen (row, token) pairs per
//! register.)
//!
//! Element-wise functions keep torch's operation order per element; the two library
//! functions they call are computed eight or sixteen at a time with exactly the bits of
//! the platform's own (each checked on all 2³² inputs), so vectorizing them changed no
//! result: `expf` (softmax, SiLU) by [`exp::exp_in_place`], and `tanhf` (Gemma's GELU)
//! by [`tanh::tanh_in_place`] and [`tanh::gelu_tanh_mul_in_place`].
//!
//! Layout conventions: matrices are row-major `[rows, cols]` `f32` slices, as torch's
//! `nn.Linear.weight` is `[out_features, in_features]`; activations are `[tokens, dim]`.

pub mod cpu;
pub mod dot;
pub mod elem;
pub mod exp;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod quant;
pub mod tanh;

pub use dot::{
    dot, dot_key_tiles, dot_ref, dot_strided, dot_strided_multi, put_key_in_tile, KEY_TILE,
};
pub use elem::{WeightElem, F16};
pub use matmul::{matmul, matmul_group, matmul_ref, parallel_chunks, Linear, Threads};
pub use ops::{
    add_assign, first_equal, gelu_tanh, has_nan, max_skipping_nan, rms_norm, rope_rotate_half,
    scale_in_place, silu, softmax_in_place, softmax_rows_in_place, weighted_rows_accumulate,
    weighted_rows_sum, RopeTable,
};

/// Test helpers shared by the modules' tests.
#[cfg(test)]
pub(crate) mod test_util {
    /// A kernel applied in place, with its name.
    pub(crate) type NamedKernel = (&'static str, fn(&mut [f32]));

    /// The first of the 2³² `f32` bit patterns on which one of `kernels` (each applied
    /// in place to 65,536 consecutive patterns) differs from `oracle` (a NaN matching
    /// any NaN), with the kernel's name; on two threads, one per half of the patterns.
    pub(crate) fn first_mismatch_over_every_f32(
        kernels: &[NamedKernel],
        oracle: fn(f32) -> f32,
    ) -> Option<(&'static str, u32)> {
        let halves: [(u64, u64); 2] = [(0, 1 << 31), (1 << 31, 1 << 32)];
        std::thread::scope(|s| {
            let hs: Vec<_> = halves
                .iter()
                .map(|&(lo, hi)| {
                    s.spawn(move || {
                        let mut buf = vec![0f32; 1 << 16];
                        let mut want = vec![0f32; 1 << 16];
                        let mut b = lo;
                        while b < hi {
                            for (i, w) in want.iter_mut().enumerate() {
                                *w = oracle(f32::from_bits((b + i as u64) as u32));
                            }
                            for &(name, kernel) in kernels {
                                for (i, v) in buf.iter_mut().enumerate() {
                                    *v = f32::from_bits((b + i as u64) as u32);
                                }
                                kernel(&mut buf);
                                for (i, (v, w)) in buf.iter().zip(&want).enumerate() {
                                    let same =
                                        v.to_bits() == w.to_bits() || v.is_nan() && w.is_nan();
                                    if !same {
                                        return Some((name, (b + i as u64) as u32));
                                    }
                                }
                            }
                            b += buf.len() as u64;
                        }
                        None
                    })
                })
                .collect();
            hs.into_iter()
                .filter_map(|h| h.join().expect("a checking thread"))
                .next()
        })
    }
}
