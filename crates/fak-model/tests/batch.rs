//! Batch invariance (docs/architecture.md, DESIGN's invariant 5): a sequence run in a
//! batch with others ([`Model::forward_batch`]) gets the logits and K/V rows of its run
//! alone, bit for bit, whatever shares the batch: 16 sequences of different prompt
//! lengths, joining and leaving at different steps, prefill chunks beside decode
//! tokens, different logits wanted (all rows, the last, a head restricted to some
//! rows), on every tiny family (Gemma 3's sliding window of 4 included), and on the
//! real SmolLM2 (exact f32 and native Q4_1) and Gemma 3 (native Q4_K_M), with 1 and 2
//! threads and with passes small enough that a batch is split.
//!
//! The witness is the solo run of each sequence: [`Model::forward_into`] over its own
//! cache, which `tiny_oracle.rs` proves against HF (exact path) and `native.rs` /
//! `native_gemma3.rs` tie to the exact path's invariants (native).

mod common;
use common::*;
use fak_model::{BatchSeq, ForwardScratch, KvStore, LogitsWanted, Model, VecKvCache, WeightMode};
use fak_tensor::Threads;

/// One sequence's schedule: its tokens, the sizes of its passes (a prompt chunk or
/// more, then decode tokens of 1), the batch step it joins at, and what it wants.
struct Plan {
    ids: Vec<u32>,
    chunks: Vec<usize>,
    join: usize,
    want: LogitsWanted,
    head_rows: Option<Vec<u32>>,
}

/// 16 schedules over a vocabulary of `vocab`: prompts of 1 to 23 tokens (some in two
/// chunks), 3 to 7 decode tokens, joining at steps 0 to 3.
fn plans(vocab: usize) -> Vec<Plan> {
    let mut seed = 0x2545_f491_u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((seed >> 33) % vocab as u64) as u32
    };
    (0..16)
        .map(|i| {
            let prompt = 1 + (i * 7) % 23;
            let decode = 3 + i % 5;
            let mut chunks = if i % 4 == 1 && prompt > 2 {
                vec![prompt / 2, prompt - prompt / 2]
            } else {
                vec![prompt]
            };
            chunks.extend(std::iter::repeat_n(1, decode));
            let ids = (0..prompt + decode).map(|_| next()).collect();
            let (want, head_rows) = match i % 4 {
                0 => (LogitsWanted::All, None),
                3 => (LogitsWanted::Last, Some(vec![0, 5, (vocab - 1) as u32, 17])),
                2 if i % 8 == 2 => (LogitsWanted::None, None),
                _ => (LogitsWanted::Last, None),
            };
            Plan {
                ids,
                chunks,
                join: i % 4,
                want,
                head_rows,
            }
        })
        .collect()
}

/// Each pass's logits and the final cache of one sequence.
struct Run {
    logits: Vec<Vec<f32>>,
    kv: VecKvCache,
}

fn new_cache(m: &Model, p: &Plan) -> VecKvCache {
    VecKvCache::new(m.config().num_hidden_layers, p.ids.len())
}

/// `p` alone: one [`Model::forward_into`] (or `forward_rows_into`) per chunk.
fn solo(m: &Model, p: &Plan) -> Run {
    let mut kv = new_cache(m, p);
    let mut scratch = ForwardScratch::new();
    let mut logits = Vec::new();
    let mut at = 0;
    for &n in &p.chunks {
        let pos: Vec<u32> = (at as u32..(at + n) as u32).collect();
        let ids = &p.ids[at..at + n];
        let mut out = Vec::new();
        match &p.head_rows {
            Some(rows) => m.forward_rows_into(ids, &pos, &mut kv, rows, &mut scratch, &mut out),
            None => m.forward_into(ids, &pos, &mut kv, p.want, None, &mut scratch, &mut out),
        }
        .unwrap();
        let rows = match p.want {
            LogitsWanted::None => 0,
            LogitsWanted::Last => 1,
            LogitsWanted::All => n,
        };
        assert_eq!(out.len(), rows * m.config().vocab_size);
        logits.push(out);
        at += n;
    }
    Run { logits, kv }
}

/// Every plan through [`Model::forward_batch`]: at step `t`, each plan that has joined
/// and not finished contributes its next chunk.
fn batched(m: &Model, plans: &[Plan]) -> Vec<Run> {
    let mut runs: Vec<Run> = plans
        .iter()
        .map(|p| Run {
            logits: Vec::new(),
            kv: new_cache(m, p),
        })
        .collect();
    let mut scratch = ForwardScratch::new();
    let mut at = vec![0usize; plans.len()];
    let steps = plans.iter().map(|p| p.join + p.chunks.len()).max().unwrap();
    for t in 0..steps {
        let active: Vec<usize> = (0..plans.len())
            .filter(|&i| t >= plans[i].join && t - plans[i].join < plans[i].chunks.len())
            .collect();
        let positions: Vec<Vec<u32>> = active
            .iter()
            .map(|&i| {
                let n = plans[i].chunks[t - plans[i].join];
                (at[i] as u32..(at[i] + n) as u32).collect()
            })
            .collect();
        let mut outs: Vec<Vec<f32>> = vec![vec![f32::NAN; 3]; active.len()];
        let mut kvs: Vec<&mut VecKvCache> = Vec::new();
        let mut rest = &mut runs[..];
        let mut taken = 0;
        for &i in &active {
            let (head, tail) = rest.split_at_mut(i - taken + 1);
            kvs.push(&mut head[i - taken].kv);
            rest = tail;
            taken = i + 1;
        }
        let mut seqs: Vec<BatchSeq<'_>> = active
            .iter()
            .zip(kvs)
            .zip(outs.iter_mut())
            .zip(&positions)
            .map(|(((&i, kv), logits), pos)| {
                let p = &plans[i];
                BatchSeq {
                    ids: &p.ids[at[i]..at[i] + pos.len()],
                    positions: pos,
                    kv,
                    want: p.want,
                    head_rows: p.head_rows.as_deref(),
                    logits,
                }
            })
            .collect();
        for r in m.forward_batch(&mut seqs, &mut scratch) {
            r.unwrap();
        }
        drop(seqs);
        for (j, &i) in active.iter().enumerate() {
            runs[i].logits.push(std::mem::take(&mut outs[j]));
            at[i] += positions[j].len();
        }
    }
    runs
}

/// Every plan's batched run equals its solo run: each pass's logits and the cache's K,
/// pre-RoPE K and V rows of every layer, bit for bit.
fn assert_batch_invariant(m: &mut Model, label: &str) {
    let vocab = m.config().vocab_size;
    let plans = plans(vocab);
    m.set_threads(Threads::new(1));
    let want: Vec<Run> = plans.iter().map(|p| solo(m, p)).collect();
    let default_chunk = m.prefill_chunk();
    for (threads, chunk) in [(1, default_chunk), (2, default_chunk), (2, 16)] {
        m.set_threads(Threads::new(threads));
        m.set_prefill_chunk(chunk);
        let got = batched(m, &plans);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            let at = format!("{label}, {threads} thread(s), passes of {chunk}: sequence {i}");
            assert_eq!(w.logits.len(), g.logits.len(), "{at}: passes");
            for (k, (a, b)) in w.logits.iter().zip(&g.logits).enumerate() {
                assert!(
                    same_bits(a, b),
                    "{at}, pass {k}: logits differ from the solo run"
                );
            }
            for l in 0..m.config().num_hidden_layers {
                assert!(
                    same_bits(&w.kv.keys(l).to_vec(), &g.kv.keys(l).to_vec())
                        && same_bits(w.kv.keys_raw(l), g.kv.keys_raw(l))
                        && same_bits(&w.kv.values(l).to_vec(), &g.kv.values(l).to_vec()),
                    "{at}: layer {l}'s K/V rows differ from the solo run"
                );
            }
            assert_eq!(w.kv.positions(), g.kv.positions(), "{at}: positions");
        }
    }
    m.set_prefill_chunk(default_chunk);
}

#[test]
fn batched_steps_equal_solo_runs_on_every_tiny_family() {
    for family in [
        "llama-tied",
        "llama-untied",
        "qwen2",
        "qwen3",
        "gemma3",
        "olmo2",
        "phi3",
    ] {
        let mut m = Model::load(&testdata().join("tiny").join(family)).unwrap();
        assert_batch_invariant(&mut m, family);
    }
}

/// The control: the assertion sees a difference when a sequence's batch neighbour
/// leaks into it. Two sequences whose caches are swapped between passes no longer
/// equal their solo runs.
#[test]
fn a_cache_from_another_sequence_is_seen() {
    let m = Model::load(&testdata().join("tiny").join("llama-tied")).unwrap();
    let plans = plans(m.config().vocab_size);
    let (a, b) = (&plans[6], &plans[8]);
    assert_eq!((a.want, a.chunks[1]), (LogitsWanted::Last, 1));
    let want = solo(&m, a);
    // a's first pass, then its first decode token over b's cache.
    let mut scratch = ForwardScratch::new();
    let mut kv_b = VecKvCache::new(m.config().num_hidden_layers, 64);
    let nb = b.chunks[0];
    let pos: Vec<u32> = (0..nb as u32).collect();
    m.forward(&b.ids[..nb], &pos, &mut kv_b, LogitsWanted::None, None)
        .unwrap();
    let n = a.chunks[0];
    let mut kv_a = new_cache(&m, a);
    let pos: Vec<u32> = (0..n as u32).collect();
    let mut first = Vec::new();
    m.forward_into(
        &a.ids[..n],
        &pos,
        &mut kv_a,
        a.want,
        None,
        &mut scratch,
        &mut first,
    )
    .unwrap();
    assert!(same_bits(&first, &want.logits[0]));
    let next = kv_b.positions().last().unwrap() + 1;
    let mut out = Vec::new();
    let mut seqs = [BatchSeq {
        ids: &a.ids[n..n + 1],
        positions: &[next],
        kv: &mut kv_b,
        want: LogitsWanted::Last,
        head_rows: None,
        logits: &mut out,
    }];
    m.forward_batch(&mut seqs, &mut scratch)[0]
        .as_ref()
        .unwrap();
    assert!(!same_bits(&out, &want.logits[1]));
}

#[fak_testkit::real_model]
fn batched_steps_equal_solo_runs_on_smollm2_exact_and_native() {
    for mode in [WeightMode::Exact, WeightMode::Native] {
        let mut m = Model::load_with(&smollm2_path(), mode).expect("load SmolLM2");
        assert_batch_invariant(&mut m, &format!("SmolLM2 {mode:?}"));
    }
}

#[fak_testkit::real_model]
fn batched_steps_equal_solo_runs_on_gemma3_native() {
    let mut m =
        Model::load_with(&real_model("gemma3-270m"), WeightMode::Native).expect("load Gemma 3");
    assert_batch_invariant(&mut m, "Gemma 3 native");
}
