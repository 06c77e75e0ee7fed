//! Routes to the upstream engines through a registry that holds them
//! (`fak_upstream::register`), as `fak serve --route` builds them.

use fak_engine::registry::Registry;
use fak_engine::route::{Route, RoutedDriver};
use fak_engine::{EngineConfig, EngineDriver, Readiness};
use std::time::{Duration, Instant};

fn registry() -> Registry {
    let mut r = Registry::builtin();
    fak_upstream::register(&mut r);
    r
}

#[test]
fn register_adds_both_upstream_engines_after_the_builtin_ones() {
    assert_eq!(
        registry().ids(),
        vec!["inkernel", "mock", "openai-upstream", "anthropic-upstream"]
    );
    // The upstream drivers need a base URL.
    let r = registry();
    for id in ["openai-upstream", "anthropic-upstream"] {
        let e = r.build(id, &EngineConfig::default()).err().unwrap();
        assert!(e.to_string().contains("--base-url"), "{id}: {e}");
    }
}

#[test]
fn a_route_whose_upstream_is_down_is_named_with_its_reason() {
    // A port nothing listens on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let d = RoutedDriver::build(
        &[
            Route::parse("a=mock").unwrap(),
            Route::parse(&format!("b=openai-upstream@http://{dead}")).unwrap(),
        ],
        &EngineConfig::default(),
        &registry(),
    )
    .unwrap();
    let t = Instant::now();
    let down = loop {
        let n = d.not_ready();
        if n.iter().all(|(_, why)| why != "starting") {
            break n;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "{n:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(down.len(), 1, "{down:?}");
    assert_eq!(down[0].0, "b");
    assert!(down[0].1.contains("cannot reach"), "{down:?}");
    // The server as a whole still serves `a`.
    assert_eq!(d.readiness(), Readiness::Ready);
}

#[test]
fn an_upstream_route_without_a_base_url_names_the_route() {
    let e = RoutedDriver::build(
        &[Route::parse("big=openai-upstream").unwrap()],
        &EngineConfig::default(),
        &registry(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("route big=openai-upstream") && e.contains("--base-url"),
        "{e}"
    );
}
