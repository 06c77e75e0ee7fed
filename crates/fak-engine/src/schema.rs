//! Checking a JSON value against a JSON Schema, and the sentence a client sees when it
//! fails: the gateway checks a tool call's arguments against its tool's `parameters`,
//! fak-upstream an upstream's structured reply against the request's schema, both with
//! the [`jsonschema`] crate's defaults (drafts 4 to 2020-12, `format` not asserted).

use serde_json::Value;

/// The first way `instance` breaks `validator`'s schema, as `"{what} at PATH: MESSAGE"`
/// (PATH: the JSON Pointer of the value at fault, e.g. `/units`; ` at PATH` left out
/// when it is the whole value), e.g. `arguments do not match the tool's schema at
/// /units: "k" is not one of ["c","f"]`. `None` when `instance` is valid. Only the
/// first error is formed (the others are not visited).
pub fn first_schema_error(
    validator: &jsonschema::Validator,
    instance: &Value,
    what: &str,
) -> Option<String> {
    let first = validator.iter_errors(instance).next()?;
    let at = first.instance_path().to_string();
    Some(if at.is_empty() {
        format!("{what}: {first}")
    } else {
        format!("{what} at {at}: {first}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_first_error_names_its_instance_path_unless_it_is_the_whole_value() {
        let v = jsonschema::validator_for(&json!({
            "type": "object",
            "properties": {"units": {"enum": ["c", "f"]}},
            "required": ["units"],
        }))
        .unwrap();
        assert_eq!(first_schema_error(&v, &json!({"units": "c"}), "x"), None);
        let e = first_schema_error(&v, &json!({"units": "k"}), "x").unwrap();
        assert!(e.starts_with("x at /units: "), "{e}");
        let e = first_schema_error(&v, &json!({}), "x").unwrap();
        assert!(e.starts_with("x: ") && e.contains("units"), "{e}");
    }
}
