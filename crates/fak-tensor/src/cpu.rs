//! What the CPU that runs the kernels can execute, and choices that depend on which CPU
//! it is.
//!
//! Instruction sets are detected here, each once per process (`is_x86_feature_detected!`),
//! with the environment switches that turn the AVX-512 and VNNI forms off for
//! comparison: [`has_avx2_fma`] and [`has_avx512_f32`] for the f32 kernels (`dot`
//! re-exports them), [`has_avx2_f16c`], [`has_avx_vnni`] and [`has_avx512_vnni`] for the
//! quantized ones (`quant` re-exports them). Every SIMD kernel is chosen by one of these.
//!
//! Some choices that give the same bits either way (a prefetch hint, how many weight
//! rows one f32 kernel call streams side by side, how a one-token product's rows are
//! shared between two threads) were measured to go opposite ways on an AMD Zen 5 and
//! an Intel Xeon. Those choices follow the CPU's
//! vendor, read once from `cpuid`; `FAK_CPU_VENDOR=AuthenticAMD|GenuineIntel|…`
//! overrides it for every choice that follows it (to measure one CPU's choices on the
//! other). Each choice's documentation says what it does on each vendor and why; the
//! figures are in `docs/performance.md` ("Why it is fast").

use std::sync::OnceLock;

/// Whether the choices for AMD CPUs apply: `cpuid`'s vendor string is "AuthenticAMD",
/// or `FAK_CPU_VENDOR` says so. Computed once per process (inlined: the decode
/// attention kernels ask once per call).
#[inline]
pub fn tuned_for_amd() -> bool {
    static AMD: OnceLock<bool> = OnceLock::new();
    *AMD.get_or_init(|| match std::env::var("FAK_CPU_VENDOR") {
        Ok(v) if !v.is_empty() => v == "AuthenticAMD",
        _ => vendor() == *b"AuthenticAMD",
    })
}

/// The CPU's vendor string (`cpuid` leaf 0: EBX, EDX, ECX); empty off x86_64.
pub fn vendor() -> [u8; 12] {
    #[cfg(target_arch = "x86_64")]
    {
        let r = std::arch::x86_64::__cpuid(0);
        let mut v = [0u8; 12];
        v[..4].copy_from_slice(&r.ebx.to_le_bytes());
        v[4..8].copy_from_slice(&r.edx.to_le_bytes());
        v[8..].copy_from_slice(&r.ecx.to_le_bytes());
        v
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        [0u8; 12]
    }
}

/// Whether the AVX2+FMA kernels of the `f32` products can run on this CPU: AVX2, FMA
/// and F16C (which every CPU with the first two has; the products widen
/// [`crate::F16`] weights with it). Detected once.
#[inline]
pub fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the f32 multi-token tiles use 512-bit registers (`dot`'s `avx2::dot_tile_512`:
/// two tokens per register, the same bits): AVX2/FMA and AVX-512F/DQ detected at run
/// time, and `FAK_NO_AVX512=1` not set.
pub fn has_avx512_f32() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            has_avx2_fma()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512dq")
                && std::env::var_os("FAK_NO_AVX512").is_none_or(|v| v != "1")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

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

/// Whether the AVX-512 VNNI kernels run: the 512-bit ones (Q4_0, Q4_1, Q5_0 and Q5_1:
/// two rows per register in a matvec; the multi-token tiles of every block format) and
/// the EVEX-encoded 256-bit `vpdpbusd` lane sums beside them. AVX2/F16C,
/// AVX-512F/BW/DQ/VL and AVX512-VNNI detected at run time, and neither
/// `FAK_NO_AVX512=1` nor `FAK_NO_VNNI=1` set. AVX-VNNI (the VEX encoding,
/// [`has_avx_vnni`]) is not needed: AMD Zen 4 and Intel's Ice Lake and Cascade Lake
/// Xeons have AVX512-VNNI without it. They give the same bits as the AVX2 kernels
/// (tests compare every kernel with the reference).
pub fn has_avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            has_avx2_f16c()
                && std::env::var_os("FAK_NO_VNNI").is_none_or(|v| v != "1")
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
