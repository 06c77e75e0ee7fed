//! `GET /v1/models` and `GET /v1/models/{id}` on both wires.
//!
//! A request carrying the `anthropic-version` header (every Anthropic SDK sends it) gets
//! Anthropic's shapes, any other request OpenAI's:
//!
//! | | OpenAI (`client.models.list` / `.retrieve`) | Anthropic (`client.models.list` / `.retrieve`) |
//! |---|---|---|
//! | one model | [`OpenAiModel`]: `id`, `object: "model"`, `created` (Unix seconds), `owned_by` | [`AnthropicModel`]: `id`, `type: "model"`, `display_name`, `created_at` (RFC 3339) |
//! | the list | [`OpenAiModelList`]: `object: "list"`, `data` | [`AnthropicModelList`]: `data`, `has_more`, `first_id`, `last_id` |
//! | unknown id | 404 `not_found_error` in OpenAI's error shape | 404 `not_found_error` in Anthropic's |
//!
//! Sources: OpenAI's API reference, "Models" (`Model` in the `openai` Python SDK's
//! `types/model.py`); Anthropic's API reference, "Models" (`ModelInfo` in the
//! `anthropic` Python SDK's `types/model_info.py`, the page in `pagination.py`'s
//! `SyncPage`). The whole list is one page: `has_more` is always `false`, and the
//! Anthropic paging parameters (`before_id`, `after_id`, `limit`) are not read.
//!
//! `created` / `created_at` is when this server started (fak does not know when a
//! model file was made); `display_name` is the id. The listed models are the driver's
//! (with `fak serve --alias`, each concrete alias too); an id is found when a request
//! naming it as `model` would be served (a glob alias matches too).

use crate::error::{ApiError, Flavor};
use crate::AppState;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use fak_engine::ModelInfo;
use serde::Serialize;

/// One model in OpenAI's shape (`openai.types.Model`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OpenAiModel {
    /// The id requests send as `model`.
    pub id: String,
    /// Always `"model"`.
    pub object: &'static str,
    /// Unix seconds (here: when the server started).
    pub created: u64,
    /// Who serves it: `fak` for the in-process model, else the engine's id.
    pub owned_by: String,
    /// fak's extension: the context window, tokens (0 when the engine does not know).
    pub context_length: usize,
}

/// The model list in OpenAI's shape (`SyncPage[Model]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OpenAiModelList {
    /// Always `"list"`.
    pub object: &'static str,
    /// The models, the default first.
    pub data: Vec<OpenAiModel>,
}

/// One model in Anthropic's shape (`anthropic.types.ModelInfo`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AnthropicModel {
    /// The id requests send as `model`.
    pub id: String,
    /// Always `"model"`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// A name for people (here: the id).
    pub display_name: String,
    /// RFC 3339 time, UTC (here: when the server started).
    pub created_at: String,
}

/// The model list in Anthropic's shape (`SyncPage[ModelInfo]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AnthropicModelList {
    /// The models, the default first.
    pub data: Vec<AnthropicModel>,
    /// Always `false`: the whole list is one page.
    pub has_more: bool,
    /// The first model's id (`null` when none).
    pub first_id: Option<String>,
    /// The last model's id (`null` when none).
    pub last_id: Option<String>,
}

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

fn openai(m: ModelInfo, created: u64) -> OpenAiModel {
    OpenAiModel {
        id: m.id,
        object: "model",
        created,
        owned_by: m.owned_by,
        context_length: m.context_length,
    }
}

fn anthropic(m: ModelInfo, created: u64) -> AnthropicModel {
    AnthropicModel {
        display_name: m.id.clone(),
        id: m.id,
        kind: "model",
        created_at: rfc3339(created),
    }
}

/// `GET /v1/models`.
pub(crate) async fn list(State(s): State<AppState>, headers: HeaderMap) -> Response {
    let models = s.driver.models();
    match flavor(&headers) {
        Flavor::OpenAi => Json(OpenAiModelList {
            object: "list",
            data: models.into_iter().map(|m| openai(m, s.created)).collect(),
        })
        .into_response(),
        Flavor::Anthropic => {
            let data: Vec<AnthropicModel> = models
                .into_iter()
                .map(|m| anthropic(m, s.created))
                .collect();
            Json(AnthropicModelList {
                first_id: data.first().map(|m| m.id.clone()),
                last_id: data.last().map(|m| m.id.clone()),
                has_more: false,
                data,
            })
            .into_response()
        }
    }
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
    use super::rfc3339;

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
