//! Session files ([`fak_kv::persist`]): a session written and read back is the same
//! session bit for bit (ids, positions, every K, K before RoPE and V row), and its next
//! steps give the logits an uninterrupted session gives; a session with a shared
//! prefix, an eviction and a sliding window (gemma3) included. Files that are
//! truncated, padded, flipped in one byte, of another model or weight mode, of another
//! shape or version, or longer than allowed are refused, each with its own error.
//!
//! The witness is the uninterrupted session, itself tied to HF by `tests/tiny.rs` and
//! the proof ladder.

use fak_kv::persist::{self, ModelIdentity, PersistError};
use fak_kv::Session;
use fak_model::Model;
use std::path::PathBuf;
use std::sync::Arc;

fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata")
}

fn model(family: &str) -> Arc<Model> {
    Arc::new(Model::load(&testdata().join("tiny").join(family)).unwrap())
}

fn identity(family: &str) -> ModelIdentity {
    ModelIdentity {
        digest: persist::model_digest(&testdata().join("tiny").join(family)).unwrap(),
        weights: "exact".into(),
    }
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed ^ 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// A session that went through a shared prefix, a decode, and an eviction that
/// renumbers entries.
fn conversation(m: &Arc<Model>) -> Session {
    let vocab = m.config().vocab_size;
    let mut s = Session::new(Arc::clone(m));
    s.prefill(&ids(1, 40, vocab)).unwrap();
    s.freeze();
    let mut s = s.clone();
    s.prefill(&ids(2, 17, vocab)).unwrap();
    for &t in &ids(3, 5, vocab) {
        s.decode(t).unwrap();
    }
    s.evict(10, 4).unwrap();
    s.prefill(&ids(4, 3, vocab)).unwrap();
    s
}

fn bytes_of(s: &Session, id: &ModelIdentity, meta: &Vec<String>) -> Vec<u8> {
    let mut out = Vec::new();
    let n = persist::write_session(&mut out, s, id, meta).unwrap();
    assert_eq!(n as usize, out.len());
    out
}

fn read(
    bytes: &[u8],
    m: &Arc<Model>,
    id: &ModelIdentity,
) -> Result<(Session, Vec<String>), PersistError> {
    persist::read_session(&mut &bytes[..], m, id, usize::MAX, u64::MAX)
}

#[test]
fn a_session_read_back_continues_as_the_uninterrupted_one() {
    for family in ["llama-tied", "gemma3", "qwen3", "phi3"] {
        let m = model(family);
        let id = identity(family);
        let vocab = m.config().vocab_size;
        let s = conversation(&m);
        let meta = vec!["system".to_string(), "a turn".into()];
        let bytes = bytes_of(&s, &id, &meta);
        let (mut back, got_meta) = read(&bytes, &m, &id).unwrap();
        assert_eq!(got_meta, meta, "{family}");
        assert_eq!(back.ids(), s.ids(), "{family}");
        assert!(
            back.cache() == s.cache(),
            "{family}: the cache read back differs"
        );
        assert_eq!(
            back.cache().shared_len(),
            0,
            "{family}: a file holds its rows itself"
        );
        // The next turn: the same logits at every step as the uninterrupted session.
        let mut live = s.clone();
        let turn = ids(5, 9, vocab);
        assert!(same_bits(
            &live.prefill(&turn).unwrap(),
            &back.prefill(&turn).unwrap()
        ));
        for &t in &ids(6, 6, vocab) {
            let a = live.decode(t).unwrap().to_vec();
            assert!(same_bits(&a, back.decode(t).unwrap()), "{family}");
        }
        assert!(back.cache() == live.cache(), "{family}");
        // Control: a session one token different is seen as different.
        let mut other = s.clone();
        other.prefill(&[1]).unwrap();
        assert!(other.cache() != s.cache());
    }
}

#[test]
fn damaged_foreign_and_oversized_files_are_refused() {
    let m = model("llama-tied");
    let id = identity("llama-tied");
    let s = conversation(&m);
    let meta = vec!["x".to_string()];
    let good = bytes_of(&s, &id, &meta);
    assert!(read(&good, &m, &id).is_ok());

    // Truncated anywhere: in the magic, the header, the rows, the checksum.
    for cut in [3, 20, good.len() / 2, good.len() - 1] {
        let e = read(&good[..cut], &m, &id).expect_err("truncated file accepted");
        assert!(
            matches!(e, PersistError::Damaged(_) | PersistError::NotASessionFile),
            "cut at {cut}: {e}"
        );
    }
    // Padded.
    let mut padded = good.clone();
    padded.push(0);
    assert!(matches!(
        read(&padded, &m, &id),
        Err(PersistError::Damaged(_))
    ));
    // One bit flipped in a row (past the header).
    let mut flipped = good.clone();
    let at = good.len() - 100;
    flipped[at] ^= 1;
    let e = read(&flipped, &m, &id).err().unwrap();
    assert!(e.to_string().contains("checksum"), "{e}");
    // Not a session file; another version.
    let mut magic = good.clone();
    magic[0] = b'X';
    assert!(matches!(
        read(&magic, &m, &id),
        Err(PersistError::NotASessionFile)
    ));
    let mut version = good.clone();
    version[8] = 2;
    assert!(matches!(
        read(&version, &m, &id),
        Err(PersistError::Version { found: 2 })
    ));
    // Another model's digest, another weight mode.
    let other = ModelIdentity {
        digest: identity("qwen3").digest,
        weights: "exact".into(),
    };
    assert_ne!(other.digest, id.digest);
    assert!(matches!(
        read(&good, &m, &other),
        Err(PersistError::OtherModel { .. })
    ));
    let native = ModelIdentity {
        weights: "native".into(),
        ..id.clone()
    };
    assert!(matches!(
        read(&good, &m, &native),
        Err(PersistError::OtherModel { .. })
    ));
    // The right digest claimed for a model of another shape (qwen3's rows under
    // llama-tied's name): refused by shape.
    let q = model("qwen3");
    let qs = conversation(&q);
    let wrong = bytes_of(&qs, &id, &meta);
    let e = read(&wrong, &m, &id).err().unwrap();
    assert!(matches!(e, PersistError::Shape(_)), "{e}");
    // More tokens than the session may hold; more bytes than allowed.
    let e = persist::read_session::<Vec<String>>(&mut &good[..], &m, &id, s.len() - 1, u64::MAX)
        .err()
        .unwrap();
    assert!(matches!(e, PersistError::Shape(_)), "{e}");
    let e = persist::read_session::<Vec<String>>(
        &mut &good[..],
        &m,
        &id,
        usize::MAX,
        good.len() as u64 - 1,
    )
    .err()
    .unwrap();
    assert!(matches!(e, PersistError::Shape(_)), "{e}");
}

#[test]
fn a_saved_file_is_replaced_whole() {
    let m = model("llama-tied");
    let id = identity("llama-tied");
    let dir = std::env::temp_dir().join(format!("fak-persist-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("a.fakkv");
    let s = conversation(&m);
    let meta = vec!["one".to_string()];
    let n = persist::save_session(&path, &s, &id, &meta).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), n);
    let (back, got) =
        persist::load_session::<Vec<String>>(&path, &m, &id, usize::MAX, u64::MAX).unwrap();
    assert!(back.cache() == s.cache());
    assert_eq!(got, meta);
    // Refused before reading when the file is larger than allowed.
    let e = persist::load_session::<Vec<String>>(&path, &m, &id, usize::MAX, n - 1)
        .err()
        .unwrap();
    assert!(matches!(e, PersistError::Shape(_)), "{e}");
    // No temporary file is left behind.
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert_eq!(left.len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}
