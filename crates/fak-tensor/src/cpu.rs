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
//! other). One choice also follows the CPU family (the decode attention's prefetch
//! hint, which went opposite ways on an AMD Zen 4 and a Zen 5: [`amd_zen5_or_later`],
//! `FAK_CPU_FAMILY` overriding the family). Each choice's documentation says what it
//! does on each CPU and why; the figures are in `docs/performance.md` ("Why it is
//! fast").

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

/// Whether the choices for AMD's Zen 5 and later apply: [`tuned_for_amd`], and a CPU
/// family of 26 (`0x1A`, Zen 5) or more ([`family`]). Computed once per process.
#[inline]
pub fn amd_zen5_or_later() -> bool {
    static ZEN5: OnceLock<bool> = OnceLock::new();
    *ZEN5.get_or_init(|| tuned_for_amd() && family() >= 0x1A)
}

/// Whether the choices for AMD's CPU family 25 (`0x19`: Zen 3 and Zen 4; of them only
/// Zen 4 has the AVX-512 that the kernels asking this need) apply: [`tuned_for_amd`] and
/// [`family`] 25. Zen 4 runs a 512-bit instruction as two 256-bit halves, which moves
/// some kernels' best thresholds. Computed once per process.
#[inline]
pub fn amd_family_25() -> bool {
    static ZEN4: OnceLock<bool> = OnceLock::new();
    *ZEN4.get_or_init(|| tuned_for_amd() && family() == 0x19)
}

/// The CPU's family as AMD and Intel number it: `cpuid` leaf 1's base family (EAX bits
/// 8..12), plus its extended family (bits 20..28) when the base family is 15 (AMD64
/// Architecture Programmer's Manual, Vol. 3, "CPUID Fn0000_0001_EAX"; Intel SDM Vol. 2,
/// "CPUID"): 25 for AMD's Zen 3 and Zen 4, 26 for Zen 5, 6 for most Intel cores.
/// `FAK_CPU_FAMILY` (a decimal number) overrides it; 0 off x86_64.
pub fn family() -> u32 {
    if let Some(f) = std::env::var("FAK_CPU_FAMILY")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return f;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let eax = std::arch::x86_64::__cpuid(1).eax;
        let base = (eax >> 8) & 0xF;
        match base {
            0xF => base + ((eax >> 20) & 0xFF),
            _ => base,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
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

#[cfg(all(test, target_arch = "x86_64", target_os = "linux"))]
mod tests {
    /// `family` decodes `cpuid` as the Linux kernel does: the "cpu family" line of
    /// `/proc/cpuinfo` is the witness (unless `FAK_CPU_FAMILY` overrides it here).
    #[test]
    fn family_matches_the_kernels_cpu_family() {
        if std::env::var_os("FAK_CPU_FAMILY").is_some() {
            panic!("FAK_CPU_FAMILY is set: unset it to check cpuid's family");
        }
        let info = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
        let line = info
            .lines()
            .find(|l| l.starts_with("cpu family"))
            .expect("a cpu family line");
        let kernel: u32 = line.split(':').nth(1).unwrap().trim().parse().unwrap();
        assert_eq!(super::family(), kernel);
    }
}

/// Asks for the cache lines of `bytes` bytes from `start` to be brought into the core's
/// cache for writing (`prefetchw`), ahead of stores to them. A hint only: it never
/// faults, reads nothing into the program and changes no value, so any address is
/// harmless (one not yet backed by a page is simply not fetched). On CPUs that lack
/// the instruction it decodes as a no-op; elsewhere than x86_64 it does nothing.
///
/// Stores to lines not in the cache each wait for the line to be read first, and a run
/// of them (a KV cache row appended to memory last touched a step earlier) goes at
/// about one line per memory latency; fetched a little ahead, they overlap.
#[inline]
pub fn prefetch_for_write(start: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0};
        let mut b = 0;
        while b < bytes {
            // SAFETY: `prefetchw` never faults and never reads into the program,
            // whatever the address (formed with wrapping arithmetic, never dereferenced).
            unsafe { _mm_prefetch::<_MM_HINT_ET0>(start.wrapping_add(b) as *const i8) };
            b += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, bytes);
}
