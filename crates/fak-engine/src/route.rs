//! Several drivers side by side in one server, each serving one model id, chosen by the
//! request's `model` (`fak serve --route MODEL=ENGINE`, repeatable).
//!
//! A [`Route`] is written `MODEL=ENGINE` or `MODEL=ENGINE@URL`: requests naming `MODEL`
//! go to a driver of the registry's `ENGINE` (see [`crate::registry::Registry`]) that
//! serves that one model under that id. [`RoutedDriver::build`] builds each route's
//! driver from the caller's registry and one [`EngineConfig`] with the route's model as
//! its served id: the in-kernel driver
//! serves its model file ([`EngineConfig::model_path`]) as `MODEL`; an upstream driver
//! serves the upstream's model `MODEL` (the upstream must know it by that name; the
//! request goes up unchanged), at [`crate::upstream::UpstreamConfig::base_urls`] or at
//! the route's own `URL`; the mock answers as `MODEL`. At most one route may use the
//! in-kernel engine, as there is one model file.
//!
//! [`RoutedDriver`] dispatches by model: a request without a model takes the first
//! route; a model no route names is [`EngineError::UnknownModel`] listing the routed
//! ones. `models()` lists every routed model (with what its driver reports of it, else
//! context length 0) except one whose driver failed and lists it no more (an in-kernel
//! model that failed to load; its requests get [`EngineError::LoadFailed`]), `stats()` sums the drivers' (a driver behind several routes
//! counted once), a revocation, [`EngineDriver::drain`] and [`EngineDriver::cancel_all`]
//! reach every driver once.
//! Readiness: [`Readiness::Loading`] while any route is still starting (so a server is
//! reported ready only once every route has been tried), then [`Readiness::Ready`] while
//! at least one route is ready (a route that is not answers its own requests with its
//! error), else [`Readiness::Failed`] naming each route's reason.

use crate::{
    registry::Registry, EngineConfig, EngineDriver, EngineError, EngineStats, EventStream,
    GenerateRequest, ModelInfo, Readiness, Revocation, RevokeReport,
};
use std::sync::Arc;

/// The id a [`RoutedDriver`] reports (`/health`'s `engine`).
pub const ROUTER_ID: &str = "router";

/// One `--route`: a model id and the engine that serves it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// The id clients send as `model` (and the id the engine serves it under).
    pub model: String,
    /// A registry id (`inkernel`, `openai-upstream`, `anthropic-upstream`, `mock`).
    pub engine: String,
    /// For an upstream engine: this route's own upstream, in place of the configured
    /// base URLs.
    pub base_url: Option<String>,
}

impl Route {
    /// Parses `MODEL=ENGINE` or `MODEL=ENGINE@URL`.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] naming what is wrong: no `=`, an empty or
    /// whitespace-holding model or engine, a URL on an engine that takes none (one
    /// whose id does not end in `-upstream`) or a bad URL. Whether a registry knows the
    /// engine is checked by [`RoutedDriver::build`].
    pub fn parse(s: &str) -> Result<Route, EngineError> {
        let bad = |why: String| EngineError::InvalidRequest(format!("route '{s}': {why}"));
        let (model, rest) = s
            .split_once('=')
            .ok_or_else(|| bad("write it MODEL=ENGINE, e.g. smollm2=inkernel".into()))?;
        let model = model.trim();
        if model.is_empty() || model.chars().any(char::is_whitespace) {
            return Err(bad(
                "the model id must be non-empty and hold no whitespace".into()
            ));
        }
        let (engine, base_url) = match rest.split_once('@') {
            Some((e, u)) => (e.trim(), Some(u.trim().to_string())),
            None => (rest.trim(), None),
        };
        if engine.is_empty() || engine.chars().any(char::is_whitespace) {
            return Err(bad(
                "the engine id must be non-empty and hold no whitespace".into(),
            ));
        }
        if base_url.is_some() && !engine.ends_with("-upstream") {
            return Err(bad(format!(
                "only an upstream engine takes @URL, not {engine}"
            )));
        }
        if let Some(u) = &base_url {
            crate::upstream::normalize_base_url(u).map_err(|e| bad(e.to_string()))?;
        }
        Ok(Route {
            model: model.to_string(),
            engine: engine.to_string(),
            base_url,
        })
    }
}

impl std::str::FromStr for Route {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Route::parse(s)
    }
}

/// Drivers by model. See the module docs.
pub struct RoutedDriver {
    routes: Vec<(String, Arc<dyn EngineDriver>)>,
}

impl RoutedDriver {
    /// Routes over drivers already built: each `(model, driver)` serves requests naming
    /// `model`; the first is the default.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] for no routes or a model routed twice.
    pub fn new(routes: Vec<(String, Arc<dyn EngineDriver>)>) -> Result<Self, EngineError> {
        if routes.is_empty() {
            return Err(EngineError::InvalidRequest(
                "a router needs at least one route".into(),
            ));
        }
        for (i, (m, _)) in routes.iter().enumerate() {
            if routes[..i].iter().any(|(x, _)| x == m) {
                return Err(EngineError::InvalidRequest(format!(
                    "the model '{m}' is routed twice"
                )));
            }
        }
        Ok(RoutedDriver { routes })
    }

    /// Builds each route's driver, from `registry`'s spec of its engine and `config`
    /// (see the module docs).
    ///
    /// # Errors
    /// As [`RoutedDriver::new`]; [`EngineError::InvalidRequest`] for two routes to the
    /// in-kernel engine; an engine `registry` does not know and a driver's own build
    /// error, each prefixed with its route.
    pub fn build(
        routes: &[Route],
        config: &EngineConfig,
        registry: &Registry,
    ) -> Result<Self, EngineError> {
        let inkernel = routes.iter().filter(|r| r.engine == "inkernel").count();
        if inkernel > 1 {
            return Err(EngineError::InvalidRequest(
                "only one route may use the inkernel engine (it serves the one model file)".into(),
            ));
        }
        let mut built = Vec::with_capacity(routes.len());
        for r in routes {
            let mut c = config.clone();
            c.model_id = Some(r.model.clone());
            c.upstream.model = Some(r.model.clone());
            if let Some(u) = &r.base_url {
                c.upstream.base_urls = vec![u.clone()];
            }
            let d = registry.build(&r.engine, &c).map_err(|e| match e {
                EngineError::InvalidRequest(m) => {
                    EngineError::InvalidRequest(format!("route {}={}: {m}", r.model, r.engine))
                }
                e => e,
            })?;
            built.push((r.model.clone(), d));
        }
        Self::new(built)
    }

    /// The routes: each model and the id of the driver serving it, in order.
    pub fn routes(&self) -> Vec<(String, &'static str)> {
        self.routes
            .iter()
            .map(|(m, d)| (m.clone(), d.id()))
            .collect()
    }

    /// The routes whose engine is not ready, each with the reason (`starting` while it
    /// still loads or probes).
    pub fn not_ready(&self) -> Vec<(String, String)> {
        self.routes
            .iter()
            .filter_map(|(m, d)| match d.readiness() {
                Readiness::Ready => None,
                Readiness::Loading => Some((m.clone(), "starting".to_string())),
                Readiness::Failed(why) => Some((m.clone(), why)),
            })
            .collect()
    }

    /// Each driver once, in route order (one driver may serve several routes).
    fn drivers(&self) -> Vec<&Arc<dyn EngineDriver>> {
        let mut out: Vec<&Arc<dyn EngineDriver>> = Vec::new();
        for (_, d) in &self.routes {
            if !out.iter().any(|o| Arc::ptr_eq(o, d)) {
                out.push(d);
            }
        }
        out
    }

    /// The route for `model` (`None`: the first).
    fn find(&self, model: Option<&str>) -> Option<&(String, Arc<dyn EngineDriver>)> {
        match model {
            None => self.routes.first(),
            Some(m) => self.routes.iter().find(|(x, _)| x == m),
        }
    }
}

impl EngineDriver for RoutedDriver {
    fn id(&self) -> &'static str {
        ROUTER_ID
    }

    fn models(&self) -> Vec<ModelInfo> {
        self.routes
            .iter()
            .filter_map(|(m, d)| {
                let listed = d.models().into_iter().find(|i| &i.id == m);
                match (listed, d.readiness()) {
                    (Some(i), _) => Some(i),
                    // Its driver failed and no longer lists it (a model that failed to
                    // load): no request for it can succeed.
                    (None, Readiness::Failed(_)) => None,
                    (None, _) => Some(ModelInfo {
                        id: m.clone(),
                        context_length: 0,
                        owned_by: d.id().into(),
                    }),
                }
            })
            .collect()
    }

    fn readiness(&self) -> Readiness {
        let states: Vec<Readiness> = self.routes.iter().map(|(_, d)| d.readiness()).collect();
        if states.contains(&Readiness::Loading) {
            return Readiness::Loading;
        }
        if states.contains(&Readiness::Ready) {
            return Readiness::Ready;
        }
        let why: Vec<String> = self
            .routes
            .iter()
            .zip(&states)
            .map(|((m, _), s)| match s {
                Readiness::Failed(e) => format!("{m}: {e}"),
                _ => format!("{m}: not ready"),
            })
            .collect();
        Readiness::Failed(why.join("; "))
    }

    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        crate::single(self.submit_n(req, 1)?)
    }

    /// The route's own driver's `submit_n` (the in-kernel one prefills once).
    fn submit_n(
        &self,
        mut req: GenerateRequest,
        n: usize,
    ) -> Result<Vec<EventStream>, EngineError> {
        let Some((model, d)) = self.find(req.model.as_deref()) else {
            return Err(EngineError::UnknownModel {
                requested: req.model.unwrap_or_default(),
                available: self.routes.iter().map(|(m, _)| m.clone()).collect(),
            });
        };
        req.model = Some(model.clone());
        if n == 1 {
            return Ok(vec![d.submit(req)?]);
        }
        d.submit_n(req, n)
    }

    fn stats(&self) -> EngineStats {
        let mut t = EngineStats::default();
        for d in self.drivers() {
            let s = d.stats();
            t.queue_depth += s.queue_depth;
            t.active += s.active;
            t.kv_entries += s.kv_entries;
            t.kv_bytes += s.kv_bytes;
            t.upstreams += s.upstreams;
            t.upstreams_healthy += s.upstreams_healthy;
        }
        t
    }

    fn revoke(&self, r: &Revocation) -> RevokeReport {
        let mut t = RevokeReport::default();
        for d in self.drivers() {
            let k = d.revoke(r);
            t.sessions += k.sessions;
            t.tokens_dropped += k.tokens_dropped;
        }
        t
    }

    fn drain(&self) {
        for d in self.drivers() {
            d.drain();
        }
    }

    /// Every routed engine's kept conversations ([`EngineDriver::persist_kv`]), summed;
    /// `None` when none keeps any.
    fn persist_kv(&self, wait: std::time::Duration) -> Option<crate::persist::PersistReport> {
        let mut total: Option<crate::persist::PersistReport> = None;
        for d in self.drivers() {
            if let Some(r) = d.persist_kv(wait) {
                let t = total.get_or_insert_with(Default::default);
                t.sessions += r.sessions;
                t.bytes += r.bytes;
                t.skipped += r.skipped;
            }
        }
        total
    }

    fn cancel_all(&self) {
        for d in self.drivers() {
            d.cancel_all();
        }
    }

    fn count_tokens(&self, req: &GenerateRequest) -> Result<usize, EngineError> {
        let Some((model, d)) = self.find(req.model.as_deref()) else {
            return Err(EngineError::UnknownModel {
                requested: req.model.clone().unwrap_or_default(),
                available: self.routes.iter().map(|(m, _)| m.clone()).collect(),
            });
        };
        let mut req = req.clone();
        req.model = Some(model.clone());
        d.count_tokens(&req)
    }

    fn forwards_client_body(&self, model: Option<&str>) -> bool {
        self.find(model)
            .is_some_and(|(m, d)| d.forwards_client_body(Some(m)))
    }

    fn constrains_output(&self, model: Option<&str>) -> bool {
        self.find(model)
            .is_some_and(|(m, d)| d.constrains_output(Some(m)))
    }

    fn accepts_grammar(
        &self,
        model: Option<&str>,
        spec: &crate::GrammarSpec,
    ) -> Result<(), String> {
        match self.find(model) {
            Some((m, d)) => d.accepts_grammar(Some(m), spec),
            None => Err("no engine serves this model".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Message;

    #[test]
    fn routes_parse_with_clear_errors() {
        assert_eq!(
            Route::parse("smollm2=inkernel").unwrap(),
            Route {
                model: "smollm2".into(),
                engine: "inkernel".into(),
                base_url: None
            }
        );
        let r: Route = "big=openai-upstream@http://127.0.0.1:8000/v1"
            .parse()
            .unwrap();
        assert_eq!(r.engine, "openai-upstream");
        assert_eq!(r.base_url.as_deref(), Some("http://127.0.0.1:8000/v1"));
        for (bad, says) in [
            ("smollm2", "MODEL=ENGINE"),
            ("=mock", "non-empty"),
            ("a b=mock", "whitespace"),
            ("a=", "engine id"),
            ("a=mock@http://h:1", "only an upstream"),
            ("a=openai-upstream@https://h:1", "TLS"),
        ] {
            let e = Route::parse(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    fn mock(id: &str) -> Arc<dyn EngineDriver> {
        Arc::new(crate::mock::MockDriver::new().with_model(id))
    }

    #[test]
    fn requests_go_by_model_and_an_unknown_one_is_named() {
        let d = RoutedDriver::build(
            &[
                Route::parse("small=mock").unwrap(),
                Route::parse("other=mock").unwrap(),
            ],
            &EngineConfig::default(),
            &Registry::builtin(),
        )
        .unwrap();
        assert_eq!(d.id(), ROUTER_ID);
        assert_eq!(
            d.routes(),
            vec![("small".to_string(), "mock"), ("other".to_string(), "mock")]
        );
        let ids: Vec<String> = d.models().into_iter().map(|m| m.id).collect();
        assert_eq!(ids, ["small", "other"]);
        assert_eq!(d.readiness(), Readiness::Ready);
        let mut r = GenerateRequest::chat(vec![Message::new("user", "echo hi")]);
        assert_eq!(
            d.submit(r.clone())
                .unwrap()
                .blocking_collect()
                .unwrap()
                .text,
            "hi"
        );
        r.model = Some("other".into());
        assert_eq!(
            d.submit(r.clone())
                .unwrap()
                .blocking_collect()
                .unwrap()
                .text,
            "hi"
        );
        r.model = Some("nope".into());
        let e = d.submit(r).unwrap_err();
        assert_eq!(
            e,
            EngineError::UnknownModel {
                requested: "nope".into(),
                available: vec!["small".into(), "other".into()]
            }
        );
        assert!(!d.forwards_client_body(Some("small")));
    }

    #[test]
    fn bad_route_sets_are_errors() {
        let cfg = EngineConfig::default();
        let twice = RoutedDriver::new(vec![("a".into(), mock("a")), ("a".into(), mock("a"))]);
        assert!(twice.err().unwrap().to_string().contains("routed twice"));
        assert!(RoutedDriver::new(Vec::new()).is_err());
        let two_inkernel = RoutedDriver::build(
            &[
                Route::parse("a=inkernel").unwrap(),
                Route::parse("b=inkernel").unwrap(),
            ],
            &cfg,
            &Registry::builtin(),
        );
        assert!(two_inkernel.err().unwrap().to_string().contains("only one"));
        // An engine the registry does not know, named with its route.
        let e = RoutedDriver::build(
            &[Route::parse("big=openai-upstream").unwrap()],
            &cfg,
            &Registry::builtin(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("route big=openai-upstream")
                && e.contains("no engine 'openai-upstream' (known: inkernel, mock)"),
            "{e}"
        );
    }
}
