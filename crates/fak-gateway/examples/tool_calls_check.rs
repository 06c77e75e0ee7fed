//! The forced-call measurement of issue 27: N tool-calling prompts (default 200, made
//! deterministically from a catalogue of 12 tools and question templates; no model hub)
//! sent to an in-kernel `fak serve` of SmolLM2-135M-Instruct over HTTP
//! (`POST /v1/chat/completions`, `tool_choice: "required"` unless TOOL_CHOICE says
//! `auto`, greedy), once with the call grammar off (the model continues the forced call
//! head, or writes a call under `auto`, on its own, as before constrained decoding) and
//! once with it on. For each run it prints the boundary's
//! verdicts of the proposed calls (the response's `fak.tool_calls`): allowed,
//! `MALFORMED`, `TRUNCATED` (calls `max_tokens` cut off before their arguments were
//! whole), `UNKNOWN_TOOL`, other denials by reason, replies with no call, how many
//! calls name the tool the question was written for, and the wall time.
//!
//! ```text
//! cargo run --release -p fak-gateway --example tool_calls_check [-- N [MAX_TOKENS [TOOL_CHOICE]]]
//! ```
//!
//! The model is read from `FAK_SMOLLM2_GGUF` or the model cache (`fak model pull
//! smollm2-135m-instruct`). The policy is the built-in one: read-shaped tool names
//! (`get_`, `list_`, `read_`, `search`, `lookup_`) are allowed, the rest denied
//! `NOT_ALLOWED`, which constrained decoding does not change.

#[path = "../tests/common/mod.rs"]
mod common;

use fak_engine::inkernel::InKernelDriver;
use fak_engine::EngineConfig;
use fak_gateway::GatewayConfig;
use fak_model::{load_text, Model, WeightMode};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

const ID: &str = "smollm2-135m-instruct";

/// A tool of the catalogue: its OpenAI function, and questions for it (`{}` takes a
/// value from `values`).
struct Entry {
    function: Value,
    questions: &'static [&'static str],
    values: &'static [&'static str],
}

fn catalogue() -> Vec<Entry> {
    let obj = |props: Value, required: &[&str]| json!({"type": "object", "properties": props, "required": required});
    vec![
        Entry {
            function: json!({"name": "get_weather", "description": "Current weather for a city",
                "parameters": obj(json!({"city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}), &["city"])}),
            questions: &[
                "What's the weather in {}?",
                "Is it raining in {} today?",
                "How warm is it in {} right now?",
            ],
            values: &[
                "Paris", "Lisbon", "Tokyo", "Nairobi", "Lima", "Oslo", "Cairo",
            ],
        },
        Entry {
            function: json!({"name": "search_flights", "description": "Find flights between two cities",
                "parameters": {"properties": {"origin": {"type": "string"}, "destination": {"type": "string"},
                    "passengers": {"type": "integer", "minimum": 1}}, "required": ["origin", "destination"]}}),
            questions: &[
                "Find me a flight from London to {}.",
                "I need to fly to {} from Berlin with my wife.",
            ],
            values: &["Madrid", "Athens", "Dublin", "Seoul", "Boston", "Vienna"],
        },
        Entry {
            function: json!({"name": "send_email", "description": "Send an email",
                "parameters": obj(json!({"to": {"type": "string"}, "subject": {"type": "string"},
                    "body": {"type": "string"}}), &["to", "subject", "body"])}),
            questions: &[
                "Email {} that I will be late.",
                "Send {} a note saying thanks for lunch.",
            ],
            values: &[
                "anna@example.com",
                "the team",
                "my landlord",
                "bob@example.org",
                "Dr. Lee",
            ],
        },
        Entry {
            function: json!({"name": "get_stock_price", "description": "Latest price of a stock",
                "parameters": obj(json!({"symbol": {"type": "string"}}), &["symbol"])}),
            questions: &["How is {} stock doing?", "What's the share price of {}?"],
            values: &["Apple", "NVDA", "Tesla", "IBM", "Siemens"],
        },
        Entry {
            function: json!({"name": "convert_currency", "description": "Convert an amount between currencies",
                "parameters": obj(json!({"amount": {"type": "number"}, "from": {"type": "string"},
                    "to": {"type": "string"}}), &["amount", "from", "to"])}),
            questions: &[
                "How much is {} dollars in euros?",
                "Convert {} yen to pounds.",
            ],
            values: &["100", "25", "3000", "7.5", "42"],
        },
        Entry {
            function: json!({"name": "lookup_word", "description": "Dictionary definition of a word",
                "parameters": obj(json!({"word": {"type": "string"}}), &["word"])}),
            questions: &["What does '{}' mean?", "Define the word {}."],
            values: &["serendipity", "ephemeral", "quorum", "gauche", "laconic"],
        },
        Entry {
            function: json!({"name": "create_reminder", "description": "Remind the user later",
                "parameters": {"type": "object", "properties": {"text": {"type": "string"},
                    "minutes": {"type": "integer"}}, "required": ["text", "minutes"],
                    "additionalProperties": false}}),
            questions: &[
                "Remind me to {} in an hour.",
                "Set a reminder: {} in 10 minutes.",
            ],
            values: &[
                "call mom",
                "water the plants",
                "take the pizza out",
                "stretch",
            ],
        },
        Entry {
            function: json!({"name": "list_files", "description": "List the files in a directory",
                "parameters": obj(json!({"directory": {"type": "string"}}), &["directory"])}),
            questions: &[
                "What files are in {}?",
                "Show me the contents of the folder {}.",
            ],
            values: &["/tmp", "~/Documents", "src", "./build"],
        },
        Entry {
            function: json!({"name": "read_file", "description": "Read a text file",
                "parameters": obj(json!({"path": {"type": "string"}}), &["path"])}),
            questions: &["Open {} and tell me what it says.", "Read the file {}."],
            values: &["notes.txt", "README.md", "/etc/hosts", "todo.md"],
        },
        Entry {
            function: json!({"name": "search_web", "description": "Search the web",
                "parameters": obj(json!({"query": {"type": "string"},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}), &["query"])}),
            questions: &["Look up {} online.", "Search the internet for {}."],
            values: &[
                "the tallest building",
                "rust tutorials",
                "cheap hotels in Rome",
                "who won the 1998 world cup",
            ],
        },
        Entry {
            function: json!({"name": "get_time", "description": "The current time in a time zone",
                "parameters": {"properties": {"timezone": {"type": "string"}}}}),
            questions: &["What time is it in {}?", "Tell me the local time in {}."],
            values: &["Sydney", "New York", "UTC", "Mumbai"],
        },
        Entry {
            function: json!({"name": "translate_text", "description": "Translate text into a language",
                "parameters": obj(json!({"text": {"type": "string"},
                    "target_language": {"type": "string", "enum": ["French", "German", "Spanish", "Japanese"]}}),
                    &["text", "target_language"])}),
            questions: &[
                "Translate '{}' into German.",
                "How do you say '{}' in Spanish?",
            ],
            values: &[
                "good morning",
                "where is the station",
                "thank you very much",
                "I am hungry",
            ],
        },
    ]
}

/// Prompt `i`: the question, the tool it was written for, and the tools offered (that
/// tool and two others, in an order that varies).
fn prompt(cat: &[Entry], i: usize) -> (String, String, Value) {
    let n = cat.len();
    let t = i % n;
    let e = &cat[t];
    let k = i / n;
    let q = e.questions[k % e.questions.len()];
    let v = e.values[(k / e.questions.len() + k) % e.values.len()];
    let mut offered = vec![t, (t + 1 + k % (n - 1)) % n, (t + 5 + k % 3) % n];
    offered.dedup();
    let turn = i % offered.len();
    offered.rotate_left(turn);
    let tools: Vec<Value> = offered
        .iter()
        .map(|&j| json!({"type": "function", "function": cat[j].function}))
        .collect();
    let name = e.function["name"].as_str().unwrap_or("").to_string();
    (q.replace("{}", v), name, Value::Array(tools))
}

#[derive(Default)]
struct Tally {
    verdicts: BTreeMap<String, usize>,
    no_call: usize,
    intended: usize,
    calls: usize,
    seconds: f64,
}

impl Tally {
    fn line(&self, label: &str) -> String {
        let get = |k: &str| self.verdicts.get(k).copied().unwrap_or(0);
        let others: Vec<String> = self
            .verdicts
            .iter()
            .filter(|(k, _)| {
                !["allowed", "MALFORMED", "TRUNCATED", "UNKNOWN_TOOL"].contains(&k.as_str())
            })
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        format!(
            "{label:>13}: {} calls: allowed {}, MALFORMED {}, TRUNCATED {}, UNKNOWN_TOOL {}, other [{}]; no call {}; intended tool {}; {:.1} s",
            self.calls,
            get("allowed"),
            get("MALFORMED"),
            get("TRUNCATED"),
            get("UNKNOWN_TOOL"),
            others.join(", "),
            self.no_call,
            self.intended,
            self.seconds
        )
    }
}

/// A gateway over the in-kernel SmolLM2, with the call grammar on or off.
fn server(constrain: bool, path: &Path) -> common::Server {
    let m = Arc::new(Model::load_with(path, WeightMode::Native).expect("load the model"));
    let (tok, tmpl) = load_text(path, m.config()).expect("load the tokenizer");
    let cfg = EngineConfig {
        kv_budget_bytes: 0,
        constrain_tool_calls: constrain,
        ..EngineConfig::default()
    };
    common::start(
        Arc::new(InKernelDriver::from_loaded(m, tok, tmpl, ID, cfg)),
        GatewayConfig::default(),
    )
}

/// Sends prompt `i` to `srv` and counts the verdicts of its proposed calls.
fn ask(srv: &common::Server, cat: &[Entry], i: usize, ask: &Ask, tally: &mut Tally) {
    let (question, intended, tools) = prompt(cat, i);
    let body = json!({
        "model": ID,
        "messages": [{"role": "user", "content": question}],
        "tools": tools,
        "tool_choice": ask.tool_choice,
        "temperature": 0,
        "max_tokens": ask.max_tokens
    });
    let conversation = format!("check-{i}");
    let t0 = Instant::now();
    let r = common::request(
        srv.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("x-fak-conversation", &conversation),
        ],
        body.to_string().as_bytes(),
    );
    tally.seconds += t0.elapsed().as_secs_f64();
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let report = v["fak"]["tool_calls"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if report.is_empty() {
        tally.no_call += 1;
    }
    for c in &report {
        tally.calls += 1;
        let word = match (c["verdict"].as_str(), c["reason"].as_str()) {
            (Some("allow"), _) => "allowed".to_string(),
            (_, Some(r)) => r.to_string(),
            _ => "other".to_string(),
        };
        *tally.verdicts.entry(word).or_default() += 1;
        if c["name"] == intended.as_str() {
            tally.intended += 1;
        }
    }
    if std::env::var_os("FAK_CHECK_VERBOSE").is_some() {
        eprintln!(
            "{i} {question:?} -> {} {}",
            v["fak"], v["choices"][0]["message"]
        );
    }
}

/// What every prompt is sent with.
struct Ask {
    max_tokens: usize,
    /// `required` or `auto`.
    tool_choice: String,
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args
        .next()
        .map_or(200, |a| a.parse().expect("N: a count of prompts"));
    let max_tokens: usize = args.next().map_or(200, |a| a.parse().expect("MAX_TOKENS"));
    let tool_choice = args.next().unwrap_or_else(|| "required".into());
    assert!(
        ["required", "auto"].contains(&tool_choice.as_str()),
        "TOOL_CHOICE: required or auto"
    );
    let path = match std::env::var_os("FAK_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => fak_catalog::require_cached(ID).unwrap_or_else(|m| panic!("{m}")),
    };
    println!(
        "{n} prompts, tool_choice {tool_choice}, greedy, max_tokens {max_tokens}, {ID} (native weights)"
    );
    // Both servers side by side, each prompt sent to one then the other, so that a
    // partial run still compares the same prompts.
    let plain = server(false, &path);
    let constrained = server(true, &path);
    let cat = catalogue();
    let (mut a, mut b) = (Tally::default(), Tally::default());
    let ask_with = Ask {
        max_tokens,
        tool_choice,
    };
    for i in 0..n {
        ask(&plain, &cat, i, &ask_with, &mut a);
        ask(&constrained, &cat, i, &ask_with, &mut b);
        if (i + 1) % 25 == 0 || i + 1 == n {
            println!("after {} prompts:", i + 1);
            println!("{}", a.line("unconstrained"));
            println!("{}", b.line("constrained"));
        }
    }
}
