//! Drivers by id. Adding a driver is a new type with a [`DriverSpec`] and one line in
//! [`DRIVERS`]; the gateway and the CLI find it by its id (`fak serve --engine ID`).

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

/// Every driver, the default first.
pub const DRIVERS: &[DriverSpec] = &[
    crate::inkernel::SPEC,
    crate::upstream::SPEC,
    crate::upstream::ANTHROPIC_SPEC,
    crate::mock::SPEC,
];

/// The driver ids, default first.
pub fn ids() -> Vec<&'static str> {
    DRIVERS.iter().map(|d| d.id).collect()
}

/// The spec of driver `id`.
pub fn find(id: &str) -> Option<&'static DriverSpec> {
    DRIVERS.iter().find(|d| d.id == id)
}

/// Builds driver `id` from `config`.
///
/// # Errors
/// [`EngineError::InvalidRequest`] naming the known ids for an unknown one; the
/// driver's own build errors (e.g. no model path for `inkernel`).
pub fn build(id: &str, config: &EngineConfig) -> Result<Arc<dyn EngineDriver>, EngineError> {
    let spec = find(id).ok_or_else(|| {
        EngineError::InvalidRequest(format!("no engine '{id}' (known: {})", ids().join(", ")))
    })?;
    (spec.build)(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_drivers_by_id() {
        assert_eq!(
            ids(),
            vec!["inkernel", "openai-upstream", "anthropic-upstream", "mock"]
        );
        let d = build("mock", &EngineConfig::default()).unwrap();
        assert_eq!(d.id(), "mock");
        let e = build("nope", &EngineConfig::default()).err().unwrap();
        assert!(
            e.to_string()
                .contains("inkernel, openai-upstream, anthropic-upstream, mock"),
            "{e}"
        );
        assert!(build("inkernel", &EngineConfig::default()).is_err());
        // The upstream drivers need a base URL.
        assert!(build("openai-upstream", &EngineConfig::default()).is_err());
        assert!(build("anthropic-upstream", &EngineConfig::default()).is_err());
    }
}
