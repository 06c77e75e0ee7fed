//! Drivers by id, as a value the caller builds: [`Registry::builtin`] holds the drivers
//! of this crate (`inkernel`, the default, and `mock`); another crate adds its own with
//! [`Registry::add`] (the `fak-upstream` crate's `register` adds `openai-upstream` and
//! `anthropic-upstream`). The gateway and the CLI find a driver by its id
//! (`fak serve --engine ID`). Adding a driver is a new type with a [`DriverSpec`] and one
//! `add` where the registry is built.

use crate::{EngineConfig, EngineDriver, EngineError};
use std::sync::Arc;

/// How to build one driver.
#[derive(Clone, Copy)]
pub struct DriverSpec {
    /// The id `--engine` takes.
    pub id: &'static str,
    /// One line for `--help` and errors.
    pub about: &'static str,
    /// Builds the driver. A driver that loads a model returns at once and loads in the
    /// background, reporting [`crate::Readiness::Loading`] meanwhile.
    pub build: fn(&EngineConfig) -> Result<Arc<dyn EngineDriver>, EngineError>,
}

impl std::fmt::Debug for DriverSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverSpec")
            .field("id", &self.id)
            .field("about", &self.about)
            .finish()
    }
}

/// The drivers a server can build, in the order they are listed (the default first).
#[derive(Clone, Debug, Default)]
pub struct Registry {
    specs: Vec<DriverSpec>,
}

impl Registry {
    /// No drivers.
    pub fn empty() -> Self {
        Registry::default()
    }

    /// This crate's drivers: `inkernel` (the default) and `mock`.
    pub fn builtin() -> Self {
        let mut r = Registry::empty();
        r.add(crate::inkernel::SPEC);
        r.add(crate::mock::SPEC);
        r
    }

    /// Adds `spec` at the end of the list; a spec with the same id as one already
    /// listed replaces it in its place.
    pub fn add(&mut self, spec: DriverSpec) -> &mut Self {
        match self.specs.iter_mut().find(|s| s.id == spec.id) {
            Some(s) => *s = spec,
            None => self.specs.push(spec),
        }
        self
    }

    /// Every driver, in order.
    pub fn specs(&self) -> &[DriverSpec] {
        &self.specs
    }

    /// The driver ids, in order.
    pub fn ids(&self) -> Vec<&'static str> {
        self.specs.iter().map(|d| d.id).collect()
    }

    /// The spec of driver `id`.
    pub fn find(&self, id: &str) -> Option<&DriverSpec> {
        self.specs.iter().find(|d| d.id == id)
    }

    /// The spec of driver `id`.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] naming the known ids for an unknown one.
    pub fn get(&self, id: &str) -> Result<&DriverSpec, EngineError> {
        self.find(id).ok_or_else(|| {
            EngineError::InvalidRequest(format!(
                "no engine '{id}' (known: {})",
                self.ids().join(", ")
            ))
        })
    }

    /// Builds driver `id` from `config`.
    ///
    /// # Errors
    /// As [`Registry::get`]; the driver's own build errors (e.g. no model path for
    /// `inkernel`).
    pub fn build(
        &self,
        id: &str,
        config: &EngineConfig,
    ) -> Result<Arc<dyn EngineDriver>, EngineError> {
        (self.get(id)?.build)(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_drivers_by_id() {
        let r = Registry::builtin();
        assert_eq!(r.ids(), vec!["inkernel", "mock"]);
        let d = r.build("mock", &EngineConfig::default()).unwrap();
        assert_eq!(d.id(), "mock");
        let e = r.build("nope", &EngineConfig::default()).err().unwrap();
        assert!(e.to_string().contains("known: inkernel, mock"), "{e}");
        assert!(r.build("inkernel", &EngineConfig::default()).is_err());
    }

    #[test]
    fn an_added_driver_is_listed_last_and_replaces_one_of_its_id() {
        let mut r = Registry::builtin();
        r.add(DriverSpec {
            id: "other",
            about: "x",
            build: crate::mock::SPEC.build,
        });
        assert_eq!(r.ids(), vec!["inkernel", "mock", "other"]);
        r.add(DriverSpec {
            id: "mock",
            about: "replaced",
            build: crate::mock::SPEC.build,
        });
        assert_eq!(r.ids(), vec!["inkernel", "mock", "other"]);
        assert_eq!(r.find("mock").unwrap().about, "replaced");
    }
}
