//! The screen's cost on large benign inputs: seconds of one core per input kind.
//!
//! `cargo run --release -p fak-ctxmmu --example screen_cost [-- KIB]` (default 256 KiB).
//! Kinds: English prose, Cyrillic prose, one long run of base85 digits, minified JSON.

use fak_ctxmmu::{Screen, ScreenConfig};
use std::time::Instant;

fn repeat_to(unit: &str, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + unit.len());
    while s.len() < bytes {
        s.push_str(unit);
    }
    s
}

fn main() {
    let kib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(256);
    let n = kib * 1024;
    let screen = Screen::new(ScreenConfig::default());
    // Compile the lazily built patterns first, so the first kind does not pay for them.
    let _ = screen.inspect("warm up <p hidden>x</p> such as \"x\" %41%42%43 &#65;&#66;&#67;&#68;");
    let kinds = [
        ("english prose", repeat_to("The replica flushes the stale index before the scheduler rebalances each partition, and the operator reads the log. ", n)),
        ("cyrillic prose", repeat_to("Реплика сбрасывает устаревший индекс, прежде чем планировщик перераспределит каждый раздел. ", n)),
        ("base85 run", repeat_to("RA^-&a%FIAX=7m^W^8qHXk~LCbZBKDb97;BWguy8WMz0DVr6D;a%CWNXk{RCV`yb$b!=sFAaZ45VQgV;V`Xz7Wnp7zAaG%FbZK;HZ*DF", n)),
        ("minified json", repeat_to("{\"id\":12345,\"name\":\"Trail Canvas Tote\",\"price\":42.5,\"tags\":[\"a\",\"b\"]},", n)),
    ];
    for (what, text) in &kinds {
        let t = Instant::now();
        let f = screen.inspect(text);
        println!(
            "{what:>15}: {:>6} KiB in {:.3} s ({})",
            text.len() / 1024,
            t.elapsed().as_secs_f64(),
            f.map_or("admitted".to_string(), |f| f.reason.as_str().to_string())
        );
    }
}
