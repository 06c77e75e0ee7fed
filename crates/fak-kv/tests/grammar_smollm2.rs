//! Constrained decoding on the real SmolLM2-135M-Instruct (`fak_kv::grammar`, llguidance):
//! a JSON-schema-constrained greedy reply is valid JSON for the schema; every masked step
//! keeps the allowed rows' logits bit for bit and picks the best allowed token; the KV
//! cache after a constrained reply equals, bit for bit, an unconstrained run's cache over
//! the same tokens; a parser that fails is a dead end, not a hang. On the exact and the
//! native (quantized) weight paths.
//!
//! Without the model file this fails with the fetch command (`FAK_SKIP_REAL_MODEL=1`
//! reports them as ignored, never in CI).

mod common;

use common::{load, prompt_ids};
use fak_kv::grammar::{mask_logits, Constraint};
use fak_kv::{
    generate_text, FinishReason, GrammarCompiler, GrammarError, GrammarSpec, Session, TextParams,
};
use fak_model::{Tokenizer, WeightMode};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Counts the heap bytes live in this test process, to measure what the trie holds.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged, only counting sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `dealloc` is passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn person_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    })
}

/// The one-turn prompt the constrained replies here answer.
const PROMPT: &str = "Tell me about a famous scientist: their name and their age when they died.";

/// The reply parses as JSON, is an object with exactly `name` (a string) and `age`
/// (an integer in range): the schema, checked by hand (not by our grammar code).
fn assert_person(text: &str) {
    let v: serde_json::Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {text}"));
    assert_eq!(o.len(), 2, "{text}");
    let name = o["name"].as_str().unwrap_or_else(|| panic!("name: {text}"));
    assert!(name.chars().count() <= 20, "{text}");
    let age = o["age"].as_i64().unwrap_or_else(|| panic!("age: {text}"));
    assert!((0..=150).contains(&age), "{text}");
}

/// Runs a constrained greedy reply, then replays its tokens through an unconstrained
/// session, checking each step's mask against that session's logits, and the two caches.
fn mask_invariant_on(mode: WeightMode) {
    let (model, tok, tmpl) = load(mode);
    let vocab = model.config().vocab_size;
    let compiler = GrammarCompiler::new(&tok, vocab).unwrap();
    let grammar = compiler
        .compile(&GrammarSpec::json_schema(person_schema()))
        .unwrap();
    let stop_ids = tmpl.stop_token_ids(&tok);
    let ids = prompt_ids(&tok, &tmpl, PROMPT);
    let params = TextParams {
        sampling: Default::default(),
        max_tokens: 64,
        stop: vec![],
        stop_ids: stop_ids.clone(),
        logprobs: None,
        grammar: Some(grammar.clone()),
    };
    let mut constrained = Session::new(Arc::clone(&model));
    let out = generate_text(&mut constrained, &tok, &ids, &params, None, &mut |_| {}).unwrap();
    println!("{mode:?}: {:?} ({:?})", out.text, out.finish_reason);
    assert_eq!(out.finish_reason, FinishReason::Stop, "{:?}", out.text);
    assert_person(&out.text);
    let last = *out.completion_ids.last().unwrap();
    assert!(stop_ids.contains(&last), "ends on a stop id");

    // Replay: the same tokens, stepped without any mask.
    let mut plain = Session::new(Arc::clone(&model));
    plain.prefill(&ids).unwrap();
    let mut c: Constraint = grammar.start();
    let mut masked = Vec::new();
    let mut differs_from_unconstrained = 0;
    for (step, &chosen) in out.completion_ids.iter().enumerate() {
        let logits = plain.last_logits().unwrap().to_vec();
        let allowed = c.allowed(&stop_ids).unwrap();
        assert!(
            allowed.contains(chosen),
            "step {step}: chosen token not allowed"
        );
        mask_logits(&logits, allowed, &mut masked);
        let mut n_allowed = 0;
        for (i, (&m, &l)) in masked.iter().zip(&logits).enumerate() {
            if allowed.contains(i as u32) {
                n_allowed += 1;
                assert_eq!(
                    m.to_bits(),
                    l.to_bits(),
                    "step {step}: allowed row {i} changed"
                );
            } else {
                assert_eq!(m, f32::NEG_INFINITY, "step {step}: row {i} not masked");
            }
        }
        assert_eq!(n_allowed, allowed.count());
        // Greedy picks the best allowed token: no allowed row beats it (ties: lower id).
        let best = allowed
            .ids()
            .into_iter()
            .max_by(|&a, &b| {
                logits[a as usize]
                    .total_cmp(&logits[b as usize])
                    .then(b.cmp(&a))
            })
            .unwrap();
        assert_eq!(chosen, best, "step {step}");
        if fak_model::argmax(&logits) != chosen {
            differs_from_unconstrained += 1;
        }
        if step + 1 < out.completion_ids.len() {
            c.accept(chosen).unwrap();
            plain.decode(chosen).unwrap();
        }
    }
    // Negative control: the mask did change choices (the model alone does not open with
    // this JSON), so the checks above are not vacuous.
    assert!(differs_from_unconstrained > 0, "the mask changed no choice");
    // The mask never touches the cache: the same tokens, the same K, pre-RoPE K and V.
    let (a, b) = (constrained.cache(), plain.cache());
    assert_eq!(a.len(), b.len());
    assert_eq!(a.positions(), b.positions());
    for layer in 0..a.n_layers() {
        for (x, y) in [
            (&a.k(layer).to_vec(), &b.k(layer).to_vec()),
            (&a.k_raw(layer).to_vec(), &b.k_raw(layer).to_vec()),
            (&a.v(layer).to_vec(), &b.v(layer).to_vec()),
        ] {
            assert_eq!(x.len(), y.len());
            assert!(
                x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                "layer {layer}: cache differs"
            );
        }
    }
}

#[fak_testkit::real_model]
fn mask_keeps_allowed_logits_and_the_cache_exact_path() {
    mask_invariant_on(WeightMode::Exact);
}

#[fak_testkit::real_model]
fn mask_keeps_allowed_logits_and_the_cache_native_path() {
    mask_invariant_on(WeightMode::Native);
}

/// JSON mode: any object. Sampled at temperature 1 over several seeds, every reply
/// parses as a JSON object.
#[fak_testkit::real_model]
fn json_object_replies_parse_at_temperature_one() {
    let (model, tok, tmpl) = load(WeightMode::Native);
    let compiler = GrammarCompiler::new(&tok, model.config().vocab_size).unwrap();
    let grammar = compiler.compile(&GrammarSpec::JsonObject).unwrap();
    let ids = prompt_ids(&tok, &tmpl, PROMPT);
    let mut complete = 0;
    for seed in 0..4 {
        let params = TextParams {
            sampling: fak_kv::SamplingParams {
                temperature: 1.0,
                seed,
                ..Default::default()
            },
            max_tokens: 200,
            stop: vec![],
            stop_ids: tmpl.stop_token_ids(&tok),
            logprobs: None,
            grammar: Some(grammar.clone()),
        };
        let mut s = Session::new(Arc::clone(&model));
        let out = generate_text(&mut s, &tok, &ids, &params, None, &mut |_| {}).unwrap();
        if out.finish_reason == FinishReason::Length {
            continue; // cut by max_tokens: not complete, so not checked
        }
        assert_eq!(out.finish_reason, FinishReason::Stop, "{:?}", out.text);
        let v: serde_json::Value = serde_json::from_str(&out.text)
            .unwrap_or_else(|e| panic!("seed {seed}: not JSON ({e}): {:?}", out.text));
        assert!(v.is_object(), "seed {seed}: {}", out.text);
        println!("seed {seed}: {}", out.text);
        complete += 1;
    }
    assert!(complete >= 2, "only {complete} of 4 replies completed");
}

/// A schema llguidance cannot compile is an error naming the construct; so is a schema
/// that is not an object and a Lark grammar with a syntax error.
#[fak_testkit::real_model]
fn bad_grammars_are_errors_naming_the_cause() {
    let (model, tok, _) = load(WeightMode::Native);
    let compiler = GrammarCompiler::new(&tok, model.config().vocab_size).unwrap();
    let err = |spec| match compiler.compile(&spec) {
        Err(GrammarError::Compile(m)) => m,
        other => panic!("{spec:?}: {other:?}"),
    };
    let m = err(GrammarSpec::json_schema(serde_json::json!({
        "type": "object",
        "properties": {"a": {"type": "string", "not": {"const": "x"}}}
    })));
    assert!(m.contains("not"), "{m}");
    let m = err(GrammarSpec::json_schema(serde_json::json!(true)));
    assert!(m.contains("JSON object"), "{m}");
    let m = err(GrammarSpec::Lark("start: (".into()));
    assert!(!m.is_empty());
    // llguidance's multi-line messages (a cause, then the grammar's line) come on one.
    let m = err(GrammarSpec::Lark("start: \"a\" bar\n".into()));
    assert!(m.contains("bar") && !m.contains('\n'), "{m}");
}

/// A parser driven off its grammar is a dead end at the next step (an error, not an
/// empty set to spin on), and generation ends there with `GrammarDeadEnd`.
#[fak_testkit::real_model]
fn a_failed_parser_is_a_dead_end() {
    let (model, tok, tmpl) = load(WeightMode::Native);
    let compiler = GrammarCompiler::new(&tok, model.config().vocab_size).unwrap();
    let grammar = compiler.compile(&GrammarSpec::JsonObject).unwrap();
    let stop_ids = tmpl.stop_token_ids(&tok);
    let mut c = grammar.start();
    let x = tok.encode("x").unwrap()[0];
    assert!(!c.allowed(&stop_ids).unwrap().contains(x));
    assert!(c.accept(x).is_err());
    assert!(c.allowed(&stop_ids).is_err());
}

/// What the trie costs at load on SmolLM2's 49,152 tokens (printed; a figure, not a
/// timed test), and that it covers the model's vocabulary.
#[fak_testkit::real_model]
fn token_trie_load_cost() {
    let (model, tok, _) = load(WeightMode::Native);
    let vocab = model.config().vocab_size;
    let live0 = LIVE.load(Ordering::Relaxed);
    let t0 = Instant::now();
    let compiler = GrammarCompiler::new(&tok, vocab).unwrap();
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let mib = LIVE.load(Ordering::Relaxed).saturating_sub(live0) as f64 / (1 << 20) as f64;
    let t1 = Instant::now();
    let g = compiler
        .compile(&GrammarSpec::json_schema(person_schema()))
        .unwrap();
    let compile_ms = t1.elapsed().as_secs_f64() * 1e3;
    println!(
        "token trie + slices: {ms:.0} ms, {mib:.1} MiB of heap held; person schema compile: {compile_ms:.1} ms"
    );
    assert_eq!(compiler.vocab_size(), vocab);
    let mut c = g.start();
    let first = c.allowed(&[]).unwrap();
    // A JSON object opens with `{`: every allowed token's text starts with it.
    assert!(first.count() > 0);
    for id in first.ids() {
        assert!(tok.token_bytes(id).starts_with(b"{"), "token {id}");
    }
}

/// The tokens of `text` accepted one by one; the constraint after them.
fn constraint_after(g: &fak_kv::grammar::Grammar, tok: &Tokenizer, text: &str) -> Constraint {
    let mut c = g.start();
    for id in tok.encode(text).unwrap() {
        assert!(
            c.allowed(&[]).unwrap().contains(id),
            "{text:?}: token {id} refused"
        );
        c.accept(id).unwrap();
    }
    c
}

/// An integer with no bounds of its own has at most 16 digits (the interoperable range,
/// 2^53 − 1): after 16 digits only the end of the number is allowed, so a sampled reply
/// cannot write digits until `max_tokens` cuts its JSON off (the anthropic SDK's
/// `messages.parse` at its default temperature 1 did, on 3 prompts of 50). A bound the
/// schema states is kept.
#[fak_testkit::real_model]
fn integers_without_bounds_end_within_sixteen_digits() {
    let (model, tok, _) = load(WeightMode::Native);
    let compiler = GrammarCompiler::new(&tok, model.config().vocab_size).unwrap();
    let schema = |n: serde_json::Value| {
        GrammarSpec::json_schema(serde_json::json!({
            "type": "object", "properties": {"n": n}, "required": ["n"]
        }))
    };
    let digits: Vec<u32> = (0..10)
        .map(|d| tok.encode(&d.to_string()).unwrap()[0])
        .collect();
    let close = tok.encode("}").unwrap()[0];

    let g = compiler
        .compile(&schema(serde_json::json!({"type": "integer"})))
        .unwrap();
    let mut c = constraint_after(&g, &tok, r#"{"n": 1234567890123456"#);
    let allowed = c.allowed(&[]).unwrap();
    assert!(allowed.contains(close));
    for &d in &digits {
        assert!(!allowed.contains(d), "a 17th digit ({d}) is allowed");
    }
    // The bound itself, and its negative, are reachable.
    for text in [r#"{"n": 9007199254740991}"#, r#"{"n": -9007199254740991}"#] {
        let mut c = constraint_after(&g, &tok, text);
        assert!(c.is_complete(), "{text}");
    }
    let mut c = constraint_after(&g, &tok, r#"{"n": 900719925474099"#);
    let allowed = c.allowed(&[]).unwrap();
    assert!(allowed.contains(digits[1]) && !allowed.contains(digits[2]));

    // A stated bound is the schema's, not ours: 17 digits and more under `maximum` 1e20.
    let g = compiler
        .compile(&schema(
            serde_json::json!({"type": "integer", "maximum": 100_000_000_000_000_000_000.0}),
        ))
        .unwrap();
    let mut c = constraint_after(&g, &tok, r#"{"n": 1234567890123456"#);
    assert!(c.allowed(&[]).unwrap().contains(digits[7]));
}

/// [`fak_kv::grammar::bound_integers`] bounds integer subschemas wherever they are
/// (properties, items, anyOf, $defs) and leaves data (`const`, `enum`, `default`) and
/// numbers alone.
#[test]
fn bound_integers_walks_subschemas_not_data() {
    let mut s = serde_json::json!({
        "type": "object",
        "properties": {
            "type": {"type": "integer"},
            "xs": {"type": "array", "items": {"type": ["integer", "null"], "minimum": 0}},
            "u": {"anyOf": [{"$ref": "#/$defs/i"}, {"type": "number"}]},
            "c": {"const": {"type": "integer"}},
            "e": {"enum": [{"type": "integer"}]},
            "d": {"type": "integer", "exclusiveMaximum": 10, "default": {"type": "integer"}}
        },
        "$defs": {"i": {"type": "integer"}}
    });
    fak_kv::grammar::bound_integers(&mut s);
    let max = fak_kv::grammar::INTEROPERABLE_INT_MAX;
    let p = &s["properties"];
    assert_eq!(
        p["type"],
        serde_json::json!({"type": "integer", "minimum": -max, "maximum": max})
    );
    assert_eq!(
        p["xs"]["items"],
        serde_json::json!({"type": ["integer", "null"], "minimum": 0, "maximum": max})
    );
    assert_eq!(s["$defs"]["i"]["maximum"], max);
    assert_eq!(p["u"]["anyOf"][1], serde_json::json!({"type": "number"}));
    assert_eq!(p["c"]["const"], serde_json::json!({"type": "integer"}));
    assert_eq!(p["e"]["enum"][0], serde_json::json!({"type": "integer"}));
    assert_eq!(p["d"]["default"], serde_json::json!({"type": "integer"}));
    assert_eq!(p["d"]["minimum"], -max);
    assert!(p["d"].get("maximum").is_none());
    assert!(s.get("minimum").is_none());
}

/// An object schema that lists its properties and says nothing of others is closed:
/// after a declared property the grammar offers the next declared key or the end, not
/// a key of the model's own (SmolLM2 at temperature 1 invented a `"genres"` list for
/// `llm --schema`'s Person and looped in it until `max_tokens`). A schema that allows
/// extra properties itself keeps them.
#[fak_testkit::real_model]
fn objects_that_list_their_properties_get_no_others() {
    let (model, tok, _) = load(WeightMode::Native);
    let compiler = GrammarCompiler::new(&tok, model.config().vocab_size).unwrap();
    let person = |extra: Option<bool>| {
        let mut s = serde_json::json!({
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name"]
        });
        if let Some(extra) = extra {
            s["additionalProperties"] = extra.into();
        }
        GrammarSpec::json_schema(s)
    };
    let g = compiler.compile(&person(None)).unwrap();
    let mut c = constraint_after(&g, &tok, r#"{"name": "Ann""#);
    assert!(
        c.accept_bytes(br#", "genres""#).is_err(),
        "an undeclared key is allowed"
    );
    let mut c = constraint_after(&g, &tok, r#"{"name": "Ann""#);
    assert!(c.accept_bytes(br#", "age": 3}"#).is_ok());
    let g = compiler.compile(&person(Some(true))).unwrap();
    let mut c = constraint_after(&g, &tok, r#"{"name": "Ann""#);
    assert!(c.accept_bytes(br#", "genres": []}"#).is_ok());
}

/// [`fak_kv::grammar::close_objects`] closes objects that list their properties,
/// wherever they are, and leaves open those that cannot be closed safely.
#[test]
fn close_objects_closes_listed_objects_only() {
    let closed = |mut s: serde_json::Value| {
        fak_kv::grammar::close_objects(&mut s);
        s
    };
    let s = closed(serde_json::json!({
        "type": "object",
        "properties": {
            "additionalProperties": {"type": "object", "properties": {"a": {}}},
            "xs": {"type": "array", "items": {"properties": {"b": {}}}},
            "u": {"anyOf": [{"$ref": "#/$defs/P"}, {"type": "null"}]},
            "open": {"properties": {"c": {}}, "additionalProperties": true},
            "pat": {"properties": {"d": {}}, "patternProperties": {"^x": {}}},
            "miss": {"properties": {"e": {}}, "required": ["e", "f"]},
            "data": {"const": {"properties": {"g": {}}}}
        },
        "$defs": {"P": {"properties": {"h": {}}, "required": ["h"]}}
    }));
    let p = &s["properties"];
    assert_eq!(s["additionalProperties"], false);
    assert_eq!(p["additionalProperties"]["additionalProperties"], false);
    assert_eq!(p["xs"]["items"]["additionalProperties"], false);
    assert_eq!(s["$defs"]["P"]["additionalProperties"], false);
    assert_eq!(p["open"]["additionalProperties"], true);
    assert!(p["pat"].get("additionalProperties").is_none());
    assert!(p["miss"].get("additionalProperties").is_none());
    assert!(p["data"]["const"].get("additionalProperties").is_none());
    // Subschemas that combine stay open: closing both sides of an `allOf` (or a `$ref`
    // beside `properties`) would leave no object valid for both.
    for combined in [
        serde_json::json!({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}),
        serde_json::json!({"$ref": "#/$defs/A", "properties": {"b": {}},
                           "$defs": {"A": {"properties": {"a": {}}}}}),
    ] {
        assert_eq!(closed(combined.clone()), combined);
    }
}

/// A chain of 3,000 `$ref`s and one of 3,000 Lark rules compile on the compiler's own
/// deep stack (a chain of ~1,000 overflowed a request thread's 2 MiB stack and aborted
/// the server); a grammar over `GRAMMAR_MAX_BYTES` is an error naming its size; a long
/// compile error is cut to about 1 KiB rather than quoting the whole grammar back.
#[fak_testkit::real_model]
fn deep_and_large_grammars_are_compiled_or_refused_never_a_crash() {
    let (model, tok, _) = load(WeightMode::Native);
    let compiler = GrammarCompiler::new(&tok, model.config().vocab_size).unwrap();
    let n = 3000;
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(
            format!("d{i}"),
            serde_json::json!({"$ref": format!("#/$defs/d{}", i + 1)}),
        );
    }
    defs.insert(format!("d{n}"), serde_json::json!({"type": "integer"}));
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"n": {"$ref": "#/$defs/d0"}},
        "required": ["n"],
        "$defs": defs
    });
    // Compiled or refused: either way this process is still here to look.
    let r = compiler.compile(&GrammarSpec::json_schema(schema));
    println!("{n}-link $ref chain: {:?}", r.as_ref().map(|_| "compiled"));
    let mut lark = String::from("start: r0\n");
    for i in 0..n {
        lark.push_str(&format!("r{i}: r{}\n", i + 1));
    }
    lark.push_str(&format!("r{n}: \"x\"\n"));
    let g = compiler.compile(&GrammarSpec::Lark(lark)).unwrap();
    let x = tok.encode("x").unwrap()[0];
    assert!(g.start().allowed(&[]).unwrap().contains(x));

    let big = format!(
        "start: \"{}\"",
        "a".repeat(fak_kv::grammar::GRAMMAR_MAX_BYTES)
    );
    match compiler.compile(&GrammarSpec::Lark(big)) {
        Err(GrammarError::TooLarge(m)) => assert!(m.contains("bytes"), "{m}"),
        other => panic!("{other:?}"),
    }
    let bad = format!("start: \"a\"\nfoo: \"{}\" (", "b".repeat(100_000));
    match compiler.compile(&GrammarSpec::Lark(bad)) {
        Err(GrammarError::Compile(m)) => {
            assert!(m.len() <= 1100, "{} bytes", m.len());
            assert!(!m.contains('\n'), "one line: {m}");
        }
        other => panic!("{other:?}"),
    }
}

/// Lark's special-token syntax cannot put a control token into a reply: where the
/// grammar needs one, no token is allowed (a dead end), and the stop ids stay allowed
/// only where the grammar can end.
#[fak_testkit::real_model]
fn a_grammar_cannot_produce_control_tokens() {
    let (model, tok, tmpl) = load(WeightMode::Native);
    let compiler = GrammarCompiler::new(&tok, model.config().vocab_size).unwrap();
    let stop_ids = tmpl.stop_token_ids(&tok);
    let im_start = tok.token_to_id("<|im_start|>").unwrap();
    assert!(tok.is_special(im_start));

    let g = compiler
        .compile(&GrammarSpec::Lark("start: \"a\" <|im_start|> \"b\"".into()))
        .unwrap();
    let mut c = g.start();
    let a = tok.encode("a").unwrap()[0];
    assert!(c.allowed(&stop_ids).unwrap().contains(a));
    c.accept(a).unwrap();
    match c.allowed(&stop_ids) {
        Err(_) => {}
        Ok(set) => panic!(
            "allowed after \"a\": {:?} (<|im_start|> is {im_start})",
            set.ids()
        ),
    }

    // A grammar that opens with the end-of-turn token: not an empty "complete" reply,
    // but one whose first step allows no token, refused when compiled.
    let e = compiler
        .compile(&GrammarSpec::Lark("start: <|im_end|> \"hello\"".into()))
        .unwrap_err();
    assert!(
        matches!(e, fak_kv::grammar::GrammarError::Empty(_)),
        "{e:?}"
    );
}
