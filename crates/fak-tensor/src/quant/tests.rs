use super::*;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 16
    }
    fn byte(&mut self) -> u8 {
        (self.next() >> 8) as u8
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 24) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// f16 scales worth testing: zero, signed zero, the smallest subnormal, the largest
/// finite, infinity, a quiet and a signalling NaN, and ordinary values.
const F16_EXTREMES: [u16; 11] = [
    0x0000, 0x8000, 0x0001, 0x83ff, 0x7bff, 0xfbff, 0x7c00, 0x7e00, 0x7d01, 0x3c00, 0xb800,
];

fn some_f16(r: &mut Rng, extreme: bool) -> u16 {
    if extreme && r.below(3) == 0 {
        F16_EXTREMES[r.below(F16_EXTREMES.len())]
    } else {
        // A normal scale of moderate size, either sign.
        f32_to_f16(r.unit() * 0.05 + if r.below(2) == 0 { 0.01 } else { -0.01 })
    }
}

/// Random weight bytes for `n` blocks of `ty`, with f16 fields replaced by chosen
/// scales (random bytes elsewhere cover every nibble, bit and scale pattern).
fn weights(r: &mut Rng, ty: QType, n: usize, extreme: bool) -> Vec<u8> {
    let bb = ty.block_bytes();
    let mut w: Vec<u8> = (0..n * bb).map(|_| r.byte()).collect();
    let f16_fields: &[usize] = match ty {
        QType::Q4_0 | QType::Q5_0 | QType::Q8_0 | QType::Q8_0R2 | QType::Q8_0R16 => &[0],
        QType::Q4_1 | QType::Q4_1R16 | QType::Q5_1 | QType::Q4K | QType::Q5K => &[0, 2],
        QType::Q6K => &[208],
    };
    for b in w.chunks_exact_mut(bb) {
        for &at in f16_fields {
            b[at..at + 2].copy_from_slice(&some_f16(r, extreme).to_le_bytes());
        }
    }
    w
}

/// Random activation blocks of any content (the kernels must be exact for every i8,
/// including -128, and for any `s` / `bsums`, not only what the quantizers produce).
fn acts(r: &mut Rng, ty: QType, n: usize, extreme: bool) -> QuantizedActs {
    let qs32 = |r: &mut Rng| {
        let mut q = [0i8; QK];
        q.iter_mut().for_each(|v| *v = r.byte() as i8);
        q
    };
    match ty.act_kind() {
        ActKind::Q8_0 => QuantizedActs::Q8_0(
            (0..n)
                .map(|_| BlockQ8_0 {
                    d: some_f16(r, extreme),
                    qs: qs32(r),
                })
                .collect(),
        ),
        ActKind::Q8_1 => QuantizedActs::Q8_1(
            (0..n)
                .map(|_| BlockQ8_1 {
                    d: some_f16(r, extreme),
                    s: some_f16(r, extreme),
                    qs: qs32(r),
                })
                .collect(),
        ),
        ActKind::Q8K => QuantizedActs::Q8K(
            (0..n)
                .map(|_| {
                    let mut b = BlockQ8K {
                        d: f16_to_f32(some_f16(r, extreme)) * 0.01,
                        qs: [0; QK_K],
                        bsums: [0; 16],
                    };
                    b.qs.iter_mut().for_each(|v| *v = r.byte() as i8);
                    b.bsums
                        .iter_mut()
                        .for_each(|v| *v = ((r.byte() as u16) << 8 | r.byte() as u16) as i16);
                    b
                })
                .collect(),
        ),
    }
}

/// Bit-identical, except that two NaNs count as equal: which NaN payload an `f32`
/// addition returns depends on operand order, which LLVM may commute (x86 returns
/// the first operand's payload), so NaN payloads are not part of the contract.
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn simd_is_available_on_x86_64() {
    // The agreement tests below compare the dispatched kernel with the reference; on
    // x86_64 that must really be the AVX2 kernel, or they would compare the reference
    // with itself.
    #[cfg(target_arch = "x86_64")]
    assert!(
        has_avx2_f16c(),
        "this x86_64 CPU lacks AVX2/F16C: the SIMD kernels are untested"
    );
}

#[test]
fn simd_matches_reference_bitwise_on_random_blocks() {
    let mut r = Rng(0x5eed);
    for ty in QType::ALL {
        let mut finite = 0;
        for trial in 0..300 {
            let n = 1 + r.below(9);
            let extreme = trial % 2 == 1;
            let w = weights(&mut r, ty, n, extreme);
            let a = acts(&mut r, ty, n, extreme);
            let fast = vec_dot(ty, &w, &a).unwrap();
            let slow = vec_dot_ref(ty, &w, &a).unwrap();
            assert!(same(fast, slow), "{ty} trial {trial}: {fast:e} vs {slow:e}");
            finite += fast.is_finite() as usize;
        }
        // Most trials must be ordinary finite sums, so the comparison means something.
        assert!(finite > 150, "{ty}: only {finite} finite results");
    }
}

#[test]
fn simd_matches_reference_on_every_byte_pattern() {
    // Every block byte (hence every nibble pair, every fifth/sixth-bit pattern, every
    // 6-bit scale code) set to each of the 256 values in turn, against the extreme
    // activations +127 and -128.
    let mut r = Rng(42);
    for ty in QType::ALL {
        for byte in 0..=255u8 {
            for fill in [127i8, -128, -1] {
                let n = 2;
                let mut w = vec![byte; n * ty.block_bytes()];
                // Keep the scales finite and ordinary so the sums are compared as numbers.
                let scale = f32_to_f16(0.25).to_le_bytes();
                let fields: &[usize] = match ty {
                    QType::Q6K => &[208],
                    QType::Q4_0 | QType::Q5_0 | QType::Q8_0 => &[0],
                    _ => &[0, 2],
                };
                for b in w.chunks_exact_mut(ty.block_bytes()) {
                    for &at in fields {
                        b[at..at + 2].copy_from_slice(&scale);
                    }
                }
                let mut a = acts(&mut r, ty, n, false);
                match &mut a {
                    QuantizedActs::Q8_0(v) => v.iter_mut().for_each(|b| b.qs = [fill; QK]),
                    QuantizedActs::Q8_1(v) => v.iter_mut().for_each(|b| b.qs = [fill; QK]),
                    QuantizedActs::Q8K(v) => v.iter_mut().for_each(|b| b.qs = [fill; QK_K]),
                }
                let fast = vec_dot(ty, &w, &a).unwrap();
                let slow = vec_dot_ref(ty, &w, &a).unwrap();
                assert!(fast.is_finite(), "{ty} byte {byte:#04x}");
                assert_eq!(
                    fast.to_bits(),
                    slow.to_bits(),
                    "{ty} byte {byte:#04x} act {fill}"
                );
            }
        }
    }
}

#[test]
fn reference_by_hand_q4_0() {
    // d_w = 0.5, every weight nibble 0x9 (q - 8 = 1) ; d_a = 2, every a = 3:
    // 32 elements * (0.5 * 1) * (2 * 3) = 96.
    let mut w = vec![0x99u8; 18];
    w[0..2].copy_from_slice(&f32_to_f16(0.5).to_le_bytes());
    let a = [BlockQ8_0 {
        d: f32_to_f16(2.0),
        qs: [3; QK],
    }];
    assert_eq!(vec_dot_q4_0_q8_0_ref(&w, &a).unwrap(), 96.0);
    assert_eq!(vec_dot_q4_0_q8_0(&w, &a).unwrap(), 96.0);
}

#[test]
fn reference_by_hand_block_sums_then_one_accumulator() {
    // The 32-element types' canonical order: each block's exact sum S, then one
    // accumulator, acc + d · S. Block 0: d = 32 · 32 = 1024, every w = a = 127, S =
    // 516128, d · S = 528515072 (exact: 16129 · 2^15). Block 1: d = 1, one product
    // 1 · 17. 528515072 + 17 lies between the f32 neighbours 528515072 and 528515104
    // (spacing 32 in [2^28, 2^29)), nearer the second. Eight lane accumulators reduced
    // by a tree (the order before) give 528515072: lane 0 rounds 66064384 + 17 to
    // 66064400 and the tree's last add is a tie that rounds to even.
    let block = |dw: f32, w: [i8; QK]| {
        let mut b = f32_to_f16(dw).to_le_bytes().to_vec();
        b.extend(w.iter().map(|&q| q as u8));
        b
    };
    let mut w = block(32.0, [127; QK]);
    w.extend(block(1.0, std::array::from_fn(|e| (e == 0) as i8)));
    let a = [
        BlockQ8_0 {
            d: f32_to_f16(32.0),
            qs: [127; QK],
        },
        BlockQ8_0 {
            d: f32_to_f16(1.0),
            qs: std::array::from_fn(|e| if e == 0 { 17 } else { 0 }),
        },
    ];
    assert_eq!(vec_dot_q8_0_q8_0_ref(&w, &a).unwrap(), 528515104.0);
    assert_eq!(vec_dot_q8_0_q8_0(&w, &a).unwrap(), 528515104.0);
}

#[test]
fn reference_by_hand_q4_k_mins() {
    // All scales and mins 1 (code 0x01 in every 6-bit field: bytes 0..8 = 1, bytes
    // 8..12 = 0x11), d = 1, dmin = 0.5, every nibble 2, every activation 1 with d_a = 1
    // and bsums 16: 256 * 2 - 0.5 * 8 * 32 = 512 - 128 = 384.
    let mut w = vec![0x22u8; 144];
    w[0..2].copy_from_slice(&f32_to_f16(1.0).to_le_bytes());
    w[2..4].copy_from_slice(&f32_to_f16(0.5).to_le_bytes());
    w[4..12].fill(1);
    w[12..16].fill(0x11);
    let a = [BlockQ8K {
        d: 1.0,
        qs: [1; QK_K],
        bsums: [16; 16],
    }];
    assert_eq!(vec_dot_q4_k_q8_k_ref(&w, &a).unwrap(), 384.0);
    assert_eq!(vec_dot_q4_k_q8_k(&w, &a).unwrap(), 384.0);
}

#[test]
fn length_and_kind_errors_are_returned_not_panics() {
    let a = quantize_q8_0(&[0.5; 64]).unwrap();
    assert_eq!(
        vec_dot_q4_0_q8_0(&[0; 35], &a),
        Err(QuantError::RowLength {
            ty: QType::Q4_0,
            bytes: 35,
            expected: 36
        })
    );
    assert!(vec_dot_q4_0_q8_0_ref(&[0; 37], &a).is_err());
    let acts = QuantizedActs::Q8_0(a);
    assert!(matches!(
        vec_dot(QType::Q4K, &[0; 144], &acts),
        Err(QuantError::ActKind { .. })
    ));
    let mut out = [0f32; 3];
    assert!(matches!(
        matvec(QType::Q4_0, &[0; 36 * 2], &acts, &mut out),
        Err(QuantError::MatrixShape { .. })
    ));
    assert_eq!(
        quantize_q8_k(&[0.0; 255]),
        Err(QuantError::NotBlockMultiple {
            len: 255,
            block: 256
        })
    );
    assert!(quantize_q8_1(&[0.0; 33]).is_err());
    // The messages name the problem.
    let msg = vec_dot_q6_k_q8_k(&[0; 3], &[]).unwrap_err().to_string();
    assert!(msg.contains("Q6_K") && msg.contains('3'), "{msg}");
}

#[test]
fn matvec_is_rowwise_vec_dot() {
    let mut r = Rng(9);
    // 128 activation blocks are the most a product keeps its widened scales for inline
    // (`ActScales`); 129 take the allocating path.
    #[cfg(target_arch = "x86_64")]
    assert_eq!(super::avx2::STACK_SCALES, 128);
    for (rows, nb) in [(13, 3), (5, 128), (5, 129)] {
        for ty in QType::ALL {
            let w = weights(&mut r, ty, rows * nb, false);
            let a = acts(&mut r, ty, nb, false);
            let mut fast = vec![0f32; rows];
            let mut slow = vec![0f32; rows];
            matvec(ty, &w, &a, &mut fast).unwrap();
            matvec_ref(ty, &w, &a, &mut slow).unwrap();
            for (i, row) in w.chunks_exact(nb * ty.block_bytes()).enumerate() {
                let want = vec_dot_ref(ty, row, &a).unwrap();
                assert_eq!(fast[i].to_bits(), want.to_bits(), "{ty} nb {nb} row {i}");
                assert_eq!(slow[i].to_bits(), want.to_bits(), "{ty} nb {nb} row {i}");
            }
        }
    }
}

#[test]
fn pooled_matvec_is_bit_identical_for_any_thread_count() {
    let mut r = Rng(31);
    let mut pools: Vec<crate::pool::Pool> = (1..=5).map(crate::pool::Pool::new).collect();
    for ty in QType::ALL {
        // 37 rows: parts of unequal length for every thread count.
        let (rows, nb) = (37, 2);
        let w = weights(&mut r, ty, rows * nb, false);
        let a = acts(&mut r, ty, nb, false);
        let mut want = vec![0f32; rows];
        matvec_ref(ty, &w, &a, &mut want).unwrap();
        for pool in &mut pools {
            let mut got = vec![f32::NAN; rows];
            matvec_pool(pool, ty, &w, &a, &mut got).unwrap();
            let same = got
                .iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits());
            assert!(same, "{ty}, {} threads", pool.threads());
        }
    }
    // Shape errors come back from the pooled product too.
    let a = acts(&mut r, QType::Q4_0, 1, false);
    assert!(matvec_pool(&mut pools[2], QType::Q4_0, &[0; 19], &a, &mut [0.0; 1]).is_err());
}

#[test]
fn threaded_matvec_is_bit_identical_for_any_thread_count() {
    // Large enough (rows × cols >= 65,536) that 2 or more threads really split it.
    let mut r = Rng(37);
    for ty in [QType::Q4_1, QType::Q8_0, QType::Q6K] {
        let nb = 1024 / ty.block_elems();
        let rows = 77;
        let w = weights(&mut r, ty, rows * nb, false);
        let a = acts(&mut r, ty, nb, false);
        let mut want = vec![0f32; rows];
        matvec_ref(ty, &w, &a, &mut want).unwrap();
        for th in [1usize, 2, 3, 8] {
            let mut got = vec![f32::NAN; rows];
            matvec_threads(ty, &w, &a, &mut got, crate::Threads::new(th)).unwrap();
            let same = got
                .iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits());
            assert!(same, "{ty}, {th} threads");
        }
    }
    let a = acts(&mut r, QType::Q4_0, 1, false);
    let e = matvec_threads(
        QType::Q4_0,
        &[0; 19],
        &a,
        &mut [0.0; 1],
        crate::Threads::new(2),
    );
    assert!(e.is_err());
}

#[test]
fn multi_token_matmul_is_matvec_per_token_bitwise() {
    // Every type, token counts that exercise the 2-token tiles, the odd edge and the
    // token-transposed tiles (16 and 32 tokens, and the tokens after them), rows that
    // leave a 4-row remainder, 1 to 3 threads, big enough to really split.
    let mut r = Rng(41);
    for ty in QType::ALL {
        let nb = 2048 / ty.block_elems();
        let rows = 39;
        let w = weights(&mut r, ty, rows * nb, false);
        for n in [1usize, 2, 3, 5, 8, 12, 17, 24, 31, 35] {
            let acts: Vec<QuantizedActs> = (0..n).map(|_| acts(&mut r, ty, nb, false)).collect();
            let mut want = vec![0f32; n * rows];
            for (a, o) in acts.iter().zip(want.chunks_exact_mut(rows)) {
                matvec_ref(ty, &w, a, o).unwrap();
            }
            for th in [1usize, 2, 3] {
                let mut got = vec![f32::NAN; n * rows];
                matmul_threads(ty, &w, &acts, &mut got, crate::Threads::new(th)).unwrap();
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits());
                assert!(same, "{ty}, {n} tokens, {th} threads");
                // Each token's outputs in a buffer of its own: the same bits.
                let mut own: Vec<Vec<f32>> = (0..n).map(|_| vec![f32::NAN; rows]).collect();
                let mut slices: Vec<&mut [f32]> = own.iter_mut().map(|o| &mut o[..]).collect();
                let th = crate::Threads::new(th);
                matmul_threads_into(ty, &w, &acts, &mut slices, th).unwrap();
                let same = own
                    .iter()
                    .flatten()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits());
                assert!(same, "{ty}, {n} tokens, {th:?}, one buffer per token");
            }
        }
    }
    // Rows of zero blocks: every output is the empty sum, +0.0, as `matvec_ref` gives
    // (the multi-token product used to leave `out` unwritten).
    for ty in QType::ALL {
        for n in [1usize, 3, 17] {
            let xs: Vec<QuantizedActs> = (0..n)
                .map(|_| quantize_activation(ty, &[]).unwrap())
                .collect();
            let mut want = vec![f32::NAN; 3];
            matvec_ref(ty, &[], &xs[0], &mut want).unwrap();
            assert!(want.iter().all(|v| v.to_bits() == 0), "{ty}: {want:?}");
            for th in [1usize, 2] {
                let mut got = vec![f32::NAN; 3 * n];
                matmul_threads(ty, &[], &xs, &mut got, crate::Threads::new(th)).unwrap();
                assert!(got.iter().all(|v| v.to_bits() == 0), "{ty}, {n}: {got:?}");
            }
        }
    }
    // Bad shapes are errors, not panics.
    let a = acts(&mut r, QType::Q4_1, 2, false);
    let b = acts(&mut r, QType::Q4_1, 1, false);
    let w = weights(&mut r, QType::Q4_1, 2 * 2, false);
    let th = crate::Threads::new(2);
    assert!(matmul_threads(QType::Q4_1, &w, &[], &mut [0.0; 2], th).is_err());
    assert!(matmul_threads(QType::Q4_1, &w, &[a.clone(), b], &mut [0.0; 4], th).is_err());
    assert!(matmul_threads(QType::Q4_1, &w, std::slice::from_ref(&a), &mut [0.0; 3], th).is_err());
    assert!(matmul_threads(QType::Q4_0, &w, std::slice::from_ref(&a), &mut [0.0; 2], th).is_err());
    // One buffer per token: as many as tokens, all of one length.
    let two = [a.clone(), a.clone()];
    let (mut o1, mut o2) = ([7f32; 2], [7f32; 3]);
    let r = matmul_threads_into(QType::Q4_1, &w, &two, &mut [&mut o1[..], &mut o2[..]], th);
    assert!(r.is_err() && o1 == [7.0; 2] && o2 == [7.0; 3]);
    assert!(matmul_threads_into(QType::Q4_1, &w, &two, &mut [&mut o1[..]], th).is_err());
    assert!(
        matmul_threads_into(QType::Q4_1, &w, &two, &mut [&mut o1[..], &mut o2[..2]], th).is_ok()
    );
}

/// The multi-token K-quant kernels, both widths (four tokens with AVX2, eight with the
/// 32 registers of AVX-512VL), give every (row, token) the reference's bits for token
/// counts around both block sizes.
#[cfg(target_arch = "x86_64")]
#[fak_testkit::cpu("avx2", "f16c")]
fn k_quant_token_blocks_are_the_one_token_dot_bitwise() {
    assert!(has_avx2_f16c(), "this CPU lacks AVX2/F16C");
    let mut r = Rng(43);
    for ty in [QType::Q4K, QType::Q5K, QType::Q6K] {
        let kind = k_quant(ty).unwrap();
        let nb = 1024 / ty.block_elems();
        let rows = 7;
        let rb = nb * ty.block_bytes();
        let w = weights(&mut r, ty, rows * nb, false);
        for n in 1..=17 {
            let acts: Vec<QuantizedActs> = (0..n).map(|_| acts(&mut r, ty, nb, false)).collect();
            let mut want = vec![0f32; n * rows];
            for (a, o) in acts.iter().zip(want.chunks_exact_mut(rows)) {
                matvec_ref(ty, &w, a, o).unwrap();
            }
            let blocks: Vec<&[BlockQ8K]> = acts
                .iter()
                .map(|a| match a {
                    QuantizedActs::Q8K(b) => &b[..],
                    _ => unreachable!("K-quant activations are Q8_K"),
                })
                .collect();
            let mut got = vec![f32::NAN; n * rows];
            let mut by_token: Vec<&mut [f32]> = got.chunks_mut(rows).collect();
            // SAFETY: AVX2 and F16C were detected; the shapes match.
            unsafe { avx2::k_tokens(&w, rb, &blocks, kind, &mut by_token) };
            let same = |g: &[f32]| g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same(&got), "{ty}, {n} tokens, 4 at a time");
            if has_avx512_bw_vl() {
                got.fill(f32::NAN);
                let mut by_token: Vec<&mut [f32]> = got.chunks_mut(rows).collect();
                // SAFETY: as above, and AVX-512F/BW/VL were detected.
                unsafe { avx2::k_tokens_wide(&w, rb, &blocks, kind, &mut by_token) };
                assert!(same(&got), "{ty}, {n} tokens, 8 at a time");
            }
        }
    }
}

// ------------------------------------------------------------------ quantizers

#[test]
fn q8_0_uses_roundf_ties_away_from_zero() {
    // amax = 127 gives d = 1 exactly, so x * (1/d) = x: 2.5 -> 3 and -0.5 -> -1
    // (ties away from zero, C's roundf), where ties-to-even would give 2 and 0.
    let mut x = [0f32; 32];
    x[0] = 127.0;
    x[1] = 2.5;
    x[2] = -0.5;
    x[3] = 1.4;
    let b = quantize_q8_0(&x).unwrap();
    assert_eq!(f16_to_f32(b[0].d), 1.0);
    assert_eq!(&b[0].qs[..4], &[127, 3, -1, 1]);
    // An all-zero block: d = 0, zero quants.
    let z = quantize_q8_0(&[0.0; 32]).unwrap();
    assert_eq!(z[0], BlockQ8_0 { d: 0, qs: [0; 32] });
}

#[test]
fn q8_1_sum_uses_unrounded_scale() {
    let mut r = Rng(3);
    let x: Vec<f32> = (0..96).map(|_| r.unit() * 3.0).collect();
    let b1 = quantize_q8_1(&x).unwrap();
    let b0 = quantize_q8_0(&x).unwrap();
    for ((q1, q0), c) in b1.iter().zip(&b0).zip(x.chunks_exact(32)) {
        assert_eq!((q1.d, q1.qs), (q0.d, q0.qs));
        let d = c_amax(c) / 127.0;
        let sum: i32 = q1.qs.iter().map(|&q| q as i32).sum();
        assert_eq!(q1.s, f32_to_f16(sum as f32 * d));
        assert!(q1.qs.iter().all(|&q| q != -128));
    }
}

#[test]
fn block_quant_sums_are_exact() {
    // The vector sum against the scalar one: random blocks, and the extremes (all -128,
    // all 127, alternating), where a wrong bias or a lost group would show.
    let mut r = Rng(5);
    let mut blocks: Vec<[i8; 32]> = (0..200)
        .map(|_| std::array::from_fn(|_| (r.next() >> 8) as u8 as i8))
        .collect();
    blocks.push([-128; 32]);
    blocks.push([127; 32]);
    blocks.push(std::array::from_fn(|i| if i % 2 == 0 { -128 } else { 127 }));
    #[cfg(target_arch = "x86_64")]
    if has_avx2_f16c() {
        for qs in &blocks {
            let want: i32 = qs.iter().map(|&q| q as i32).sum();
            // SAFETY: AVX2 was detected.
            assert_eq!(unsafe { super::avx2::sum_quants(qs) }, want, "{qs:?}");
        }
    }
}

#[test]
fn q8_k_by_hand() {
    // max = -127 (largest magnitude, negative): iscale = 1, d = 1; nearest_int rounds
    // ties to even: 2.5 -> 2, 3.5 -> 4, -0.5 -> -0.
    let mut x = [0f32; 256];
    x[0] = -127.0;
    x[1] = 2.5;
    x[2] = 3.5;
    x[3] = -0.5;
    x[17] = 5.0;
    let b = quantize_q8_k(&x).unwrap();
    assert_eq!(b[0].d, 1.0);
    assert_eq!(&b[0].qs[..4], &[-127, 2, 4, 0]);
    assert_eq!(b[0].bsums[0], -127 + 2 + 4);
    assert_eq!(b[0].bsums[1], 5);
    // A positive max gives a negative d and negated quants, as in ggml.
    x[0] = 127.0;
    let b = quantize_q8_k(&x).unwrap();
    assert_eq!(b[0].d, -1.0);
    assert_eq!(&b[0].qs[..3], &[-127, -2, -4]);
    // All zero: d = 0, zero quants and sums.
    let z = quantize_q8_k(&[0.0; 256]).unwrap();
    assert_eq!((z[0].d, z[0].qs, z[0].bsums), (0.0, [0; 256], [0; 16]));
}

#[test]
fn quantizers_reconstruct_within_half_a_step() {
    let mut r = Rng(77);
    let x: Vec<f32> = (0..512).map(|_| r.unit() * 4.0).collect();
    for (b, c) in quantize_q8_0(&x).unwrap().iter().zip(x.chunks_exact(32)) {
        let d = c_amax(c) / 127.0;
        for (&q, &v) in b.qs.iter().zip(c) {
            assert!((q as f32 * d - v).abs() <= 0.5 * d * (1.0 + 1e-5));
        }
    }
    for (b, c) in quantize_q8_k(&x).unwrap().iter().zip(x.chunks_exact(256)) {
        for (&q, &v) in b.qs.iter().zip(c) {
            assert!((q as f32 * b.d - v).abs() <= 0.5 * b.d.abs() * (1.0 + 1e-5));
        }
    }
}

// ------------------------------------------------------------------ f16

#[test]
fn f16_round_trips_every_value() {
    for h in 0..=u16::MAX {
        let x = f16_to_f32(h);
        if x.is_nan() {
            assert!(f16_to_f32(f32_to_f16(x)).is_nan(), "{h:#06x}");
        } else {
            assert_eq!(f32_to_f16(x), h, "{h:#06x}");
        }
    }
}

#[test]
fn f16_rounding_matches_half_crate() {
    // Every midpoint between adjacent f16 values (ties to even), its neighbours one f32
    // ulp away, and random f32 bit patterns, against the `half` crate's conversion.
    let check = |x: f32| {
        let ours = f32_to_f16(x);
        let theirs = half::f16::from_f32(x).to_bits();
        if x.is_nan() {
            assert!(f16_to_f32(ours).is_nan());
        } else {
            assert_eq!(ours, theirs, "{x:e} ({:#010x})", x.to_bits());
        }
    };
    for h in 0..0x7bffu16 {
        let (a, b) = (f16_to_f32(h) as f64, f16_to_f32(h + 1) as f64);
        let mid = ((a + b) / 2.0) as f32; // exact: f16 midpoints fit in f32
        for x in [
            mid,
            f32::from_bits(mid.to_bits() + 1),
            f32::from_bits(mid.to_bits().wrapping_sub(1)),
        ] {
            check(x);
            check(-x);
        }
    }
    for x in [
        65504.0f32,
        65519.99,
        65520.0,
        1e6,
        f32::INFINITY,
        1e-8,
        2.98e-8,
        3e-8,
    ] {
        check(x);
        check(-x);
    }
    let mut r = Rng(1);
    for _ in 0..200_000 {
        check(f32::from_bits((r.next() << 8 ^ r.next()) as u32));
    }
}

#[test]
fn avx512_vnni_and_avx2_lane_sums_give_the_same_bits() {
    // The 256-bit kernels (with and without VNNI) and the 512-bit row pairs against the
    // reference, random and extreme blocks, a row count (15) that runs an 8-row group, a
    // 4-row group and a remainder of 3.
    let mut r = Rng(41);
    for ty in [
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
    ] {
        for extreme in [false, true] {
            let (rows, nb) = (15, 5);
            let w = weights(&mut r, ty, rows * nb, extreme);
            let a = acts(&mut r, ty, nb, extreme);
            let mut want = vec![0f32; rows];
            matvec_ref(ty, &w, &a, &mut want).unwrap();
            for (vnni, zmm) in [(false, false), (true, false), (false, true), (true, true)] {
                let mut got = vec![f32::NAN; rows];
                super::matvec_isa(ty, &w, &a, &mut got, true, vnni, zmm).unwrap();
                let ok = got.iter().zip(&want).all(|(&g, &w)| same(g, w));
                assert!(
                    ok,
                    "{ty} extreme={extreme} vnni={vnni} zmm={zmm}: {got:?} vs {want:?}"
                );
            }
        }
    }
}

/// Every tile kernel (those the CPU lacks fall back to the best it has).
const TILE_ISAS: [super::TileIsa; 4] = [
    super::TileIsa::Avx2,
    super::TileIsa::Vnni,
    super::TileIsa::Vnni512,
    super::TileIsa::Zmm,
];

#[test]
fn every_multi_token_tile_kernel_gives_the_reference_bits() {
    // 9 rows and 37 tokens: full TILE_R × TILE_T tiles (2 × 4), the token-transposed
    // 2-row × 16-token tiles (two groups; for the K-quants too) and a padded pair tile
    // after them, the 1-row / 1-token edges and the tokens after the full tiles (the
    // K-quants' 4- and 8-token kernels); random and extreme blocks.
    let mut r = Rng(53);
    for ty in QType::ALL {
        for extreme in [false, true] {
            let (rows, nb, n) = (9, 3, 37);
            let w = weights(&mut r, ty, rows * nb, extreme);
            let xs: Vec<QuantizedActs> = (0..n).map(|_| acts(&mut r, ty, nb, extreme)).collect();
            let mut want = vec![0f32; n * rows];
            for (t, a) in xs.iter().enumerate() {
                matvec_ref(ty, &w, a, &mut want[t * rows..(t + 1) * rows]).unwrap();
            }
            for isa in TILE_ISAS {
                let mut got = vec![f32::NAN; n * rows];
                let rb = w.len() / rows;
                super::matmul_rows_isa(ty, &w, rb, &xs, &mut got, isa).unwrap();
                let ok = got.iter().zip(&want).all(|(&g, &w)| same(g, w));
                assert!(ok, "{ty} extreme={extreme} {isa:?}");
            }
        }
    }
}

/// The token-transposed tiles, bit for bit against the reference for every token count
/// from 1 to 31: the 16-token groups, the 8-token groups (pair tiles), the last 8-token
/// group padded with dummy tokens (whose results must not be stored: `got` has no room
/// for them), and the tokens left to the other tiles; 7, 11, 12 and 13 rows (2-row
/// tiles and a 1-row edge; pair tiles of 4, 2 and 1 pairs, with and without a last pair
/// whose second row is past the matrix), random and extreme blocks, every 32-element
/// type.
#[cfg(target_arch = "x86_64")]
#[fak_testkit::cpu(
    "avx2",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512vnni"
)]
fn token_transposed_tiles_give_the_reference_bits_for_1_to_31_tokens() {
    let mut r = Rng(61);
    for ty in [
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
    ] {
        // 7 rows: one 4-pair tile with a dummy row; 11: 4 and 2 pairs, the second with a
        // dummy row; 12: a 4-pair and a 2-pair tile; 13: 4, 2 and 1 pairs, the last with a
        // dummy row.
        for (extreme, rows) in [(false, 7), (true, 7), (true, 11), (false, 12), (true, 13)] {
            let (nb, most) = (3, 31);
            let w = weights(&mut r, ty, rows * nb, extreme);
            let rb = w.len() / rows;
            let xs: Vec<QuantizedActs> = (0..most).map(|_| acts(&mut r, ty, nb, extreme)).collect();
            let mut want = vec![0f32; most * rows];
            for (t, a) in xs.iter().enumerate() {
                matvec_ref(ty, &w, a, &mut want[t * rows..(t + 1) * rows]).unwrap();
            }
            for n in 1..=most {
                let mut got = vec![f32::NAN; n * rows];
                super::matmul_rows_isa(ty, &w, rb, &xs[..n], &mut got, super::TileIsa::Zmm)
                    .unwrap();
                let bad = got.iter().zip(&want).position(|(&g, &w)| !same(g, w));
                assert!(
                    bad.is_none(),
                    "{ty} extreme={extreme} {n} tokens: token {}, row {}",
                    bad.unwrap_or(0) / rows,
                    bad.unwrap_or(0) % rows
                );
            }
        }
    }
    // The tokens the transposed tiles take: none of fewer than 5 (3 on a Zen 4), else
    // all but those left after the 16-token groups and the full 8-token groups when
    // fewer than 3 (so 5 to 7, 11 to 15, 19 to 23 and 27 to 31 tokens run a padded
    // 8-token group). The vocabulary matrix in row pairs: none of 1, else all but 1 left.
    let min = super::transposed::min_tokens();
    assert!(
        min == 5 || (min == 3 && crate::cpu::amd_family_25()),
        "{min}"
    );
    let blocks = [BlockQ8_1 {
        d: 0,
        s: 0,
        qs: [0; QK],
    }; 2];
    let blocks0 = [BlockQ8_0 { d: 0, qs: [0; QK] }; 2];
    for n in 1..=40 {
        let a: Vec<&[BlockQ8_1]> = vec![&blocks[..]; n];
        // SAFETY: the CPU has AVX2 and F16C (this test's features).
        let tt = unsafe { super::transposed::Acts::new::<super::avx2::Q4_1>(&a) };
        let want = match n {
            _ if n < min => 0,
            _ => n - if n % 8 < 3 { n % 8 } else { 0 },
        };
        assert_eq!(tt.map_or(0, |t| t.tokens()), want, "{n} tokens");
        let a: Vec<&[BlockQ8_0]> = vec![&blocks0[..]; n];
        // SAFETY: as above.
        let tt = unsafe { super::transposed::Acts::new_r2(&a) };
        let want = n - if n % 8 < 2 { n % 8 } else { 0 };
        assert_eq!(tt.map_or(0, |t| t.tokens()), want, "row pairs, {n} tokens");
    }
}

#[test]
fn pooled_matvec_in_ranges_is_bit_identical() {
    // 509 rows: one range per thread, a multiple of 4 rows each, the last one short
    // (1 to 6 threads, 4 rows for each of 200 threads, more threads than ranges).
    let mut r = Rng(43);
    let mut pools: Vec<crate::pool::Pool> = (1..=6).map(crate::pool::Pool::new).collect();
    pools.push(crate::pool::Pool::new(200));
    for ty in [QType::Q4_1, QType::Q8_0, QType::Q4K] {
        let nb = 2048 / ty.block_elems();
        let rows = 509;
        let w = weights(&mut r, ty, rows * nb, false);
        let a = acts(&mut r, ty, nb, false);
        let mut want = vec![0f32; rows];
        matvec_ref(ty, &w, &a, &mut want).unwrap();
        for pool in &mut pools {
            let per = super::matvec_range_rows(rows, pool.threads(), ty.row_group());
            assert!(
                per.is_multiple_of(4) && per * pool.threads() >= rows && !rows.is_multiple_of(per)
            );
            let mut got = vec![f32::NAN; rows];
            matvec_pool(pool, ty, &w, &a, &mut got).unwrap();
            let ok = got
                .iter()
                .zip(&want)
                .all(|(&g, &w)| g.to_bits() == w.to_bits());
            assert!(ok, "{ty}, {} threads", pool.threads());
        }
    }
}

#[test]
fn matmul_many_is_each_matmul_bitwise() {
    let mut r = Rng(53);
    // (type, rows, blocks a row): the repacked Q4_1 and Q8_0 of the AVX-512 VNNI path
    // too (their rows in groups of 16), with uneven row counts elsewhere.
    let mut shapes = vec![
        (QType::Q4_1, 300, 16),
        (QType::Q8_0, 77, 8),
        (QType::Q4K, 41, 2),
        (QType::Q6K, 130, 1),
    ];
    if has_avx512_vnni() {
        shapes.push((QType::Q4_1R16, 48, 18));
        shapes.push((QType::Q8_0R16, 32, 18));
    }
    let file_ty = |ty: QType| match ty {
        QType::Q4_1R16 => QType::Q4_1,
        QType::Q8_0R16 => QType::Q8_0,
        t => t,
    };
    for n in [2usize, 3, 8, 16, 17] {
        // Each product's file weights (the reference reads them) and its own layout.
        let mut file_ws = Vec::new();
        let mut ws = Vec::new();
        let mut xs = Vec::new();
        for &(ty, rows, nb) in &shapes {
            let f = weights(&mut r, file_ty(ty), rows * nb, false);
            let cols = nb * ty.block_elems();
            ws.push(match ty {
                QType::Q4_1R16 => repack_q4_1_r16(&f, rows, cols).unwrap(),
                QType::Q8_0R16 => repack_q8_0_r16(&f, rows, cols).unwrap(),
                _ => f.clone(),
            });
            file_ws.push(f);
            xs.push(
                (0..n)
                    .map(|_| acts(&mut r, file_ty(ty), nb, false))
                    .collect::<Vec<_>>(),
            );
        }
        let want: Vec<Vec<f32>> = shapes
            .iter()
            .zip(file_ws.iter().zip(&xs))
            .map(|(&(ty, rows, _), (w, a))| {
                let mut o = vec![0f32; n * rows];
                for (t, at) in a.iter().enumerate() {
                    matvec_ref(file_ty(ty), w, at, &mut o[t * rows..(t + 1) * rows]).unwrap();
                }
                o
            })
            .collect();
        // Four at a time (one hand-off holds four), then all of them (one each).
        for group in [&shapes[..4], &shapes[..]] {
            for threads in [1, 2, 3] {
                let mut outs: Vec<Vec<f32>> =
                    group.iter().map(|s| vec![f32::NAN; n * s.1]).collect();
                let mut products: Vec<Matmul<'_>> = group
                    .iter()
                    .zip(ws.iter().zip(&xs))
                    .zip(outs.iter_mut())
                    .map(|((&(ty, _, _), (w, acts)), out)| Matmul { ty, w, acts, out })
                    .collect();
                matmul_many(&mut products, crate::Threads::new(threads)).unwrap();
                drop(products);
                for ((o, w), s) in outs.iter().zip(&want).zip(group) {
                    let ok = o.iter().zip(w).all(|(&g, &w)| g.to_bits() == w.to_bits());
                    assert!(ok, "{}, {n} tokens, {threads} threads", s.0);
                }
            }
        }
    }
    // Products of different numbers of tokens, or a shape error in any product: an
    // error, and no output written.
    let w = weights(&mut r, QType::Q4_1, 8 * 2, false);
    let a2: Vec<_> = (0..2)
        .map(|_| acts(&mut r, QType::Q4_1, 2, false))
        .collect();
    let a3: Vec<_> = (0..3)
        .map(|_| acts(&mut r, QType::Q4_1, 2, false))
        .collect();
    let (mut o1, mut o2, mut o3) = (vec![f32::NAN; 16], vec![f32::NAN; 24], vec![f32::NAN; 14]);
    fn q4_1<'a>(w: &'a [u8], acts: &'a [QuantizedActs], out: &'a mut [f32]) -> Matmul<'a> {
        let ty = QType::Q4_1;
        Matmul { ty, w, acts, out }
    }
    // Two and three tokens; then two tokens but 7 rows of outputs for 8 of weights.
    let mut products = [q4_1(&w, &a2, &mut o1), q4_1(&w, &a3, &mut o2)];
    assert!(matmul_many(&mut products, crate::Threads::new(2)).is_err());
    let mut products = [q4_1(&w, &a2, &mut o1), q4_1(&w, &a2, &mut o3)];
    assert!(matmul_many(&mut products, crate::Threads::new(2)).is_err());
    assert!(
        o1.iter().chain(&o2).chain(&o3).all(|v| v.is_nan()),
        "an output was written"
    );
}

#[test]
fn matvec_many_is_each_matvec_bitwise() {
    let mut r = Rng(47);
    // Six products: more than one hand-off holds (`CHUNKED_PRODUCTS`), so the list is
    // run in two.
    let shapes = [
        (QType::Q4_1, 300, 16),
        (QType::Q8_0, 77, 16),
        (QType::Q6K, 130, 2),
        (QType::Q4_0, 64, 4),
        (QType::Q5_1, 9, 3),
        (QType::Q4K, 41, 1),
    ];
    let ws: Vec<Vec<u8>> = shapes
        .iter()
        .map(|&(ty, rows, nb)| weights(&mut r, ty, rows * nb, false))
        .collect();
    let xs: Vec<QuantizedActs> = shapes
        .iter()
        .map(|&(ty, _, nb)| acts(&mut r, ty, nb, false))
        .collect();
    let want: Vec<Vec<f32>> = shapes
        .iter()
        .zip(ws.iter().zip(&xs))
        .map(|(&(ty, rows, _), (w, a))| {
            let mut o = vec![0f32; rows];
            matvec_ref(ty, w, a, &mut o).unwrap();
            o
        })
        .collect();
    for threads in [1, 2, 3] {
        let mut outs: Vec<Vec<f32>> = shapes.iter().map(|s| vec![f32::NAN; s.1]).collect();
        let mut products: Vec<Matvec<'_>> = shapes
            .iter()
            .zip(ws.iter().zip(&xs))
            .zip(outs.iter_mut())
            .map(|((&(ty, _, _), (w, act)), out)| Matvec { ty, w, act, out })
            .collect();
        matvec_many(&mut products, crate::Threads::new(threads)).unwrap();
        drop(products);
        for ((o, w), s) in outs.iter().zip(&want).zip(&shapes) {
            let ok = o.iter().zip(w).all(|(&g, &w)| g.to_bits() == w.to_bits());
            assert!(ok, "{}, {threads} threads", s.0);
        }
    }
    // A shape error in any product is returned and nothing is computed.
    let mut bad = vec![0f32; 3];
    let mut products = vec![Matvec {
        ty: QType::Q4_1,
        w: &ws[0][..20],
        act: &xs[0],
        out: &mut bad,
    }];
    assert!(matvec_many(&mut products, crate::Threads::new(2)).is_err());
    // ... also when it is the last of six: the first hand-off's outputs stay unwritten.
    let mut outs: Vec<Vec<f32>> = shapes.iter().map(|s| vec![f32::NAN; s.1]).collect();
    outs[5] = vec![f32::NAN; 40];
    let mut products: Vec<Matvec<'_>> = shapes
        .iter()
        .zip(ws.iter().zip(&xs))
        .zip(outs.iter_mut())
        .map(|((&(ty, _, _), (w, act)), out)| Matvec { ty, w, act, out })
        .collect();
    assert!(matvec_many(&mut products, crate::Threads::new(2)).is_err());
    drop(products);
    assert!(
        outs.iter().flatten().all(|v| v.is_nan()),
        "an output was written"
    );
}

#[test]
fn quantizing_into_a_kept_buffer_gives_the_same_blocks() {
    let mut r = Rng(53);
    // One buffer reused across kinds and lengths: longer, shorter, another kind.
    let mut kept = quantize_activation(QType::Q4K, &vec![1.0; 1024]).unwrap();
    for (ty, n) in [
        (QType::Q4_1, 96),
        (QType::Q4_1, 32),
        (QType::Q8_0, 256),
        (QType::Q6K, 512),
        (QType::Q6K, 256),
        (QType::Q5_0, 64),
    ] {
        let x: Vec<f32> = (0..n).map(|_| r.unit() * 3.0).collect();
        quantize_activation_into(ty, &x, &mut kept).unwrap();
        assert_eq!(
            kept,
            quantize_activation(ty, &x).unwrap(),
            "{ty}, {n} values"
        );
    }
    // An error leaves the buffer as it was.
    let before = kept.clone();
    assert!(quantize_activation_into(QType::Q5_0, &[1.0; 33], &mut kept).is_err());
    assert_eq!(kept, before);
}

#[test]
fn vector_activation_quantizer_matches_the_scalar_one() {
    // Random blocks of several magnitudes, and blocks built so `x * id` lands exactly
    // on halves (amax 127: d = 1, id = 1), next to them, and on the saturation edge;
    // non-finite blocks fall back to the scalar code and must agree too.
    let mut r = Rng(59);
    let mut blocks: Vec<[f32; QK]> = Vec::new();
    for scale in [1e-30f32, 1e-6, 1.0, 3.7, 1e4, 1e30] {
        for _ in 0..2000 {
            blocks.push(std::array::from_fn(|_| r.unit() * scale));
        }
    }
    let halves: Vec<f32> = (0..127).map(|k| k as f32 + 0.5).collect();
    for chunk in halves.chunks(31) {
        for sign in [1f32, -1.0] {
            let mut b = [0f32; QK];
            b[0] = 127.0 * sign;
            for (i, &h) in chunk.iter().enumerate() {
                b[1 + i] = if i % 2 == 0 { h * sign } else { -h * sign };
            }
            blocks.push(b);
            blocks.push(b.map(|v| f32::from_bits(v.to_bits().wrapping_sub(1))));
            blocks.push(b.map(|v| f32::from_bits(v.to_bits() + 1)));
        }
    }
    blocks.push([0.0; QK]);
    blocks.push(std::array::from_fn(|i| if i == 5 { -0.0 } else { 0.0 }));
    blocks.push(std::array::from_fn(|i| (i as f32 - 16.0) * 1e-40)); // subnormals
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX] {
        blocks.push(std::array::from_fn(|i| if i == 7 { bad } else { i as f32 }));
    }
    let mut vector = 0;
    for b in &blocks {
        let (dr, qr) = super::q8_block_ref(b);
        #[cfg(target_arch = "x86_64")]
        if super::has_avx2_f16c() {
            // SAFETY: AVX2 and F16C were detected.
            if let Some((d, qs)) = unsafe { super::avx2::q8_block(b) } {
                assert!(
                    d.to_bits() == dr.to_bits() && qs == qr,
                    "{b:?}: {d} {qs:?} vs {dr} {qr:?}"
                );
                vector += 1;
            }
        }
        // The row quantizers (the vector ones where they run) against the reference.
        let d = f32_to_f16(dr);
        let sum: i32 = qr.iter().map(|&q| q as i32).sum();
        assert_eq!(
            quantize_q8_0(b).unwrap(),
            [BlockQ8_0 { d, qs: qr }],
            "{b:?}"
        );
        let s = f32_to_f16(sum as f32 * dr);
        assert_eq!(
            quantize_q8_1(b).unwrap(),
            [BlockQ8_1 { d, s, qs: qr }],
            "{b:?}"
        );
    }
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_f16c() {
        assert!(vector > 12_000, "the vector form ran for {vector} blocks");
    }
}

/// Every non-NaN `f32` through `f32_to_f16` against the F16C instruction (`vcvtps2ph`,
/// round to nearest even), the rounding the software conversion states it follows. On
/// two threads.
#[cfg(target_arch = "x86_64")]
#[fak_testkit::cpu("avx2", "f16c")]
fn f16c_rounds_as_f32_to_f16() {
    use std::arch::x86_64::*;
    assert!(has_avx2_f16c(), "this CPU lacks AVX2/F16C");
    /// # Safety
    /// F16C.
    #[target_feature(enable = "f16c")]
    unsafe fn f2h(x: f32) -> u16 {
        _mm_extract_epi16::<0>(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x))) as u16
    }
    let halves: [(u64, u64); 2] = [(0, 1 << 31), (1 << 31, 1 << 32)];
    let bad: Vec<Option<u32>> = std::thread::scope(|s| {
        let hs: Vec<_> = halves
            .iter()
            .map(|&(lo, hi)| {
                s.spawn(move || {
                    (lo..hi).map(|b| b as u32).find(|&b| {
                        let x = f32::from_bits(b);
                        // SAFETY: AVX2 and F16C were detected.
                        !x.is_nan() && f32_to_f16(x) != unsafe { f2h(x) }
                    })
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    if let Some(b) = bad.into_iter().flatten().next() {
        let x = f32::from_bits(b);
        // SAFETY: as above.
        let hw = unsafe { f2h(x) };
        panic!(
            "{x:e} ({b:#010x}): f32_to_f16 {:#06x}, vcvtps2ph {hw:#06x}",
            f32_to_f16(x)
        );
    }
}

#[test]
fn vector_q8_k_quantizer_matches_the_scalar_one() {
    // Random blocks of several magnitudes; blocks whose largest element is −127 (so
    // `iscale` is 1 and `x` lands exactly on halves, where ties go to even) and
    // next to them; the largest magnitude twice with both signs (the first one is
    // `max`); a largest element so small that `−127 / max` overflows; zero,
    // subnormal and non-finite blocks (the last two kinds fall back to the scalar
    // code and must agree too).
    let mut r = Rng(61);
    let mut blocks: Vec<Vec<f32>> = Vec::new();
    for scale in [1e-30f32, 1e-6, 1.0, 3.7, 1e4, 1e30] {
        for _ in 0..300 {
            blocks.push((0..QK_K).map(|_| r.unit() * scale).collect());
        }
    }
    for sign in [1f32, -1.0] {
        let mut b: Vec<f32> = (0..QK_K)
            .map(|i| ((i % 254) as f32 - 126.5) * sign)
            .collect();
        b[3] = -127.0 * sign;
        blocks.push(b.iter().map(|v| f32::from_bits(v.to_bits() + 1)).collect());
        blocks.push(
            b.iter()
                .map(|v| f32::from_bits(v.to_bits().wrapping_sub(1)))
                .collect(),
        );
        blocks.push(b);
        let mut two: Vec<f32> = (0..QK_K).map(|_| r.unit() * sign).collect();
        two[41] = 5.0 * sign;
        two[44] = -5.0 * sign;
        two[200] = -5.0 * sign;
        blocks.push(two);
    }
    blocks.push(
        (0..QK_K)
            .map(|i| if i == 9 { 1e-39 } else { 0.0 })
            .collect(),
    );
    blocks.push(vec![0.0; QK_K]);
    blocks.push((0..QK_K).map(|i| if i == 5 { -0.0 } else { 0.0 }).collect());
    blocks.push((0..QK_K).map(|i| (i as f32 - 128.0) * 1e-40).collect());
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX] {
        blocks.push(
            (0..QK_K)
                .map(|i| if i == 7 { bad } else { i as f32 })
                .collect(),
        );
    }
    let mut vector = 0;
    for b in &blocks {
        let got = quantize_q8_k(b).unwrap();
        let want = super::q8k_block_ref(b);
        assert!(
            got[0].d.to_bits() == want.d.to_bits()
                && got[0].qs == want.qs
                && got[0].bsums == want.bsums,
            "{b:?}: {:?} vs {want:?}",
            got[0]
        );
        #[cfg(target_arch = "x86_64")]
        if super::has_avx2_f16c() {
            let c: &[f32; QK_K] = b[..].try_into().unwrap();
            // SAFETY: AVX2 and F16C were detected.
            vector += usize::from(unsafe { super::avx2::q8k_block(c) }.is_some());
        }
    }
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_f16c() {
        assert!(vector > 1_800, "the vector form ran for {vector} blocks");
    }
}

/// Q8_0 quants drawn from the extremes (−128, −127, −1, 0, 1, 127) or, for a whole
/// block, one constant: the largest lane magnitudes `vpdpbusd` must carry exactly.
fn extreme_q8(r: &mut Rng) -> [i8; QK] {
    const V: [i8; 6] = [-128, -127, -1, 0, 1, 127];
    let mut q = [0i8; QK];
    match r.below(4) {
        0 => q.fill(-128),
        1 => q.fill(127),
        _ => q.iter_mut().for_each(|v| *v = V[r.below(V.len())]),
    }
    q
}

#[test]
fn q8_0_vnni_is_exact_on_extreme_quants() {
    // By hand: one block of −128 × −128 with unit scales is 32 · 16384 exactly.
    let one = f32_to_f16(1.0);
    let mut wb = vec![0u8; 34];
    wb[0..2].copy_from_slice(&one.to_le_bytes());
    wb[2..].fill(0x80);
    let a = QuantizedActs::Q8_0(vec![BlockQ8_0 {
        d: one,
        qs: [-128; QK],
    }]);
    for vnni in [false, true] {
        let mut got = [0f32; 1];
        super::matvec_isa(QType::Q8_0, &wb, &a, &mut got, true, vnni, false).unwrap();
        assert_eq!(got[0], 524288.0, "vnni={vnni}");
    }
    // Rows (4-row groups and the remainder) and tiles (2 × 4, the token-transposed
    // 16-token tiles, and the edges) against the reference, −128 in weights and
    // activations, ordinary and extreme scales.
    let mut r = Rng(59);
    for extreme in [false, true] {
        let (rows, nb, n) = (9, 4, 21);
        let mut w = weights(&mut r, QType::Q8_0, rows * nb, extreme);
        for b in w.chunks_exact_mut(34) {
            let q = extreme_q8(&mut r);
            b[2..].iter_mut().zip(q).for_each(|(d, s)| *d = s as u8);
        }
        let xs: Vec<QuantizedActs> = (0..n)
            .map(|_| {
                QuantizedActs::Q8_0(
                    (0..nb)
                        .map(|_| BlockQ8_0 {
                            d: some_f16(&mut r, extreme),
                            qs: extreme_q8(&mut r),
                        })
                        .collect(),
                )
            })
            .collect();
        let mut want = vec![0f32; n * rows];
        for (t, a) in xs.iter().enumerate() {
            matvec_ref(QType::Q8_0, &w, a, &mut want[t * rows..(t + 1) * rows]).unwrap();
        }
        for vnni in [false, true] {
            let mut got = vec![f32::NAN; n * rows];
            for (t, a) in xs.iter().enumerate() {
                let o = &mut got[t * rows..(t + 1) * rows];
                super::matvec_isa(QType::Q8_0, &w, a, o, true, vnni, false).unwrap();
            }
            let ok = got.iter().zip(&want).all(|(&g, &w)| same(g, w));
            assert!(
                ok,
                "rows, extreme={extreme} vnni={vnni}: {got:?} vs {want:?}"
            );
        }
        for isa in TILE_ISAS {
            let mut got = vec![f32::NAN; n * rows];
            super::matmul_rows_isa(QType::Q8_0, &w, w.len() / rows, &xs, &mut got, isa).unwrap();
            let ok = got.iter().zip(&want).all(|(&g, &w)| same(g, w));
            assert!(ok, "tiles, extreme={extreme} {isa:?}: {got:?} vs {want:?}");
        }
    }
}

/// The products over a matrix repacked at load (`packed`: its type and bytes, `rows`
/// rows) against the same products over the file's blocks (`file`): for the first 3 of
/// `xs`, one token (the fast kernel, and the scalar path) and every single row through
/// `dot_row`; then the first `n` of `xs` for each `n` in `ns` on 1 to 3 threads. All
/// must be the file's bits.
fn repacked_products_agree(
    (file_ty, w): (QType, &[u8]),
    (ty, packed): (QType, &[u8]),
    rows: usize,
    xs: &[QuantizedActs],
    ns: &[usize],
    dot_row: fn(&[u8], usize, &QuantizedActs) -> Result<f32, QuantError>,
) {
    let want: Vec<Vec<f32>> = xs
        .iter()
        .map(|a| {
            let mut o = vec![0f32; rows];
            matvec_ref(file_ty, w, a, &mut o).unwrap();
            o
        })
        .collect();
    let eq =
        |g: &[f32], w: &[f32]| g.len() == w.len() && g.iter().zip(w).all(|(&g, &w)| same(g, w));
    for (a, want) in xs.iter().zip(&want).take(3) {
        let mut got = vec![f32::NAN; rows];
        matvec(ty, packed, a, &mut got).unwrap();
        assert!(
            eq(&got, want),
            "{ty} one token, {rows} rows: {got:?} vs {want:?}"
        );
        let mut got = vec![f32::NAN; rows];
        matvec_ref(ty, packed, a, &mut got).unwrap();
        assert!(eq(&got, want), "{ty} scalar, {rows} rows");
        for (i, w) in want.iter().enumerate() {
            assert!(same(dot_row(packed, i, a).unwrap(), *w), "{ty} row {i}");
        }
    }
    for &n in ns {
        for threads in 1..=3 {
            let mut got = vec![f32::NAN; n * rows];
            matmul_threads(ty, packed, &xs[..n], &mut got, crate::Threads::new(threads)).unwrap();
            for (t, want) in want.iter().take(n).enumerate() {
                let g = &got[t * rows..(t + 1) * rows];
                assert!(
                    eq(g, want),
                    "{ty}: {n} tokens, token {t}, {threads} threads, {rows} rows"
                );
            }
        }
    }
}

/// Dequantizes row `r` of a repacked matrix (`rb` bytes a row) into `out`.
type DequantizeRow = fn(&[u8], usize, usize, &mut [f32]) -> Result<(), QuantError>;

/// The Q8_0 matrix `w` (`rows` rows of `nb` blocks) repacked as `packed`: the same
/// bytes, and every row rebuilt by `row_to` is the file's row, and dequantized by
/// `dequantize` the file's values, bit for bit.
fn q8_0_repacked_rows_are_the_files(
    w: &[u8],
    (rows, nb): (usize, usize),
    packed: &[u8],
    row_to: super::repacked::RowToFile,
    dequantize: DequantizeRow,
) {
    let rb = 34 * nb;
    assert_eq!(packed.len(), w.len());
    let mut row = Vec::new();
    for i in 0..rows {
        row_to(packed, rb, i, &mut row).unwrap();
        assert_eq!(row, &w[i * rb..(i + 1) * rb], "row {i} of {rows}x{nb}");
        let blocks: Vec<BlockQ8_0> = row
            .chunks_exact(34)
            .map(|c| BlockQ8_0 {
                d: u16::from_le_bytes([c[0], c[1]]),
                qs: std::array::from_fn(|j| c[2 + j] as i8),
            })
            .collect();
        let (mut want, mut got) = (vec![0f32; 32 * nb], vec![f32::NAN; 32 * nb]);
        dequantize_q8_0(&blocks, &mut want);
        dequantize(packed, rb, i, &mut got).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "dequantized row {i}");
    }
}

/// A Q8_0 matrix repacked in row pairs gives the file's Q8_0 bits on every path: its
/// rows unpacked are the file's bytes; one token (the row-pair kernel, and the scalar
/// path), a single row (`vec_dot_row`), and 1 to 40 tokens on 1 to 3 threads (the
/// token-transposed tiles reading the pairs as they are, and the one-token kernel for
/// the tokens they leave, rows of up to and past its 128 stacked blocks) equal the Q8_0
/// products over the file's blocks; −128 quants, extreme scales, and shapes refused.
#[test]
fn q8_0_row_pairs_give_the_q8_0_bits_on_every_path() {
    let mut r = Rng(71);
    for (rows, nb, extreme) in [
        (2, 1, false),
        (6, 2, true),
        (14, 3, false),
        (40, 20, true),
        (262, 4, false),
        (6, 130, true),
    ] {
        let mut w = weights(&mut r, QType::Q8_0, rows * nb, extreme);
        if extreme {
            for b in w.chunks_exact_mut(34) {
                let q = extreme_q8(&mut r);
                b[2..].iter_mut().zip(q).for_each(|(d, s)| *d = s as u8);
            }
        }
        let r2 = repack_q8_0_r2(&w, rows, 32 * nb).unwrap();
        q8_0_repacked_rows_are_the_files(&w, (rows, nb), &r2, row_to_q8_0, dequantize_row_q8_0_r2);
        let xs: Vec<QuantizedActs> = (0..40)
            .map(|_| acts(&mut r, QType::Q8_0, nb, extreme))
            .collect();
        repacked_products_agree(
            (QType::Q8_0, &w),
            (QType::Q8_0R2, &r2),
            rows,
            &xs,
            &[1, 2, 3, 4, 5, 7, 8, 11, 16, 19, 33, 40],
            vec_dot_row,
        );
    }
    // Refused: odd rows, a length that is not whole rows, and a single-row product.
    let w = weights(&mut r, QType::Q8_0, 3, false);
    assert!(repack_q8_0_r2(&w, 3, 32).is_err());
    assert!(repack_q8_0_r2(&w[..60], 2, 32).is_err());
    let a = acts(&mut r, QType::Q8_0, 1, false);
    let mut out = [0f32; 3];
    assert!(matvec(QType::Q8_0R2, &w, &a, &mut out).is_err());
    assert!(vec_dot(QType::Q8_0R2, &w[..34], &a).is_err());
    let mut row = Vec::new();
    assert!(row_to_q8_0(&w[..68], 34, 2, &mut row).is_err());
    assert!(dequantize_row_q8_0_r2(&w[..68], 34, 2, &mut [0f32; 32]).is_err());
    assert!(dequantize_row_q8_0_r2(&w[..68], 34, 1, &mut [0f32; 31]).is_err());
}

/// A Q4_1 matrix repacked in groups of 16 rows gives the file's Q4_1 bits on every
/// path: its rows unpacked are the file's bytes and dequantize to the file's values; one
/// token (the 16-row kernel, and the scalar path), a single row
/// (`vec_dot_row_q4_1_r16`), and 1 to 40 tokens on 1 to 3 threads (passes of 8, 4, 2
/// and 1 tokens, rows in chunks, rows of up to and past the stacked scales) equal the
/// Q4_1 products over the file's blocks; extreme scales and minimums, and shapes
/// refused.
#[test]
fn q4_1_row_groups_give_the_q4_1_bits_on_every_path() {
    let mut r = Rng(73);
    for (rows, nb, extreme) in [
        (16, 1, false),
        (32, 3, true),
        (48, 18, false),
        (96, 48, true),
        (16, 300, false),
        (784, 2, true),
    ] {
        let w = weights(&mut r, QType::Q4_1, rows * nb, extreme);
        let rb = 20 * nb;
        let r16 = repack_q4_1_r16(&w, rows, 32 * nb).unwrap();
        assert_eq!(r16.len(), w.len());
        let mut row = Vec::new();
        for i in 0..rows {
            row_to_q4_1(&r16, rb, i, &mut row).unwrap();
            assert_eq!(row, &w[i * rb..(i + 1) * rb], "row {i} of {rows}x{nb}");
            let blocks: Vec<BlockQ4_1> = row
                .chunks_exact(20)
                .map(|c| BlockQ4_1 {
                    d: [c[0], c[1]],
                    m: [c[2], c[3]],
                    qs: std::array::from_fn(|j| c[4 + j]),
                })
                .collect();
            let (mut want, mut got) = (vec![0f32; 32 * nb], vec![f32::NAN; 32 * nb]);
            dequantize_q4_1(&blocks, &mut want);
            dequantize_row_q4_1_r16(&r16, rb, i, &mut got).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "dequantized row {i}");
        }
        let xs: Vec<QuantizedActs> = (0..40)
            .map(|_| acts(&mut r, QType::Q4_1, nb, extreme))
            .collect();
        repacked_products_agree(
            (QType::Q4_1, &w),
            (QType::Q4_1R16, &r16),
            rows,
            &xs,
            &[1, 2, 3, 4, 5, 6, 7, 8, 11, 14, 16, 19, 33, 40],
            vec_dot_row_q4_1_r16,
        );
    }
    // Refused: rows not a multiple of 16, a length that is not whole rows, and a
    // single-row product.
    let w = weights(&mut r, QType::Q4_1, 24, false);
    assert!(repack_q4_1_r16(&w, 24, 32).is_err());
    assert!(repack_q4_1_r16(&w[..300], 16, 32).is_err());
    let a = acts(&mut r, QType::Q4_1, 1, false);
    let mut out = [0f32; 24];
    assert!(matvec(QType::Q4_1R16, &w, &a, &mut out).is_err());
    assert!(vec_dot(QType::Q4_1R16, &w[..20], &a).is_err());
    let mut row = Vec::new();
    assert!(row_to_q4_1(&w[..320], 20, 16, &mut row).is_err());
    assert!(dequantize_row_q4_1_r16(&w[..320], 20, 16, &mut [0f32; 32]).is_err());
    assert!(dequantize_row_q4_1_r16(&w[..320], 20, 1, &mut [0f32; 31]).is_err());
}

/// A Q8_0 matrix repacked in groups of 16 rows gives the file's Q8_0 bits on every
/// path: its rows unpacked are the file's bytes and dequantize to the file's values; one
/// token (the 16-row kernel, and the scalar path), a single row
/// (`vec_dot_row_q8_0_r16`), and 1 to 40 tokens on 1 to 3 threads (passes of 8, 4, 2
/// and 1 tokens, rows in chunks, rows of up to and past the stacked blocks) equal the
/// Q8_0 products over the file's blocks; −128 quants, extreme scales, and shapes
/// refused.
#[test]
fn q8_0_row_groups_give_the_q8_0_bits_on_every_path() {
    let mut r = Rng(79);
    for (rows, nb, extreme) in [
        (16, 1, false),
        (32, 3, true),
        (48, 18, false),
        (96, 20, true),
        (16, 140, false),
        (784, 2, true),
    ] {
        let mut w = weights(&mut r, QType::Q8_0, rows * nb, extreme);
        if extreme {
            for b in w.chunks_exact_mut(34) {
                let q = extreme_q8(&mut r);
                b[2..].iter_mut().zip(q).for_each(|(d, s)| *d = s as u8);
            }
        }
        let r16 = repack_q8_0_r16(&w, rows, 32 * nb).unwrap();
        q8_0_repacked_rows_are_the_files(
            &w,
            (rows, nb),
            &r16,
            row_to_q8_0_r16,
            dequantize_row_q8_0_r16,
        );
        let xs: Vec<QuantizedActs> = (0..40)
            .map(|_| acts(&mut r, QType::Q8_0, nb, extreme))
            .collect();
        repacked_products_agree(
            (QType::Q8_0, &w),
            (QType::Q8_0R16, &r16),
            rows,
            &xs,
            &[1, 2, 3, 4, 5, 6, 7, 8, 11, 14, 16, 19, 33, 40],
            vec_dot_row_q8_0_r16,
        );
    }
    // Refused: rows not a multiple of 16, a length that is not whole rows, and a
    // single-row product.
    let w = weights(&mut r, QType::Q8_0, 24, false);
    assert!(repack_q8_0_r16(&w, 24, 32).is_err());
    assert!(repack_q8_0_r16(&w[..500], 16, 32).is_err());
    let a = acts(&mut r, QType::Q8_0, 1, false);
    let mut out = [0f32; 24];
    assert!(matvec(QType::Q8_0R16, &w, &a, &mut out).is_err());
    assert!(vec_dot(QType::Q8_0R16, &w[..34], &a).is_err());
    let mut row = Vec::new();
    assert!(row_to_q8_0_r16(&w[..544], 34, 16, &mut row).is_err());
    assert!(dequantize_row_q8_0_r16(&w[..544], 34, 16, &mut [0f32; 32]).is_err());
    assert!(dequantize_row_q8_0_r16(&w[..544], 34, 1, &mut [0f32; 31]).is_err());
}

// ------------------------------------------------------------------ paths covered

// The agreement tests above run every kernel this CPU has; asked for one it lacks
// (`matvec_isa`'s `vnni` / `zmm`, `TILE_ISAS`, the 8-token K-quant kernels) they take
// the best it has instead, and pass having tested that one. These tests say which paths
// were covered: on a CPU without a path's features (or with `FAK_NO_AVX512=1` /
// `FAK_NO_VNNI=1`) its test is reported ignored, not passed.

#[fak_testkit::cpu("avx2", "f16c", "avxvnni")]
fn the_avx_vnni_kernels_are_tested() {
    assert!(has_avx_vnni());
    assert_eq!(
        super::TileIsa::at_most(super::TileIsa::Vnni),
        super::TileIsa::Vnni
    );
}

#[fak_testkit::cpu("avx2", "f16c", "avx512bw", "avx512vl")]
fn the_eight_token_k_quant_kernels_are_tested() {
    assert!(has_avx512_bw_vl());
}

#[fak_testkit::cpu("avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni")]
fn the_256_bit_tiles_with_32_registers_are_tested() {
    assert!(super::TileIsa::at_most(super::TileIsa::Vnni512) == super::TileIsa::Vnni512);
}

#[fak_testkit::cpu(
    "avx2",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512vnni"
)]
fn the_512_bit_kernels_are_tested() {
    assert!(has_avx512_vnni());
    assert!(super::TileIsa::at_most(super::TileIsa::Zmm) == super::TileIsa::Zmm);
}

#[test]
fn a_tile_kernel_the_cpu_lacks_is_never_chosen() {
    // AVX512-VNNI without AVX-VNNI (AMD Zen 4) must not get the VEX-encoded tiles, and
    // AVX-VNNI without AVX-512 must not get the EVEX-encoded ones.
    for cap in TILE_ISAS {
        let got = super::TileIsa::at_most(cap);
        assert!(got <= cap, "{cap:?} gave {got:?}");
        match got {
            super::TileIsa::Avx2 => {}
            super::TileIsa::Vnni => assert!(has_avx_vnni(), "{cap:?} gave {got:?}"),
            super::TileIsa::Vnni512 | super::TileIsa::Zmm => {
                assert!(has_avx512_vnni(), "{cap:?} gave {got:?}")
            }
        }
    }
}
