//! Choices that depend on which CPU runs the kernels, not on what it can execute.
//!
//! Instruction sets are detected where each kernel is chosen
//! (`is_x86_feature_detected!`). Some choices that give the same bits either way (a
//! prefetch hint, how many weight rows one f32 kernel call streams side by side, how a
//! one-token product's rows are shared between two threads) were measured to go
//! opposite ways on an AMD Zen 5 and an Intel Xeon. Those choices follow the CPU's
//! vendor, read once from `cpuid`; `FAK_CPU_VENDOR=AuthenticAMD|GenuineIntel|…`
//! overrides it for every choice that follows it (to measure one CPU's choices on the
//! other). Each choice's documentation says what it does on each vendor and why; the
//! figures are in `docs/performance.md` ("Why it is fast").

use std::sync::OnceLock;

/// Whether the choices for AMD CPUs apply: `cpuid`'s vendor string is "AuthenticAMD",
/// or `FAK_CPU_VENDOR` says so. Computed once per process.
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
