//! The x86 drivers of the SIMD kernels ([`super::avx2`], [`super::transposed`],
//! [`super::transposed_k`]): a one-token product four rows at a time, and a
//! multi-token product in tiles of rows × tokens, with the activation forms each
//! instruction set reads prepared once per product.

#[cfg(target_arch = "x86_64")]
use super::{avx2, transposed, transposed_k};
use super::{has_avx2_f16c, has_avx512_bw_vl, has_avx512_vnni, has_avx_vnni};
use super::{BlockQ8K, BlockQ8_0, BlockQ8_1, QType, QuantizedActs};

/// The 32-element types' matvec: four rows at a time through the interleaved AVX2
/// kernel (each row in exactly its single-row order), the last `rows % 4` one by one;
/// with AVX-VNNI lane sums when the CPU has them and the type asks for them
/// (`Block32::VNNI_ROWS`; the same bits). Returns `true` (it always handles the
/// product).
///
/// # Safety
/// AVX2 and F16C are available, and AVX-VNNI when `vnni`; `rb == K::BYTES * a.len()`;
/// `w.len() == rb * out.len()`.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn rows4<K: avx2::Block32>(
    w: &[u8],
    rb: usize,
    a: &[K::Act],
    out: &mut [f32],
    vnni: bool,
) -> bool
where
    K::Act: avx2::ActBlock,
{
    let scales = avx2::ActScales::new(a);
    let sc = scales.get();
    let va = (vnni && K::VNNI_ROWS).then(|| avx2::vnni_acts::<K>(a));
    let mut outs = out.chunks_exact_mut(4);
    let mut ws = w.chunks_exact(4 * rb);
    for (o, wc) in (&mut outs).zip(&mut ws) {
        match &va {
            Some(va) => avx2::rows_vnni::<K, 4>(wc, rb, va, sc, o),
            None => avx2::rows::<K, 4>(wc, rb, a, sc, o),
        }
    }
    let rest = outs.into_remainder();
    for (o, wr) in rest
        .chunks_exact_mut(1)
        .zip(ws.remainder().chunks_exact(rb))
    {
        match &va {
            Some(va) => avx2::rows_vnni::<K, 1>(wr, rb, va, sc, o),
            None => avx2::rows::<K, 1>(wr, rb, a, sc, o),
        }
    }
    true
}

/// [`rows4`] with the 512-bit kernel for 8-row, then 4-row groups (two rows per
/// register; the same bits); the last `rows % 4` rows go through the 256-bit kernel
/// with AVX512-VNNI's lane sums ([`avx2::rows_vnni512`]).
///
/// # Safety
/// AVX2, F16C, AVX-512F/BW/DQ/VL and AVX512-VNNI are available;
/// `rb == K::BYTES * a.len()`; `w.len() == rb * out.len()`.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn rows4_512<K: avx2::Tile512>(
    w: &[u8],
    rb: usize,
    a: &[K::Act],
    out: &mut [f32],
) -> bool
where
    K::Act: avx2::ActBlock,
{
    let scales = avx2::ActScales::new(a);
    let va = avx2::vnni_acts512::<K>(a);
    one_token_512::<K>(w, rb, &va, scales.get(), out);
    true
}

/// The rows of `w` times one token (`a` in the form of [`avx2::vnni_acts512`], `sc` its
/// [`avx2::act_scales`]): eight rows at a time through [`avx2::rows_pairs_512`], then
/// four, the last `rows % 4` through [`avx2::rows_vnni512`].
///
/// # Safety
/// As [`rows4_512`]; `out.len() == w.len() / rb`.
#[cfg(target_arch = "x86_64")]
unsafe fn one_token_512<K: avx2::Tile512>(
    w: &[u8],
    rb: usize,
    a: &[K::VAct],
    sc: &[[f32; 2]],
    out: &mut [f32],
) {
    let mut outs = out.chunks_exact_mut(8);
    let mut ws = w.chunks_exact(8 * rb);
    for (o, wc) in (&mut outs).zip(&mut ws) {
        avx2::rows_pairs_512::<K, 4>(wc, rb, a, sc, o);
    }
    let mut outs = outs.into_remainder().chunks_exact_mut(4);
    let mut ws = ws.remainder().chunks_exact(4 * rb);
    for (o, wc) in (&mut outs).zip(&mut ws) {
        avx2::rows_pairs_512::<K, 2>(wc, rb, a, sc, o);
    }
    let rest = outs.into_remainder();
    for (o, wr) in rest
        .chunks_exact_mut(1)
        .zip(ws.remainder().chunks_exact(rb))
    {
        avx2::rows_vnni512::<K, 1>(wr, rb, a, sc, o);
    }
}

/// The multi-token K-quant kernel's form of `ty` (`None`: not a K-quant).
#[cfg(target_arch = "x86_64")]
pub(crate) fn k_quant(ty: QType) -> Option<avx2::KQuant> {
    use avx2::KQuant;
    match ty {
        QType::Q4K => Some(KQuant::Q4),
        QType::Q5K => Some(KQuant::Q5),
        QType::Q6K => Some(KQuant::Q6),
        _ => None,
    }
}

/// Which lane sums the multi-token tiles compute (all give the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum TileIsa {
    /// AVX2 `maddubs`/`madd`.
    Avx2,
    /// AVX-VNNI `vpdpbusd`, VEX-encoded ([`has_avx_vnni`]).
    Vnni,
    /// AVX512-VNNI's `vpdpbusd` on 256-bit registers (EVEX-encoded), in code compiled
    /// with AVX-512F/BW/VL ([`has_avx512_vnni`]).
    Vnni512,
    /// As `Vnni512`, and the 512-bit tiles: sixteen tokens per register for every block
    /// format from 16 tokens on ([`transposed`], [`transposed_k`]), and for the
    /// 32-element types eight tokens times two rows after those ([`transposed`]), the
    /// few tokens left (or a product of fewer than 5, 3 on a Zen 4: `transposed`'s
    /// thresholds) a token at a time through the one-token kernel ([`row_wise_512`];
    /// Q4_1, Q5_0, Q5_1 and Q8_0).
    Zmm,
}

impl TileIsa {
    /// Whether this CPU runs the tiles of `self` (AVX2 and F16C assumed).
    fn available(self) -> bool {
        match self {
            TileIsa::Avx2 => true,
            TileIsa::Vnni => has_avx_vnni(),
            TileIsa::Vnni512 | TileIsa::Zmm => has_avx512_vnni(),
        }
    }

    /// The best this CPU has, at most `cap`. (A CPU may have AVX512-VNNI and not
    /// AVX-VNNI, AMD Zen 4 for one, so `cap = Vnni` there gives `Avx2`.)
    pub(crate) fn at_most(cap: TileIsa) -> TileIsa {
        [TileIsa::Zmm, TileIsa::Vnni512, TileIsa::Vnni]
            .into_iter()
            .find(|i| *i <= cap && i.available())
            .unwrap_or(TileIsa::Avx2)
    }
}

/// A multi-token product's activation rows in the forms the tiles of its weight type
/// read (for the 32-element types scales widened and the VNNI form when used; the
/// token-transposed forms with AVX-512), prepared once per product rather than once
/// per chunk of rows.
pub(crate) enum TileActs<'a> {
    #[cfg(target_arch = "x86_64")]
    Q4_0(Tiled<'a, avx2::Q4_0>),
    #[cfg(target_arch = "x86_64")]
    Q4_1(Tiled<'a, avx2::Q4_1>),
    #[cfg(target_arch = "x86_64")]
    Q5_0(Tiled<'a, avx2::Q5_0>),
    #[cfg(target_arch = "x86_64")]
    Q5_1(Tiled<'a, avx2::Q5_1>),
    #[cfg(target_arch = "x86_64")]
    Q8_0(Tiled<'a, avx2::Q8_0>),
    /// Q4_K, Q5_K, Q6_K.
    #[cfg(target_arch = "x86_64")]
    K(KTiled<'a>),
    /// Q8_0 repacked in row pairs ([`QType::Q8_0R2`]; [`TileIsa::Zmm`] only).
    #[cfg(target_arch = "x86_64")]
    R2(R2Tiled<'a>),
    /// Q4_1 repacked in groups of 16 rows ([`QType::Q4_1R16`]; [`TileIsa::Zmm`] only):
    /// the tokens' blocks as they are, read by [`avx2::rows_r16_512`].
    #[cfg(target_arch = "x86_64")]
    R16(Vec<&'a [BlockQ8_1]>),
    /// Q8_0 repacked in groups of 16 rows ([`QType::Q8_0R16`]; [`TileIsa::Zmm`] only):
    /// the tokens' blocks as they are, read by [`avx2::rows_r16_q8_0_512`].
    #[cfg(target_arch = "x86_64")]
    R16Q8(Vec<&'a [BlockQ8_0]>),
    /// (No tiles elsewhere.)
    #[cfg(not(target_arch = "x86_64"))]
    #[allow(dead_code)]
    Never(std::convert::Infallible, std::marker::PhantomData<&'a ()>),
}

/// [`TileActs`] of one type: every token's blocks and, for the tokens the
/// token-transposed tiles do not take (from `tt`'s [`transposed::Acts::tokens`] on;
/// empty before), their [`avx2::act_scales`] and, with either VNNI, their
/// [`avx2::vnni_acts`] (or [`avx2::vnni_acts512`]: the same values).
#[cfg(target_arch = "x86_64")]
pub(crate) struct Tiled<'a, K: avx2::Block32> {
    a: Vec<&'a [K::Act]>,
    sc: Vec<Vec<[f32; 2]>>,
    va: Option<Vec<std::borrow::Cow<'a, [K::VAct]>>>,
    /// [`TileIsa::Vnni512`] or above (with `va`).
    wide: bool,
    /// [`TileIsa::Zmm`]: the token-transposed tiles and [`row_wise_512`] (for the types
    /// that have them).
    zmm: bool,
    /// [`TileIsa::Zmm`] and 5 tokens or more (3 on a Zen 4): the tokens in the form of the
    /// token-transposed tiles ([`transposed::Acts`]: groups of 16, then of 8), all but
    /// the last few ([`transposed::Acts::tokens`]).
    tt: Option<transposed::Acts>,
}

#[cfg(target_arch = "x86_64")]
impl<'a, K: avx2::Block32> Tiled<'a, K>
where
    K::Act: avx2::ActBlock,
{
    /// # Safety
    /// AVX2 and F16C are available, and what `isa` needs ([`TileIsa::at_most`]).
    unsafe fn new(a: Vec<&'a [K::Act]>, isa: TileIsa) -> Self {
        let zmm = isa == TileIsa::Zmm;
        // The token-transposed form needs AVX2 and F16C (this function's contract); its
        // tiles, which need AVX-512 and AVX512-VNNI, run only when `zmm`.
        let tt = if zmm {
            transposed::Acts::new::<K>(&a)
        } else {
            None
        };
        // The other forms only for the tokens the transposed tiles leave (those before
        // are never read: empty placeholders keep the indices).
        let t0 = tt.as_ref().map_or(0, |tt| tt.tokens());
        let sc = (a.iter().enumerate())
            .map(|(t, at)| {
                if t < t0 {
                    Vec::new()
                } else {
                    avx2::act_scales(at)
                }
            })
            .collect();
        let wide = isa >= TileIsa::Vnni512;
        let va = (isa >= TileIsa::Vnni).then(|| {
            (a.iter().enumerate())
                .map(|(t, at)| match t < t0 {
                    true => std::borrow::Cow::Borrowed(&[][..]),
                    false if wide => avx2::vnni_acts512::<K>(at),
                    false => avx2::vnni_acts::<K>(at),
                })
                .collect()
        });
        Tiled {
            a,
            sc,
            va,
            wide,
            zmm,
            tt,
        }
    }
}

/// [`TileActs`] of a K-quant: every token's Q8_K blocks and, with [`TileIsa::Zmm`] and
/// 16 tokens or more, the first multiple of 16 in the form of the token-transposed
/// tiles ([`transposed_k`]); the rest run several tokens at a time against each row
/// ([`avx2::k_tokens`], or [`avx2::k_tokens_wide`] when `wide`).
#[cfg(target_arch = "x86_64")]
pub(crate) struct KTiled<'a> {
    kind: avx2::KQuant,
    a: Vec<&'a [BlockQ8K]>,
    /// AVX-512F/BW/VL ([`has_avx512_bw_vl`]).
    wide: bool,
    tt: Option<transposed_k::Acts>,
}

/// [`TileActs`] of a Q8_0 matrix repacked in row pairs: the first tokens in the form of
/// the token-transposed tiles ([`transposed::tiles_r2`]; from 2 tokens on,
/// [`transposed::Acts::new_r2`]), the one left after full groups (or the only one) as
/// it is, for the one-token row-pair kernel ([`avx2::rows_r2_512`]).
#[cfg(target_arch = "x86_64")]
pub(crate) struct R2Tiled<'a> {
    tt: Option<transposed::Acts>,
    rest: Vec<&'a [BlockQ8_0]>,
}

/// The rows of the row-pair matrix `w` (`rb` bytes a row, an even number) times one
/// token `a`, into `out`: [`avx2::rows_r2_512`].
///
/// # Safety
/// AVX2, F16C, AVX-512F/BW/DQ/VL and AVX512-VNNI; `rb == 34 · a.len()`, `w.len() ==
/// rb · out.len()`, `out.len()` even.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn r2_one_token(w: &[u8], rb: usize, a: &[BlockQ8_0], out: &mut [f32]) {
    debug_assert!(rb == 34 * a.len() && w.len() == rb * out.len());
    avx2::rows_r2_512(w, a, out);
}

impl<'a> TileActs<'a> {
    /// The prepared rows, or `None` when the tiles do not apply (no AVX2 and F16C, or
    /// activations of another kind than `ty` pairs with).
    pub(crate) fn new(ty: QType, acts: &'a [QuantizedActs], isa: TileIsa) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if has_avx2_f16c() {
            fn q8_0s(a: &[QuantizedActs]) -> Option<Vec<&[BlockQ8_0]>> {
                a.iter()
                    .map(|q| match q {
                        QuantizedActs::Q8_0(v) => Some(&v[..]),
                        _ => None,
                    })
                    .collect()
            }
            fn q8_1s(a: &[QuantizedActs]) -> Option<Vec<&[BlockQ8_1]>> {
                a.iter()
                    .map(|q| match q {
                        QuantizedActs::Q8_1(v) => Some(&v[..]),
                        _ => None,
                    })
                    .collect()
            }
            let isa = TileIsa::at_most(isa);
            // SAFETY (all arms): AVX2 and F16C were detected, and what `isa` needs
            // (`at_most` gives only what was detected).
            return match ty {
                QType::Q4_0 => q8_0s(acts).map(|a| TileActs::Q4_0(unsafe { Tiled::new(a, isa) })),
                QType::Q5_0 => q8_0s(acts).map(|a| TileActs::Q5_0(unsafe { Tiled::new(a, isa) })),
                QType::Q8_0 => q8_0s(acts).map(|a| TileActs::Q8_0(unsafe { Tiled::new(a, isa) })),
                QType::Q4_1 => q8_1s(acts).map(|a| TileActs::Q4_1(unsafe { Tiled::new(a, isa) })),
                QType::Q5_1 => q8_1s(acts).map(|a| TileActs::Q5_1(unsafe { Tiled::new(a, isa) })),
                QType::Q8_0R2 => {
                    let a = q8_0s(acts)?;
                    if isa != TileIsa::Zmm {
                        return None;
                    }
                    // SAFETY: `Zmm` is available (`at_most` gives only what was
                    // detected): AVX2, F16C, AVX-512F/BW/DQ/VL and AVX512-VNNI.
                    let tt = unsafe { transposed::Acts::new_r2(&a) };
                    let t0 = tt.as_ref().map_or(0, |t| t.tokens());
                    let rest = a[t0..].to_vec();
                    Some(TileActs::R2(R2Tiled { tt, rest }))
                }
                QType::Q4_1R16 => {
                    let a = q8_1s(acts)?;
                    (isa == TileIsa::Zmm).then_some(TileActs::R16(a))
                }
                QType::Q8_0R16 => {
                    let a = q8_0s(acts)?;
                    (isa == TileIsa::Zmm).then_some(TileActs::R16Q8(a))
                }
                QType::Q4K | QType::Q5K | QType::Q6K => {
                    let a: Vec<&[BlockQ8K]> = acts
                        .iter()
                        .map(|q| match q {
                            QuantizedActs::Q8K(v) => Some(&v[..]),
                            _ => None,
                        })
                        .collect::<Option<_>>()?;
                    let tt = if isa == TileIsa::Zmm {
                        transposed_k::Acts::new(&a)
                    } else {
                        None
                    };
                    Some(TileActs::K(KTiled {
                        kind: k_quant(ty)?,
                        a,
                        wide: has_avx512_bw_vl(),
                        tt,
                    }))
                }
            };
        }
        let _ = (ty, acts, isa);
        None
    }

    /// `out[t][r] = dot(row r of w, token t)` through the tiles.
    ///
    /// # Safety
    /// Every token is `rb / K::BYTES` blocks (`K` the held type); `w.len()` is a
    /// multiple of `rb` (of `2 · rb`, whole row pairs, for [`QType::Q8_0R2`], of `16 ·
    /// rb` for [`QType::Q4_1R16`]: their kernels assert it); `out` holds one slice of
    /// `w.len() / rb` outputs per token.
    pub(crate) unsafe fn run(&self, w: &[u8], rb: usize, out: &mut [&mut [f32]]) {
        // SAFETY of the calls: a `TileActs` exists only when AVX2 and F16C were detected
        // (AVX-VNNI when it holds the VNNI form and not `wide`, AVX-512F/BW/DQ/VL and
        // AVX512-VNNI when `wide` or `zmm`, and for `R2` and `R16`, which are made only
        // with `TileIsa::Zmm`); the shapes are this function's contract.
        match self {
            #[cfg(target_arch = "x86_64")]
            TileActs::Q4_0(t) => {
                let t0 = tiles_transposed(w, rb, t, out);
                tiles(w, rb, t, out, t0)
            }
            #[cfg(target_arch = "x86_64")]
            TileActs::Q4_1(t) => tiles_any(w, rb, t, out),
            #[cfg(target_arch = "x86_64")]
            TileActs::Q5_0(t) => tiles_any(w, rb, t, out),
            #[cfg(target_arch = "x86_64")]
            TileActs::Q5_1(t) => tiles_any(w, rb, t, out),
            #[cfg(target_arch = "x86_64")]
            TileActs::Q8_0(t) => tiles_any(w, rb, t, out),
            #[cfg(target_arch = "x86_64")]
            TileActs::K(t) => {
                let t0 = match &t.tt {
                    Some(tt) => {
                        transposed_k::tiles(w, rb, t.kind, tt, out);
                        tt.tokens()
                    }
                    None => 0,
                };
                let (rest, out) = (&t.a[t0..], &mut out[t0..]);
                if t.wide {
                    avx2::k_tokens_wide(w, rb, rest, t.kind, out);
                } else {
                    avx2::k_tokens(w, rb, rest, t.kind, out);
                }
            }
            #[cfg(target_arch = "x86_64")]
            TileActs::R2(t) => {
                let t0 = match &t.tt {
                    Some(tt) => {
                        transposed::tiles_r2(w, rb, tt, out);
                        tt.tokens()
                    }
                    None => 0,
                };
                // The tokens left, each over a chunk of rows held in the cache (as
                // `row_wise_512`): whole pairs (a multiple of 4 rows).
                let m = w.len() / rb;
                let chunk = row_wise_chunk(rb);
                for r0 in (0..m).step_by(chunk) {
                    let r1 = (r0 + chunk).min(m);
                    for (a, o) in t.rest.iter().zip(&mut out[t0..]) {
                        avx2::rows_r2_512(&w[r0 * rb..r1 * rb], a, &mut o[r0..r1]);
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            TileActs::R16(a) => avx2::rows_r16_512(w, rb, a, out),
            #[cfg(target_arch = "x86_64")]
            TileActs::R16Q8(a) => avx2::rows_r16_q8_0_512(w, rb, a, out),
            #[cfg(not(target_arch = "x86_64"))]
            TileActs::Never(never, _) => match *never {},
        }
    }
}

/// The token-transposed tiles ([`transposed::tiles`]) for the tokens `p` holds in
/// their form (groups of 16, then of 8); returns the first token they did not cover.
///
/// # Safety
/// As [`tiles`], and AVX-512F/BW/DQ/VL and AVX512-VNNI when `p.tt` is set.
#[cfg(target_arch = "x86_64")]
unsafe fn tiles_transposed<K: avx2::Block32>(
    w: &[u8],
    rb: usize,
    p: &Tiled<'_, K>,
    out: &mut [&mut [f32]],
) -> usize
where
    K::Act: avx2::ActBlock,
{
    match &p.tt {
        Some(tt) => {
            transposed::tiles::<K>(w, rb, tt, out);
            tt.tokens()
        }
        None => 0,
    }
}

/// Every token through the best tiles `p` allows: the token-transposed ones for the
/// tokens they take (groups of 16, then of 8), then the rest: a token at a time
/// ([`row_wise_512`]) when `p.zmm` and at most 4 are left (always, for the tokens the
/// transposed tiles leave), else [`tiles`].
///
/// # Safety
/// As [`tiles`], and AVX-512F/BW/DQ/VL and AVX512-VNNI when `p.zmm`.
#[cfg(target_arch = "x86_64")]
unsafe fn tiles_any<K: avx2::Tile512>(w: &[u8], rb: usize, p: &Tiled<'_, K>, out: &mut [&mut [f32]])
where
    K::Act: avx2::ActBlock,
{
    let t0 = tiles_transposed(w, rb, p, out);
    match &p.va {
        Some(va) if p.zmm && p.a.len() - t0 <= ROW_WISE_TOKENS => {
            row_wise_512(w, rb, p, va, out, t0)
        }
        _ => tiles(w, rb, p, out, t0),
    }
}

/// The most tokens left after the token-transposed tiles that [`row_wise_512`] takes
/// (more go to [`tiles`]; the transposed tiles leave at most 4, see
/// `transposed::MIN_TOKENS`). Measured with `batch_bench`'s shapes (1536 × 576, weights
/// streamed, a Zen 5, µs per product, 1 / 2 threads): 2 tokens through the 2-token tiles
/// Q4_1 51 / 28–31, Q8_0 55–60 / 28–29; a token at a time 31 / 17–19, 35–37 / 20–22.
const ROW_WISE_TOKENS: usize = 4;

/// The tokens of `p` from `t0` on, each through the one-token kernel of [`rows4_512`]
/// ([`one_token_512`]), in chunks of rows of about [`ROW_WISE_CHUNK_BYTES`], every token
/// over a chunk before the next chunk, so that the tokens after the first read its
/// weights from the cache. Each output is the one-token kernel's, so the same bits as
/// every kernel.
///
/// # Safety
/// As [`tiles`], and AVX-512F/BW/DQ/VL and AVX512-VNNI; `va` is `p.va`.
#[cfg(target_arch = "x86_64")]
unsafe fn row_wise_512<K: avx2::Tile512>(
    w: &[u8],
    rb: usize,
    p: &Tiled<'_, K>,
    va: &[std::borrow::Cow<'_, [K::VAct]>],
    out: &mut [&mut [f32]],
    t0: usize,
) where
    K::Act: avx2::ActBlock,
{
    let m = w.len() / rb;
    let chunk = row_wise_chunk(rb);
    for r0 in (0..m).step_by(chunk) {
        let r1 = (r0 + chunk).min(m);
        for t in t0..va.len() {
            let o = &mut out[t][r0..r1];
            one_token_512::<K>(&w[r0 * rb..r1 * rb], rb, &va[t], &p.sc[t], o);
        }
    }
}

/// Weight bytes per chunk of [`row_wise_512`]: a chunk stays in the first-level cache
/// while each token reads it.
const ROW_WISE_CHUNK_BYTES: usize = 16 * 1024;

/// Rows of `rb` bytes per chunk of [`row_wise_512`] (and the row-pair tokens left after
/// the transposed tiles): about [`ROW_WISE_CHUNK_BYTES`], a multiple of 4.
#[cfg(target_arch = "x86_64")]
fn row_wise_chunk(rb: usize) -> usize {
    (ROW_WISE_CHUNK_BYTES / rb.max(1)).div_ceil(4).max(1) * 4
}

/// `TILE_R`-row × `TILE_T`-token tiles of [`avx2::rows_tokens`] (or
/// [`avx2::rows_tokens_vnni`] / [`avx2::rows_tokens_vnni512`] when `p` holds the VNNI
/// form) over all of `w` and the tokens of `p` from `t0` on, with 1-row and 1-token
/// tiles at the edges; `out` is `[tokens, rows of w]` (rows of tokens before `t0`
/// untouched).
///
/// # Safety
/// AVX2 and F16C (and AVX-VNNI when `p.va` is set and not `p.wide`, AVX-512F/BW/VL and
/// AVX512-VNNI when `p.wide`); every `p.a[t]` is `rb / K::BYTES`
/// blocks; `w.len()` is a multiple of `rb`; `out.len() == p.a.len() * w.len() / rb`.
#[cfg(target_arch = "x86_64")]
unsafe fn tiles<K: avx2::Block32>(
    w: &[u8],
    rb: usize,
    p: &Tiled<'_, K>,
    out: &mut [&mut [f32]],
    t0: usize,
) {
    let (a, sc) = (&p.a, &p.sc);
    let (m, n) = (w.len() / rb, a.len());
    let mut r = 0;
    while r < m {
        let wr = &w[r * rb..];
        let rr = if m - r >= TILE_R { TILE_R } else { 1 };
        let mut t = t0;
        while t < n {
            let tt = if n - t >= TILE_T { TILE_T } else { 1 };
            macro_rules! tile {
                ($r:expr, $t:expr) => {{
                    let mut o = [[0f32; $r]; $t];
                    let ss: [&[[f32; 2]]; $t] = std::array::from_fn(|j| &sc[t + j][..]);
                    if let Some(va) = &p.va {
                        let ts: [&[K::VAct]; $t] = std::array::from_fn(|j| &va[t + j][..]);
                        if p.wide {
                            avx2::rows_tokens_vnni512::<K, $r, $t>(wr, rb, ts, ss, &mut o);
                        } else {
                            avx2::rows_tokens_vnni::<K, $r, $t>(wr, rb, ts, ss, &mut o);
                        }
                    } else {
                        let ts: [&[K::Act]; $t] = std::array::from_fn(|j| a[t + j]);
                        avx2::rows_tokens::<K, $r, $t>(wr, rb, ts, ss, &mut o);
                    }
                    for (j, oj) in o.iter().enumerate() {
                        out[t + j][r..r + $r].copy_from_slice(oj);
                    }
                }};
            }
            match (rr, tt) {
                (TILE_R, TILE_T) => tile!(TILE_R, TILE_T),
                (TILE_R, _) => tile!(TILE_R, 1),
                (_, TILE_T) => tile!(1, TILE_T),
                _ => tile!(1, 1),
            }
            t += tt;
        }
        r += rr;
    }
}

/// Rows × tokens of one multi-token tile (see [`tiles`]). 2 × 4 keeps the eight
/// accumulators and the activations of a block in registers; in `qdot_bench`'s
/// multi-token section it beat the earlier 8 × 2 for every 32-element type, and 1 × 8,
/// 4 × 2, 2 × 3, 2 × 6, 3 × 3, 3 × 4 and 4 × 3 were slower for Q8_0.
#[cfg(target_arch = "x86_64")]
const TILE_R: usize = 2;
#[cfg(target_arch = "x86_64")]
const TILE_T: usize = 4;
