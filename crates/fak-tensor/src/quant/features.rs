//! Which SIMD kernels this CPU runs: detected once per process, with the environment
//! switches that turn the AVX-512 and VNNI forms off for comparison.

/// Whether the SIMD kernels run on this CPU: they need AVX2 and F16C (every AVX2 CPU
/// has F16C; the scale widening uses it). Detected once per process.
#[inline]
pub fn has_avx2_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU has AVX-VNNI (`vpdpbusd` on 256-bit registers), which the
/// 32-element kernels use for their integer lane sums when present (same bits).
/// Detected once per process; `FAK_NO_VNNI=1` turns it off (for comparing the two).
#[inline]
pub fn has_avx_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            has_avx2_f16c()
                && std::is_x86_feature_detected!("avxvnni")
                && std::env::var_os("FAK_NO_VNNI").is_none_or(|v| v != "1")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the 512-bit kernels run (Q4_0, Q4_1, Q5_0 and Q5_1: two rows per register
/// in a matvec; the 32-element types' multi-token tiles): AVX-512F/BW/DQ/VL and
/// AVX512-VNNI detected at run time, and neither `FAK_NO_AVX512=1` nor `FAK_NO_VNNI=1`
/// set. They give the same bits as the 256-bit kernels (tests compare all three with
/// the reference).
pub fn has_avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            has_avx_vnni()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512dq")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512vnni")
                && std::env::var_os("FAK_NO_AVX512").is_none_or(|v| v != "1")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU has AVX-512BW and AVX-512VL, which the 256-bit multi-token tiles use
/// (with AVX-VNNI, see [`has_avx_vnni`]) for 32 vector registers and one-instruction
/// word permutes (same bits). Detected once per process; `FAK_NO_AVX512=1` turns it off.
#[inline]
pub(crate) fn has_avx512_bw_vl() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
                && std::env::var_os("FAK_NO_AVX512").is_none_or(|v| v != "1")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
