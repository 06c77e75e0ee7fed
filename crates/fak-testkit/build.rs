//! Sets the cfgs the attributes read from the environment:
//!
//! - `fak_skip_real_model` when `FAK_SKIP_REAL_MODEL=1` and `CI` is not set
//!   (`#[real_model]` tests are ignored);
//! - `fak_no_avx512` / `fak_no_vnni` when `FAK_NO_AVX512=1` / `FAK_NO_VNNI=1`, which turn
//!   those kernels off in fak-tensor (`#[cpu]` tests of them are ignored).
//!
//! Cargo reruns this script, and rebuilds the tests that use the attributes, whenever
//! one of these variables changes, so the attributes never go stale.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(fak_skip_real_model)");
    println!("cargo::rustc-check-cfg=cfg(fak_no_avx512)");
    println!("cargo::rustc-check-cfg=cfg(fak_no_vnni)");
    for v in ["FAK_SKIP_REAL_MODEL", "CI", "FAK_NO_AVX512", "FAK_NO_VNNI"] {
        println!("cargo::rerun-if-env-changed={v}");
    }
    println!("cargo::rerun-if-changed=build.rs");
    let one = |v: &str| std::env::var(v).as_deref() == Ok("1");
    if one("FAK_SKIP_REAL_MODEL") && std::env::var_os("CI").is_none() {
        println!("cargo::rustc-cfg=fak_skip_real_model");
    }
    if one("FAK_NO_AVX512") {
        println!("cargo::rustc-cfg=fak_no_avx512");
    }
    if one("FAK_NO_VNNI") {
        println!("cargo::rustc-cfg=fak_no_vnni");
    }
}
