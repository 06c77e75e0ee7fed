//! The fast path (`WeightMode::Native`): its own invariants bit for bit, and its
//! distance from the exact path measured on the real SmolLM2-135M-Instruct (Q4_1
//! matrices, Q8_0 tied embedding). The model file comes from
//! `fak model pull smollm2-135m-instruct`; without it these tests fail with that
//! command (see `common::smollm2_path`).

mod common;
use common::*;
use fak_model::{load_text, KvStore, LogitsWanted, Model, VecKvCache, WeightMode};
use fak_tensor::Threads;
use std::sync::OnceLock;

fn native() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| Model::load_with(&smollm2_path(), WeightMode::Native).expect("load SmolLM2"))
}

const PROMPT: [u32; 12] = [1, 504, 3575, 282, 4649, 314, 7042, 30, 198, 504, 2988, 314];

#[fak_testkit::real_model]
fn native_keeps_the_matrices_quantized() {
    let m = native();
    assert_eq!(m.weight_mode(), WeightMode::Native);
    // 30 layers × 7 Q4_1 matrices, and the tied Q8_0 embedding that is also the head.
    assert_eq!(m.quantized_types(), vec![("Q4_1", 210), ("Q8_0", 1)]);
    // What it reads per token is the file's matrices, not their f32 copies
    // (134.5 M parameters would be 538 MB in f32).
    let mb = m.weight_bytes() as f64 / 1e6;
    println!("native weight bytes: {mb:.1} MB");
    assert!(mb < 120.0, "{mb} MB");
    // All of it copied at load into the model's huge pages (the embedding repacked to
    // its size), none read from the map.
    let matrices = file_matrix_bytes(&smollm2_path());
    assert_eq!(m.copied_weight_bytes(), matrices);
    assert_eq!(m.weight_bytes(), m.owned_weight_bytes());
}

#[fak_testkit::real_model]
fn native_decode_equals_prefill_bitwise() {
    let m = native();
    let full = run_in_chunks(m, &PROMPT, &[PROMPT.len()]);
    let steps = run_in_chunks(m, &PROMPT, &[1; PROMPT.len()]);
    let mixed = run_in_chunks(m, &PROMPT, &[5, 1, 4, 2]);
    assert!(same_bits(&full, &steps), "prefill != token-by-token decode");
    assert!(same_bits(&full, &mixed), "prefill != chunked prefill");
}

/// [`PROMPT`] four times over: 48 tokens, enough for the many-token paths (the
/// 16-token prefill tiles, activations quantized and the gated activation split between
/// threads, full 4-token attention blocks).
fn long_prompt() -> Vec<u32> {
    PROMPT.repeat(4)
}

#[fak_testkit::real_model]
fn native_long_prefill_equals_decode_bitwise() {
    let m = native();
    let ids = long_prompt();
    let full = run_in_chunks(m, &ids, &[ids.len()]);
    let steps = run_in_chunks(m, &ids, &vec![1; ids.len()]);
    let mixed = run_in_chunks(m, &ids, &[17, 1, 30]);
    assert!(same_bits(&full, &steps), "prefill != token-by-token decode");
    assert!(same_bits(&full, &mixed), "prefill != chunked prefill");
}

/// A [`VecKvCache`] that records how many tokens each batch of a pass appended.
struct CountingKv {
    kv: VecKvCache,
    batches: Vec<usize>,
}

impl KvStore for CountingKv {
    fn len(&self) -> usize {
        self.kv.len()
    }
    fn positions(&self) -> &[u32] {
        self.kv.positions()
    }
    fn capacity_tokens(&self) -> usize {
        self.kv.capacity_tokens()
    }
    fn append_positions(&mut self, pos: &[u32]) {
        self.batches.push(pos.len());
        self.kv.append_positions(pos)
    }
    fn append_layer(&mut self, layer: usize, k_raw: &[f32], k: &[f32], v: &[f32]) {
        self.kv.append_layer(layer, k_raw, k, v)
    }
    fn keys(&self, layer: usize) -> fak_model::KvRows<'_> {
        self.kv.keys(layer)
    }
    fn values(&self, layer: usize) -> fak_model::KvRows<'_> {
        self.kv.values(layer)
    }
}

/// One `forward` call over `ids` on a fresh cache: every row's logits, then (a second
/// call) the last row's alone, the cache it leaves and the batches it ran in.
fn one_call(m: &Model, ids: &[u32]) -> (Vec<f32>, Vec<f32>, CountingKv) {
    let layers = m.config().num_hidden_layers;
    let pos: Vec<u32> = (0..ids.len() as u32).collect();
    let fresh = || CountingKv {
        kv: VecKvCache::new(layers, ids.len()),
        batches: Vec::new(),
    };
    let mut kv = fresh();
    let all = m
        .forward(ids, &pos, &mut kv, LogitsWanted::All, None)
        .unwrap();
    let mut kv = fresh();
    let last = m
        .forward(ids, &pos, &mut kv, LogitsWanted::Last, None)
        .unwrap();
    (all, last, kv)
}

/// A pass longer than the model's prefill chunk runs as consecutive batches inside one
/// `forward` call: the same logits (every row, and the last alone) and the same K, K
/// before RoPE and V rows as one batch, on both weight paths, with full causal
/// attention and with a 5-token sliding window (so windows start inside earlier batches).
#[fak_testkit::real_model]
fn a_pass_split_into_prefill_chunks_is_the_bits_of_one_batch() {
    let p = smollm2_path();
    let ids = long_prompt();
    for mode in [WeightMode::Native, WeightMode::Exact] {
        for window in [None, Some(5)] {
            let mut m = Model::load_with(&p, mode).unwrap();
            let layers = m.config().num_hidden_layers;
            m.set_sliding_windows(vec![window; layers]).unwrap();
            assert!(
                m.prefill_chunk() >= ids.len(),
                "the reference must be one batch"
            );
            let (all, last, kv) = one_call(&m, &ids);
            assert_eq!(kv.batches, [ids.len()]);
            assert_eq!(last.len(), m.config().vocab_size);
            for chunk in [1usize, 7, 16, 47] {
                m.set_prefill_chunk(chunk);
                let (a, l, k) = one_call(&m, &ids);
                let at = format!("{mode:?}, window {window:?}, batches of {chunk}");
                let mut want = vec![chunk; ids.len() / chunk];
                if !ids.len().is_multiple_of(chunk) {
                    want.push(ids.len() % chunk);
                }
                assert_eq!(k.batches, want, "{at}: the batches run");
                assert!(same_bits(&all, &a), "{at}: every row's logits");
                assert!(same_bits(&last, &l), "{at}: the last row's");
                let (k, kv) = (&k.kv, &kv.kv);
                assert_eq!(k.positions(), kv.positions());
                for layer in 0..layers {
                    assert!(
                        same_bits(&k.keys(layer).to_vec(), &kv.keys(layer).to_vec()),
                        "{at}: K {layer}"
                    );
                    let raw = (k.keys_raw(layer), kv.keys_raw(layer));
                    assert!(same_bits(raw.0, raw.1), "{at}: K before RoPE {layer}");
                    assert!(
                        same_bits(&k.values(layer).to_vec(), &kv.values(layer).to_vec()),
                        "{at}: V {layer}"
                    );
                }
            }
        }
    }
}

#[fak_testkit::real_model]
fn native_is_bit_identical_for_any_thread_count() {
    let p = smollm2_path();
    let mut m = Model::load_with(&p, WeightMode::Native).unwrap();
    let long = long_prompt();
    m.set_threads(Threads::new(1));
    let one = run_in_chunks(&m, &PROMPT, &[7, 5]);
    let one_long = run_in_chunks(&m, &long, &[long.len()]);
    for th in [2usize, 3] {
        m.set_threads(Threads::new(th));
        let got = run_in_chunks(&m, &PROMPT, &[7, 5]);
        assert!(same_bits(&one, &got), "{th} threads differ from 1");
        let got = run_in_chunks(&m, &long, &[long.len()]);
        assert!(
            same_bits(&one_long, &got),
            "{th} threads differ from 1 (48 tokens)"
        );
    }
}

/// A thread count so large that four times it overflows (`Threads` takes any count and
/// caps it per product) runs, on both paths, with the bits of one thread.
#[fak_testkit::real_model]
fn a_huge_thread_count_is_the_bits_of_one_thread() {
    let p = smollm2_path();
    let long = long_prompt();
    for mode in [WeightMode::Native, WeightMode::Exact] {
        let mut m = Model::load_with(&p, mode).unwrap();
        m.set_threads(Threads::new(1));
        let one = run_in_chunks(&m, &long, &[long.len()]);
        for th in [1usize << 62, usize::MAX] {
            m.set_threads(Threads::new(th));
            let got = run_in_chunks(&m, &long, &[long.len()]);
            assert!(same_bits(&one, &got), "{mode:?}, {th} threads");
        }
    }
}

#[test]
fn native_on_f32_weights_is_the_exact_path() {
    // A safetensors model has no block-format matrices: native mode keeps every
    // weight f32 and must give the exact path's bits.
    let dir = testdata().join("tiny/llama-tied");
    let exact = Model::load(&dir).unwrap();
    let native = Model::load_with(&dir, WeightMode::Native).unwrap();
    assert!(native.quantized_types().is_empty());
    let ids = [1u32, 7, 42, 99, 3];
    assert!(same_bits(
        &run_in_chunks(&exact, &ids, &[5]),
        &run_in_chunks(&native, &ids, &[5])
    ));
}

/// Teacher forcing over the public-domain text of `testdata/quality/` (2,419 SmolLM2
/// tokens, one prefill per path): how far the native path is from the exact one.
#[fak_testkit::real_model]
fn native_agrees_with_exact_teacher_forced() {
    let p = smollm2_path();
    let native = native();
    let exact = Model::load(&p).unwrap();
    let (tok, _) = load_text(&p, exact.config()).unwrap();
    let ids = tok.encode_prompt(&quality_text()).unwrap();
    assert!(ids.len() >= 2000, "{} tokens", ids.len());
    let q = teacher_forced(&exact, native, &ids, 256);
    let (n, top1) = (q.n, q.top1());
    println!(
        "SmolLM2 native vs exact, {n} teacher-forced positions: top-1 agreement {top1:.4} ({}/{n}), \
         mean KL(exact || native) {:.5} nats, max KL {:.4}, max |Δlogit| {:.3} \
         (forward passes: exact {:.1} s, native {:.1} s)",
        q.agree, q.kl_mean, q.kl_max, q.max_abs, q.secs_exact, q.secs_native
    );
    // The native path really ran (quantized activations change the logits) ...
    assert!(
        q.max_abs > 0.0,
        "native logits equal exact ones: no quantized product ran"
    );
    // ... and stays close to the exact one. Floors from the measured figures (0.9636,
    // 0.00269, 0.0602 nats; 0.9665, 0.00272, 0.0467 before the block-sum order) with
    // margin; a regression must not be met by widening them.
    assert!(top1 >= 0.95, "top-1 agreement {top1}");
    assert!(q.kl_mean <= 0.005, "mean KL {}", q.kl_mean);
    assert!(q.kl_max <= 0.15, "max KL {}", q.kl_max);
}

/// The tied Q8_0 embedding of the real SmolLM2 repacked in groups of 16 rows (what a
/// native load does on a CPU with AVX-512 VNNI; 49,152 rows) gives the file's blocks' bits: every row's
/// embedding lookup, the full head for 1 and 8 tokens of real hidden states on 1 and 2
/// threads, and single rows. Without AVX-512 VNNI nothing is repacked, and the test
/// says so and checks that.
#[fak_testkit::real_model]
fn the_repacked_embedding_gives_the_file_blocks_bits() {
    use fak_tensor::quant::{self, QType};
    let (src, cfg) = fak_model::WeightSource::open(&smollm2_path()).unwrap();
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    let file = src
        .quantized("model.embed_tokens.weight", [v, h], &cfg)
        .unwrap()
        .unwrap();
    assert_eq!(file.ty, QType::Q8_0);
    let packed = file.clone().repacked_for_cpu();
    if !quant::has_avx512_vnni() {
        println!("no AVX-512 VNNI: the matrix is copied as the file has it");
        assert!(packed.is_copied() && packed.ty == QType::Q8_0);
        assert!(packed.bytes() == file.bytes());
        return;
    }
    assert!(packed.is_copied() && packed.ty == QType::Q8_0R16);
    assert_eq!(packed.bytes().len(), file.bytes().len());
    let (mut a, mut b) = (vec![0f32; h], vec![0f32; h]);
    for r in (0..v).step_by(97).chain([v - 1]) {
        file.dequantize_row(r, &mut a).unwrap();
        packed.dequantize_row(r, &mut b).unwrap();
        assert!(same_bits(&a, &b), "embedding row {r}");
    }
    // Real hidden states: the final-norm rows of a prompt's tokens (any rows would do;
    // these have the spread a head sees).
    let xs: Vec<Vec<f32>> = PROMPT[..8]
        .iter()
        .map(|&t| {
            let mut e = vec![0f32; h];
            file.dequantize_row(t as usize, &mut e).unwrap();
            e
        })
        .collect();
    let acts: Vec<_> = xs
        .iter()
        .map(|x| quant::quantize_activation(QType::Q8_0, x).unwrap())
        .collect();
    for threads in [1, 2] {
        let th = Threads::new(threads);
        for n in [1usize, 8] {
            let mut want = vec![0f32; n * v];
            let mut got = vec![f32::NAN; n * v];
            quant::matmul_threads(QType::Q8_0, file.bytes(), &acts[..n], &mut want, th).unwrap();
            quant::matmul_threads(packed.ty, packed.bytes(), &acts[..n], &mut got, th).unwrap();
            assert!(same_bits(&want, &got), "{n} tokens, {threads} threads");
        }
        let mut want = vec![0f32; v];
        let mut got = vec![f32::NAN; v];
        quant::matvec_threads(QType::Q8_0, file.bytes(), &acts[0], &mut want, th).unwrap();
        quant::matvec_threads(packed.ty, packed.bytes(), &acts[0], &mut got, th).unwrap();
        assert!(same_bits(&want, &got), "one token, {threads} threads");
        for r in (0..v).step_by(1013) {
            assert_eq!(
                packed.dot_row(r, &acts[0]).unwrap().to_bits(),
                want[r].to_bits(),
                "row {r}"
            );
        }
    }
}

/// Every Q4_1 layer matrix of the real SmolLM2 repacked in groups of 16 rows (what a
/// native load does on a CPU with AVX-512 VNNI) gives the file's blocks' bits: its
/// products for 1, 3, 8 and 20 tokens of real activations on 1 and 2 threads, single
/// rows, and dequantized rows. Without AVX-512 VNNI nothing is repacked, and the test
/// says so and checks that.
#[fak_testkit::real_model]
fn the_repacked_q4_1_layers_give_the_file_blocks_bits() {
    use fak_tensor::quant::{self, QType};
    let (src, cfg) = fak_model::WeightSource::open(&smollm2_path()).unwrap();
    let h = cfg.hidden_size;
    // Real activations: embedding rows of a prompt's tokens, each tiled to the width.
    let embed = src
        .quantized("model.embed_tokens.weight", [cfg.vocab_size, h], &cfg)
        .unwrap()
        .unwrap();
    let rows: Vec<Vec<f32>> = PROMPT
        .iter()
        .cycle()
        .take(20)
        .map(|&t| {
            let mut e = vec![0f32; h];
            embed.dequantize_row(t as usize, &mut e).unwrap();
            e
        })
        .collect();
    let mut repacked = 0;
    for l in 0..cfg.num_hidden_layers {
        for (name, shape) in layer_matrices(&cfg) {
            let full = format!("model.layers.{l}.{name}");
            let file = src.quantized(&full, shape, &cfg).unwrap().unwrap();
            assert_eq!(file.ty, QType::Q4_1, "{full}");
            let packed = file.clone().repacked_for_cpu();
            if !quant::has_avx512_vnni() {
                assert!(packed.is_copied() && packed.ty == QType::Q4_1);
                // The file's rows, in HF's order.
                let rb = file.row_bytes();
                let rows_hf: Vec<u8> = (0..file.rows)
                    .flat_map(|r| {
                        let f = file.row_order.as_ref().map_or(r, |o| o[r] as usize);
                        file.bytes()[f * rb..(f + 1) * rb].to_vec()
                    })
                    .collect();
                assert!(packed.bytes() == &rows_hf[..], "{full}");
                continue;
            }
            assert!(packed.is_copied() && packed.ty == QType::Q4_1R16, "{full}");
            assert!(
                packed.row_order.is_none(),
                "{full}: rows copied in HF's order"
            );
            assert_eq!(packed.bytes().len(), file.bytes().len());
            repacked += 1;
            // The file's products in HF's row order: a `llama` GGUF's Q/K rows are
            // permuted in the file and put back in HF's order by the copy.
            let hf = |out: &[f32], m: usize| -> Vec<f32> {
                match &file.row_order {
                    None => out.to_vec(),
                    Some(o) => out
                        .chunks_exact(m)
                        .flat_map(|t| o.iter().map(|&f| t[f as usize]))
                        .collect(),
                }
            };
            let [m, cols] = shape;
            let acts: Vec<_> = rows
                .iter()
                .map(|r| {
                    let x: Vec<f32> = r.iter().cycle().take(cols).copied().collect();
                    quant::quantize_activation(QType::Q4_1, &x).unwrap()
                })
                .collect();
            for threads in [1, 2] {
                let th = Threads::new(threads);
                for n in [1usize, 3, 8, 20] {
                    let mut want = vec![0f32; n * m];
                    let mut got = vec![f32::NAN; n * m];
                    quant::matmul_threads(QType::Q4_1, file.bytes(), &acts[..n], &mut want, th)
                        .unwrap();
                    quant::matmul_threads(packed.ty, packed.bytes(), &acts[..n], &mut got, th)
                        .unwrap();
                    assert!(
                        same_bits(&hf(&want, m), &got),
                        "{full}: {n} tokens, {threads} threads"
                    );
                }
                let mut want = vec![0f32; m];
                let mut got = vec![f32::NAN; m];
                quant::matvec_threads(QType::Q4_1, file.bytes(), &acts[0], &mut want, th).unwrap();
                quant::matvec_threads(packed.ty, packed.bytes(), &acts[0], &mut got, th).unwrap();
                let want = hf(&want, m);
                assert!(
                    same_bits(&want, &got),
                    "{full}: one token, {threads} threads"
                );
                for r in (0..m).step_by(37) {
                    assert_eq!(
                        packed.dot_row(r, &acts[0]).unwrap().to_bits(),
                        want[r].to_bits()
                    );
                }
            }
            let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
            for r in (0..m).step_by(61) {
                file.dequantize_row(r, &mut a).unwrap();
                packed.dequantize_row(r, &mut b).unwrap();
                assert!(same_bits(&a, &b), "{full}: row {r}");
            }
        }
    }
    if !quant::has_avx512_vnni() {
        println!("no AVX-512 VNNI: the matrices stay as the file has them");
    } else {
        assert_eq!(repacked, 7 * cfg.num_hidden_layers);
    }
}
