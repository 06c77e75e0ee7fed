//! Write the tiny valid GGUF of the test suite's writer to a directory, as a seed
//! corpus for the `gguf_parse` fuzz target:
//!
//! `cargo run -p fak-weights --example gguf_fuzz_seed -- crates/fak-weights/fuzz/corpus/gguf_parse`

#[path = "../tests/common/mod.rs"]
mod common;

fn main() -> std::io::Result<()> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "crates/fak-weights/fuzz/corpus/gguf_parse".to_string());
    std::fs::create_dir_all(&dir)?;
    // One block of every known ggml type, filled with a byte pattern.
    let mut all_types = common::Builder::default().kv_str("general.architecture", "llama");
    for (i, t) in fak_weights::GgmlType::all().iter().enumerate() {
        let data = (0..t.type_size()).map(|j| (j * 37 + i) as u8).collect();
        all_types = all_types.tensor(
            &format!("blk.{i}.attn_q.weight"),
            &[t.block_size() as u64],
            t.id(),
            data,
        );
    }
    let seeds = [
        ("all_types.gguf", all_types.build()),
        ("tiny_valid.gguf", common::tiny_valid().build()),
        (
            "tiny_v2_aligned64.gguf",
            common::Builder {
                version: 2,
                ..common::Builder::default()
            }
            .alignment(64)
            .tensor("w", &[32], 2, vec![0x11; 18])
            .build(),
        ),
    ];
    for (name, bytes) in seeds {
        let path = std::path::Path::new(&dir).join(name);
        std::fs::write(&path, bytes)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
