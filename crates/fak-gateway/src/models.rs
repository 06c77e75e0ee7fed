//! `GET /v1/models` and `GET /v1/models/{id}` on both wires.
//!
//! A request carrying the `anthropic-version` header (every Anthropic SDK sends it) gets
//! Anthropic's shapes, any other request OpenAI's:
//!
//! | | OpenAI (`client.models.list` / `.retrieve`) | Anthropic (`client.models.list` / `.retrieve`) |
//! |---|---|---|
//! | one model | [`oa::Model`]: `id`, `object: "model"`, `created` (Unix seconds), `owned_by` | [`an::ModelInfo`]: `id`, `type: "model"`, `display_name`, `created_at` (RFC 3339) |
//! | the list | [`oa::ModelList`]: `object: "list"`, `data` (one page) | [`an::ModelList`]: a page of `data`, `has_more`, `first_id`, `last_id` |
//! | unknown id | 404 `not_found_error` in OpenAI's error shape | 404 `not_found_error` in Anthropic's |
//!
//! Sources: OpenAI's API reference, "Models" (`Model` in the `openai` Python SDK's
//! `types/model.py`); Anthropic's API reference, "Models" (`ModelInfo` in the
//! `anthropic` Python SDK's `types/model_info.py`, the query in `model_list_params.py`,
//! the page in `pagination.py`'s `SyncPage`). The shapes are fak-wire's.
//!
//! Anthropic's list is paged as the API pages it ([`an::ModelListParams`]): `limit`
//! models (default 20, 1 to 1000), from the start, or those right after `after_id`, or
//! those right before `before_id`; `has_more` says whether more lie beyond the page in
//! that direction. A `limit` out of range, both cursors at once, or a cursor naming no
//! listed model is a 400 `invalid_request_error` naming the parameter.
//!
//! `created` / `created_at` is when this server started (fak does not know when a
//! model file was made); `display_name` is the id. The listed models are the driver's
//! (with `fak serve --alias`, each concrete alias too; a pattern alias such as
//! `claude-*` names no one model and is not listed); an id is found when a request
//! naming it as `model` would be served (an id a pattern matches is found; the
//! pattern's own text, `claude-*`, is not an id and is a 404).

use crate::error::{ApiError, Flavor};
use crate::AppState;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use fak_engine::ModelInfo;
use fak_wire::anthropic as an;
use fak_wire::openai as oa;
use std::ops::Range;

/// The header that makes a request Anthropic's.
const ANTHROPIC_VERSION: &str = "anthropic-version";

/// Which wire a models request speaks, by its headers.
fn flavor(headers: &HeaderMap) -> Flavor {
    if headers.contains_key(ANTHROPIC_VERSION) {
        Flavor::Anthropic
    } else {
        Flavor::OpenAi
    }
}

fn openai(m: ModelInfo, created: u64) -> oa::Model {
    oa::Model {
        id: m.id,
        object: oa::MODEL_OBJECT.into(),
        created,
        owned_by: m.owned_by,
        context_length: m.context_length as u64,
        max_model_len: None,
    }
}

fn anthropic(m: ModelInfo, created: u64) -> an::ModelInfo {
    an::ModelInfo {
        display_name: m.id.clone(),
        id: m.id,
        kind: an::ModelType::Model,
        created_at: rfc3339(created),
    }
}

/// The range of `ids` that Anthropic's paging parameters `p` ask for, and whether more
/// lie beyond it in the direction asked (see the module docs).
///
/// # Errors
/// A message naming the parameter at fault.
fn page(ids: &[&str], p: &an::ModelListParams) -> Result<(Range<usize>, bool), String> {
    let limit = p.limit.unwrap_or(an::MODEL_LIST_LIMIT_DEFAULT);
    if !(an::MODEL_LIST_LIMIT_MIN..=an::MODEL_LIST_LIMIT_MAX).contains(&limit) {
        return Err(format!(
            "limit: must be between {} and {} (got {limit})",
            an::MODEL_LIST_LIMIT_MIN,
            an::MODEL_LIST_LIMIT_MAX
        ));
    }
    // In range, so it fits.
    let limit = limit as usize;
    let at = |which: &str, id: &str| {
        ids.iter()
            .position(|m| *m == id)
            .ok_or_else(|| format!("{which}: no model '{id}' in the list"))
    };
    let n = ids.len();
    match (&p.after_id, &p.before_id) {
        (Some(_), Some(_)) => Err("after_id and before_id: give one cursor, not both".into()),
        (Some(after), None) => {
            let start = at("after_id", after)? + 1;
            let end = start.saturating_add(limit).min(n);
            Ok((start..end, end < n))
        }
        (None, Some(before)) => {
            let end = at("before_id", before)?;
            let start = end.saturating_sub(limit);
            Ok((start..end, start > 0))
        }
        (None, None) => {
            let end = limit.min(n);
            Ok((0..end, end < n))
        }
    }
}

/// `GET /v1/models`.
pub(crate) async fn list(
    State(s): State<AppState>,
    headers: HeaderMap,
    uri: Uri,
) -> Result<Response, ApiError> {
    let models = s.driver.models();
    Ok(match flavor(&headers) {
        Flavor::OpenAi => Json(oa::ModelList {
            object: oa::LIST_OBJECT.into(),
            data: models.into_iter().map(|m| openai(m, s.created)).collect(),
        })
        .into_response(),
        Flavor::Anthropic => {
            let bad = |m: String| ApiError::bad_request(m).with_flavor(Flavor::Anthropic);
            let Query(params) = Query::<an::ModelListParams>::try_from_uri(&uri)
                .map_err(|e| bad(format!("the query: {}", e.body_text())))?;
            let ids: Vec<&str> = models.iter().map(|m| m.id.as_str()).collect();
            let (range, has_more) = page(&ids, &params).map_err(bad)?;
            let data: Vec<an::ModelInfo> = models[range]
                .iter()
                .map(|m| anthropic(m.clone(), s.created))
                .collect();
            Json(an::ModelList {
                first_id: data.first().map(|m| m.id.clone()),
                last_id: data.last().map(|m| m.id.clone()),
                has_more,
                data,
            })
            .into_response()
        }
    })
}

/// `GET /v1/models/{id}` (the id may hold `/`, as `Qwen/Qwen2.5-7B-Instruct` does).
pub(crate) async fn retrieve(
    State(s): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let flavor = flavor(&headers);
    let models = s.driver.models();
    let found = match models.iter().find(|m| m.id == id) {
        Some(m) => Some(m.clone()),
        // An id the driver serves under another name (a glob alias): it is served, so
        // it is a model, described as its target is.
        None => s.driver.resolve_model(&id).and_then(|target| {
            models.iter().find(|m| m.id == target).map(|m| ModelInfo {
                id: id.clone(),
                ..m.clone()
            })
        }),
    };
    let Some(m) = found else {
        return Err(ApiError::not_found(format!(
            "model '{id}' is not served here (served: {})",
            models
                .iter()
                .map(|m| m.id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))
        .with_flavor(flavor));
    };
    Ok(match flavor {
        Flavor::OpenAi => Json(openai(m, s.created)).into_response(),
        Flavor::Anthropic => Json(anthropic(m, s.created)).into_response(),
    })
}

/// `secs` (Unix seconds) as an RFC 3339 UTC time, `1970-01-01T00:00:00Z`. The date is
/// the proleptic Gregorian calendar's (the days-to-civil algorithm of Howard Hinnant's
/// "chrono-Compatible Low-Level Date Algorithms").
pub fn rfc3339(secs: u64) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let (h, mi, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Shift the epoch to 0000-03-01 so leap days fall at the end of each era's year.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

#[cfg(test)]
mod tests {
    use super::{an, page, rfc3339};

    #[test]
    fn pages_as_the_sdk_walks_them() {
        let ids = ["a", "b", "c", "d", "e"];
        let q = |after: Option<&str>, before: Option<&str>, limit: Option<i64>| {
            page(
                &ids,
                &an::ModelListParams {
                    after_id: after.map(Into::into),
                    before_id: before.map(Into::into),
                    limit,
                },
            )
        };
        assert_eq!(q(None, None, None), Ok((0..5, false)));
        assert_eq!(q(None, None, Some(2)), Ok((0..2, true)));
        assert_eq!(q(Some("b"), None, Some(2)), Ok((2..4, true)));
        assert_eq!(q(Some("d"), None, Some(2)), Ok((4..5, false)));
        assert_eq!(q(Some("e"), None, Some(2)), Ok((5..5, false)));
        assert_eq!(q(None, Some("d"), Some(2)), Ok((1..3, true)));
        assert_eq!(q(None, Some("b"), Some(2)), Ok((0..1, false)));
        for (limit, ok) in [
            (0, false),
            (1, true),
            (1000, true),
            (1001, false),
            (-1, false),
        ] {
            assert_eq!(q(None, None, Some(limit)).is_ok(), ok, "{limit}");
        }
        assert!(q(None, None, Some(0)).unwrap_err().starts_with("limit:"));
        assert!(q(Some("zz"), None, None)
            .unwrap_err()
            .starts_with("after_id:"));
        assert!(q(None, Some("zz"), None)
            .unwrap_err()
            .starts_with("before_id:"));
        assert!(q(Some("a"), Some("b"), None).is_err());
    }

    #[test]
    fn rfc3339_dates() {
        // Reference values from `date -u -d @SECS +%FT%TZ`.
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_709_251_199), "2024-02-29T23:59:59Z");
        assert_eq!(rfc3339(1_740_009_600), "2025-02-20T00:00:00Z");
        assert_eq!(rfc3339(4_102_444_800), "2100-01-01T00:00:00Z");
    }
}
