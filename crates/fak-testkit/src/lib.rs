//! fak's test attributes. A test that cannot run here is reported as **ignored** in
//! libtest's summary line (`N passed; N failed; N ignored`), never as passed.
//!
//! - [`macro@real_model`]: a test that needs a real model file from the model cache. With
//!   `FAK_SKIP_REAL_MODEL=1` (and `CI` unset) it is compiled as `#[ignore]`d; otherwise it
//!   runs, and a missing file fails it with the command that fetches it
//!   (`fak_catalog::require_cached`). `cargo test -- --include-ignored` runs it
//!   anyway.
//! - [`macro@cpu`]: a test of a SIMD kernel that needs CPU features; on a CPU without one
//!   of them it is compiled as `#[ignore]`d, naming the missing features.
//!
//! Both expand to `#[test]` (plus `#[ignore = "why"]` when the test cannot run) followed
//! by the function unchanged, so they replace `#[test]` and combine with the other test
//! attributes.
//!
//! The skip decision is made when the test is compiled. For `FAK_SKIP_REAL_MODEL` the
//! build script makes cargo rebuild on every change of the variable (and of `CI`), so it
//! is never stale. CPU features are detected on the machine that compiles the test (the
//! one `cargo test` runs on); a test binary moved to a CPU with fewer features would run
//! the test, so a test marked [`macro@cpu`] also asserts the features at run time and
//! fails rather than falling back silently.

use proc_macro::{Delimiter, TokenStream, TokenTree};

/// The attributes put before the test function: `#[test]`, and `#[ignore = "<why>"]` when
/// `why` is given.
fn test_attrs(why: Option<String>, item: TokenStream) -> TokenStream {
    let mut head = String::from("#[test]");
    if let Some(why) = why {
        head.push_str(&format!(" #[ignore = {why:?}]"));
    }
    let mut out: TokenStream = head.parse().expect("valid attribute tokens");
    out.extend(item);
    out
}

fn compile_error(msg: &str) -> TokenStream {
    format!("compile_error!({msg:?});")
        .parse()
        .expect("valid compile_error tokens")
}

/// Marks a test that needs a real model (SmolLM2, Gemma 3) from the model cache; use it
/// in place of `#[test]`.
///
/// With `FAK_SKIP_REAL_MODEL=1` set when the test is built and run (and `CI` unset), the
/// test is ignored with that reason; otherwise it is a plain `#[test]`. Takes no
/// arguments (a compile error otherwise).
#[proc_macro_attribute]
pub fn real_model(attr: TokenStream, item: TokenStream) -> TokenStream {
    if !attr.is_empty() {
        return compile_error("#[real_model] takes no arguments");
    }
    let why = cfg!(fak_skip_real_model).then(|| {
        "FAK_SKIP_REAL_MODEL=1: needs a real model (fetch it with `cargo run --release -p \
         fak-cli -- model pull <name>`, unset the variable or pass --include-ignored)"
            .to_string()
    });
    test_attrs(why, item)
}

/// Whether the compiling CPU has x86 feature `name`: `Some(bool)` for the names fak's
/// kernels use, `None` for a name this attribute does not know. Always `Some(false)`
/// off x86-64.
fn detected(name: &str) -> Option<bool> {
    #[cfg(target_arch = "x86_64")]
    {
        Some(match name {
            "avx2" => std::is_x86_feature_detected!("avx2"),
            "fma" => std::is_x86_feature_detected!("fma"),
            "f16c" => std::is_x86_feature_detected!("f16c"),
            "avxvnni" => std::is_x86_feature_detected!("avxvnni"),
            "avx512f" => std::is_x86_feature_detected!("avx512f"),
            "avx512bw" => std::is_x86_feature_detected!("avx512bw"),
            "avx512dq" => std::is_x86_feature_detected!("avx512dq"),
            "avx512vl" => std::is_x86_feature_detected!("avx512vl"),
            "avx512vnni" => std::is_x86_feature_detected!("avx512vnni"),
            _ => return None,
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        [
            "avx2",
            "fma",
            "f16c",
            "avxvnni",
            "avx512f",
            "avx512bw",
            "avx512dq",
            "avx512vl",
            "avx512vnni",
        ]
        .contains(&name)
        .then_some(false)
    }
}

/// Marks a test that needs the x86 features named in its argument, a comma-separated list
/// of string literals (`#[cpu("avx512f", "avx512bw")]`; names as in
/// `is_x86_feature_detected!`: avx2, fma, f16c, avxvnni, avx512f, avx512bw, avx512dq,
/// avx512vl, avx512vnni); use it in place of `#[test]`.
///
/// On a CPU that lacks any of them (and on every other architecture) the test is ignored,
/// naming the missing features; so it is when `FAK_NO_AVX512=1` (for an `avx512*` name)
/// or `FAK_NO_VNNI=1` (for a `*vnni` name) turns that path off in fak-tensor; otherwise
/// it is a plain `#[test]`. An unknown name or an empty list is a compile error.
#[proc_macro_attribute]
pub fn cpu(attr: TokenStream, item: TokenStream) -> TokenStream {
    let mut names = Vec::new();
    for t in attr {
        match t {
            TokenTree::Literal(l) => {
                let s = l.to_string();
                match s.strip_prefix('"').and_then(|s| s.strip_suffix('"')) {
                    Some(n) => names.push(n.to_string()),
                    None => return compile_error("#[cpu] takes string literals"),
                }
            }
            TokenTree::Punct(p) if p.as_char() == ',' => {}
            TokenTree::Group(g) if g.delimiter() == Delimiter::None => {
                return cpu(g.stream(), item);
            }
            _ => return compile_error("#[cpu] takes string literals separated by commas"),
        }
    }
    if names.is_empty() {
        return compile_error("#[cpu] needs at least one feature name");
    }
    let mut missing = Vec::new();
    let mut off = Vec::new();
    for n in &names {
        match detected(n) {
            Some(true) => {}
            Some(false) => missing.push(n.as_str()),
            None => return compile_error(&format!("#[cpu]: unknown feature name {n:?}")),
        }
        if cfg!(fak_no_avx512) && n.starts_with("avx512") && !off.contains(&"FAK_NO_AVX512=1") {
            off.push("FAK_NO_AVX512=1");
        }
        if cfg!(fak_no_vnni) && n.ends_with("vnni") && !off.contains(&"FAK_NO_VNNI=1") {
            off.push("FAK_NO_VNNI=1");
        }
    }
    let why = if !missing.is_empty() {
        Some(format!(
            "this CPU lacks {} (the test's SIMD path)",
            missing.join(", ")
        ))
    } else if !off.is_empty() {
        Some(format!(
            "{} turns the test's SIMD path off",
            off.join(" and ")
        ))
    } else {
        None
    };
    test_attrs(why, item)
}
