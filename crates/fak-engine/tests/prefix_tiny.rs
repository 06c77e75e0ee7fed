//! The KV reuse cache on a tiny random Llama (committed under testdata/tiny): longest
//! prefix wins, a reused session continues exactly as a cold one, entries covered by a
//! longer one are dropped, the byte budget evicts the least recently used, and new
//! sessions reserve nothing up front.

use fak_engine::prefix::{start_session, PrefixCache};
use fak_kv::Session;
use fak_model::Model;
use std::path::PathBuf;
use std::sync::Arc;

fn model() -> Arc<Model> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/tiny/llama-tied");
    Arc::new(Model::load(&p).unwrap())
}

fn filled(empty: &Session, ids: &[u32]) -> Session {
    let mut s = empty.clone();
    s.prefill(ids).unwrap();
    s
}

#[test]
fn longest_prefix_wins_and_reuse_equals_cold() {
    let m = model();
    let empty = Session::new(Arc::clone(&m));
    let mut c = PrefixCache::new(usize::MAX);
    c.insert(filled(&empty, &[1, 2, 3, 4, 5, 6]), Vec::new());
    c.insert(filled(&empty, &[1, 2, 9]), Vec::new());
    let prompt = [1, 2, 3, 4, 7, 8];
    let hit = c.lookup(&prompt).unwrap();
    assert_eq!(hit.reuse, 4);
    let (mut warm, reused) = start_session(Some(hit), &empty).unwrap();
    assert_eq!(reused, 4);
    assert_eq!(warm.ids(), &[1, 2, 3, 4]);
    let before = warm.positions_computed();
    let warm_logits = warm.prefill(&prompt[reused..]).unwrap();
    let cold_logits = filled(&empty, &prompt).last_logits().unwrap().to_vec();
    assert_eq!(warm_logits, cold_logits, "reuse changed the logits");
    assert_eq!(warm.positions_computed() - before, 2, "only the suffix ran");
    // The whole prompt cached: its last token is left to run.
    assert_eq!(c.lookup(&[1, 2, 3, 4, 5, 6]).unwrap().reuse, 5);
    assert!(c.lookup(&[7, 7]).is_none());
}

#[test]
fn covered_entries_go_and_the_budget_evicts_lru() {
    let m = model();
    let empty = Session::new(Arc::clone(&m));
    let per_token = empty.cache().bytes_per_token();
    let mut c = PrefixCache::new(10 * per_token);
    c.insert(filled(&empty, &[1, 2, 3]), Vec::new());
    c.insert(filled(&empty, &[1, 2, 3, 4]), Vec::new()); // covers the first
    assert_eq!(c.len(), 1);
    c.insert(filled(&empty, &[1, 2]), Vec::new()); // covered by the kept one: not added
    assert_eq!(c.len(), 1);
    c.insert(filled(&empty, &[5, 6, 7]), Vec::new()); // 7 tokens in all
    assert_eq!(c.len(), 2);
    assert!(c.lookup(&[1, 2, 3, 4, 9]).is_some()); // [1,2,3,4] is now the most recent
    c.insert(filled(&empty, &[8, 9, 10, 11]), Vec::new()); // 11 > 10: the LRU entry [5,6,7] goes
    assert_eq!(c.len(), 2);
    assert!(c.lookup(&[5, 6, 7, 1]).is_none());
    assert!(c.lookup(&[1, 2, 3, 4, 9]).is_some());
    assert_eq!(c.bytes(), 8 * per_token);
    // Larger than the whole budget: not kept.
    c.insert(filled(&empty, &(20..40).collect::<Vec<u32>>()), Vec::new());
    assert_eq!(c.len(), 2);
    assert!(PrefixCache::new(0).is_empty());
}

#[test]
fn new_sessions_reserve_nothing_up_front() {
    let m = model();
    let empty = Session::new(Arc::clone(&m));
    assert!(empty.cache().bytes_reserved() > 0);
    let (fresh, reused) = start_session(None, &empty).unwrap();
    assert_eq!(reused, 0);
    assert_eq!(fresh.cache().bytes_reserved(), 0);
    assert_eq!(fresh.cache().capacity(), empty.cache().capacity());
}

/// A session kept in one partition is never found from another, even for the same
/// prompt; within its partition it is; a revocation reaches every partition.
#[test]
fn partitions_share_nothing_and_revocation_reaches_them_all() {
    use fak_engine::prefix::{Partition, Span};
    let m = model();
    let empty = Session::new(Arc::clone(&m));
    let (alice, bob) = (Partition::new("key:a"), Partition::new("key:b"));
    assert_ne!(alice, bob);
    assert_eq!(alice, Partition::new("key:a"));
    let mut c = PrefixCache::new(usize::MAX);
    let ids: Vec<u32> = (1..=12).collect();
    let span = |digest: &str| Span {
        digest: digest.into(),
        tool_call_id: None,
        start: 6,
    };
    c.insert_in(&alice, filled(&empty, &ids), vec![span("x")]);
    let prompt: Vec<u32> = (1..=10).chain([99]).collect();
    assert!(
        c.lookup_in(&bob, &prompt).is_none(),
        "read across partitions"
    );
    assert!(
        c.lookup(&prompt).is_none(),
        "the default partition is another"
    );
    assert_eq!(c.lookup_in(&alice, &prompt).unwrap().reuse, 10);
    // The same ids kept under two partitions are two entries.
    c.insert_in(&bob, filled(&empty, &ids), vec![span("x")]);
    assert_eq!(c.len(), 2);
    assert_eq!(c.lookup_in(&bob, &prompt).unwrap().reuse, 10);
    let r = c.revoke(&fak_engine::Revocation {
        digest: Some("x".into()),
        tool_call_id: None,
    });
    assert_eq!(r.sessions, 2);
    assert_eq!(c.lookup_in(&alice, &prompt).unwrap().reuse, 6);
    assert_eq!(c.lookup_in(&bob, &prompt).unwrap().reuse, 6);
}

/// Conversations that start with one system prompt, each kept after its request, hold
/// its KV once: every later one starts from a kept session's frozen cache, reads the
/// system prompt in place and continues exactly as a cold run.
#[test]
fn kept_conversations_on_one_system_prompt_hold_it_once() {
    let m = model();
    let empty = Session::new(Arc::clone(&m));
    let mut c = PrefixCache::new(usize::MAX);
    let system: Vec<u32> = (0..40).map(|i| 3 + (i * 7) % 50).collect();
    for i in 0..8u32 {
        let mut prompt = system.clone();
        prompt.extend([60 + i, 61 + i, 2 * i + 1]);
        let hit = c.lookup(&prompt);
        let (mut s, reused) = start_session(hit, &empty).unwrap();
        assert_eq!(reused, if i == 0 { 0 } else { system.len() }, "request {i}");
        let warm = s.prefill(&prompt[reused..]).unwrap();
        let cold = filled(&empty, &prompt);
        assert_eq!(warm, cold.last_logits().unwrap(), "request {i}: logits");
        assert_eq!(s.cache(), cold.cache(), "request {i}: cache");
        if i > 0 {
            assert_eq!(s.cache().shared_len(), system.len(), "request {i}");
        }
        c.insert(s, Vec::new());
    }
    assert_eq!(c.len(), 8);
    let per_token = empty.cache().bytes_per_token();
    let rows = per_token - 4;
    // Counted alone: 8 × 43 entries. Held: the system prompt once, then each
    // conversation's own 3 entries, and every session's positions.
    assert_eq!(c.bytes(), 8 * 43 * per_token);
    assert_eq!(c.bytes_held(), 43 * rows + 7 * 3 * rows + 8 * 43 * 4);
}

/// A request that shares only the first tokens of a long kept conversation starts from
/// a copy of those tokens, not a view that keeps the whole conversation's block alive:
/// long conversations evicted by the budget are freed though short ones that shared
/// their start stay kept, so the memory held stays within twice the budget's figure
/// (before: each short entry pinned a long block, and the held bytes grew with every
/// round while `bytes()` stayed under the budget).
#[test]
fn a_short_shared_prefix_does_not_pin_a_long_conversation() {
    let m = model();
    let empty = Session::new(Arc::clone(&m));
    let per_token = empty.cache().bytes_per_token();
    let mut c = PrefixCache::new(80 * per_token);
    let long = |i: u32| -> Vec<u32> {
        (0..50)
            .map(|k| {
                if k == 0 {
                    100 + i
                } else {
                    3 + (k * 7 + i) % 50
                }
            })
            .collect()
    };
    let short = |j: u32| vec![100 + j, 90, 91 + j % 3];
    for i in 0..8u32 {
        c.insert(filled(&empty, &long(i)), Vec::new());
        for j in 0..=i {
            let prompt = short(j);
            let (mut s, reused) = start_session(c.lookup(&prompt), &empty).unwrap();
            let warm = s.prefill(&prompt[reused..]).unwrap();
            let cold = filled(&empty, &prompt);
            assert_eq!(warm, cold.last_logits().unwrap(), "round {i}, request {j}");
            assert_eq!(s.cache(), cold.cache(), "round {i}, request {j}");
            if j == i {
                // The first time: the hit is the 50-token conversation, 1 entry shared.
                assert_eq!(reused, 1);
                assert_eq!(s.cache().shared_len(), 0, "a view of 1 entry of 50");
            }
            c.insert(s, Vec::new());
            assert!(
                c.bytes_held() <= 2 * c.bytes(),
                "round {i}, request {j}: {} held for {} counted",
                c.bytes_held(),
                c.bytes()
            );
        }
    }
    // Every long conversation but the newest was evicted; the short ones hold only
    // their own entries.
    assert!(c.bytes() <= 80 * per_token);
    assert!(
        c.bytes_held() <= c.bytes(),
        "{} > {}",
        c.bytes_held(),
        c.bytes()
    );
}
