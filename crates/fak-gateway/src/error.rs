//! Errors that render themselves as HTTP responses in the shape of the API asked.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use fak_engine::EngineError;
use fak_wire::openai::{ErrorObject, ErrorResponse};

/// The response header telling a client whether to retry (`true` / `false`), which
/// both official SDKs (`openai`, `anthropic`) obey before their own status rules: set on
/// every error ([`ApiError::retryable`]), so that a wrong key or a bad request is not
/// retried for minutes.
pub const SHOULD_RETRY: header::HeaderName = header::HeaderName::from_static("x-should-retry");

/// OpenAI's `code` for a model the server does not serve.
const MODEL_NOT_FOUND: &str = "model_not_found";

/// Which API's error shape to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// OpenAI: `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// Anthropic: `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
}

impl Flavor {
    /// The flavor of a request path: `/v1/messages` is Anthropic's, the rest OpenAI's.
    pub fn of_path(path: &str) -> Self {
        if path.starts_with("/v1/messages") {
            Flavor::Anthropic
        } else {
            Flavor::OpenAi
        }
    }

    /// The flavor of a request: Anthropic's for `/v1/messages…`, and for a path that is
    /// no OpenAI generation route (`/v1/models…`, an unknown route) when the request
    /// carries the `anthropic-version` header (every Anthropic SDK sends it, as the
    /// models routes decide); OpenAI's otherwise.
    pub fn of_request(path: &str, headers: &axum::http::HeaderMap) -> Self {
        let openai_route = ["/v1/chat/", "/v1/completions", "/v1/responses"]
            .iter()
            .any(|p| path.starts_with(p));
        if Self::of_path(path) == Flavor::Anthropic
            || (!openai_route && headers.contains_key("anthropic-version"))
        {
            Flavor::Anthropic
        } else {
            Flavor::OpenAi
        }
    }
}

/// An error response: status, a type word, a message, and `Retry-After` for 429/503.
///
/// Type words (the same in both shapes): `invalid_request_error` (400),
/// `authentication_error` (401, also an upstream refusing the client's own key),
/// `permission_error` (403, an upstream refusing the client's own key),
/// `not_found_error` (404; OpenAI's shape types an unknown model `invalid_request_error`,
/// [`ApiError::model_not_found`]), `request_too_large` (413),
/// `rate_limit_error` (429), `api_error` (500, also a model that failed to load:
/// [`ApiError::load_failed`]; 502 for a failed upstream; 503 for the server's own state:
/// [`ApiError::unavailable`]),
/// `overloaded_error` (503), `timeout_error` (504, also an upstream that timed out).
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The type word.
    pub kind: &'static str,
    /// What was wrong, for a person.
    pub message: String,
    /// The shape.
    pub flavor: Flavor,
    /// Seconds for `Retry-After`, when set.
    pub retry_after_s: Option<u64>,
    /// `x-should-retry: true | false`, when set: whether a retry can succeed. The
    /// official OpenAI and Anthropic Python SDKs read this header before the status in
    /// their clients' `_should_retry` (and so never retry a 5xx that carries `false`).
    pub should_retry: Option<bool>,
    /// OpenAI's `code` and `param` (e.g. `previous_response_not_found`,
    /// `previous_response_id`), when set ([`ApiError::with_code`]); `null` otherwise.
    pub code: Option<(&'static str, &'static str)>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            flavor: Flavor::OpenAi,
            retry_after_s: None,
            should_retry: None,
            code: None,
        }
    }

    /// 400 `invalid_request_error`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 401 `authentication_error`.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or wrong API key (send `Authorization: Bearer KEY` or `x-api-key: KEY`)",
        )
    }

    /// 404 `not_found_error`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }

    /// 404 for a model the server does not serve. OpenAI's shape types it as the API
    /// does (`type: "invalid_request_error"`, `code: "model_not_found"`, `param:
    /// "model"`; the `openai` SDK raises `NotFoundError` by the status); Anthropic's as
    /// `not_found_error`.
    pub fn model_not_found(message: impl Into<String>) -> Self {
        Self::not_found(message).with_code(MODEL_NOT_FOUND, "model")
    }

    /// 414 `invalid_request_error`: the request target is `len` bytes, over `limit`.
    pub fn uri_too_long(len: usize, limit: usize) -> Self {
        Self::new(
            StatusCode::URI_TOO_LONG,
            "invalid_request_error",
            format!("the request target (path and query) is {len} bytes; at most {limit}"),
        )
    }

    /// An error of any `status`, with the type word both APIs use for it (400 and the
    /// other 4xx: `invalid_request_error`; 401, 403, 404, 413, 429 and 5xx their own).
    pub fn status(status: StatusCode, message: impl Into<String>) -> Self {
        let kind = match status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            504 => "timeout_error",
            s if s >= 500 => "api_error",
            _ => "invalid_request_error",
        };
        Self::new(status, kind, message)
    }

    /// 413 `request_too_large`.
    pub fn too_large(limit_bytes: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!("the request body is larger than the limit of {limit_bytes} bytes"),
        )
    }

    /// 500 `api_error`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "api_error", message)
    }

    /// 503 `api_error` with `Retry-After: 30`: the server cannot take the request now
    /// for a reason of its own state (the audit log cannot be written and is
    /// fail-closed; the page-out store or the revocation list is full).
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            retry_after_s: Some(30),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "api_error", message)
        }
    }

    /// 500 `api_error` with `x-should-retry: false` and no `Retry-After`: the requested
    /// model failed to load (`why` says how, without server paths), so no retry can
    /// succeed until the operator restarts the server with a working model.
    pub fn load_failed(why: impl Into<String>) -> Self {
        ApiError {
            should_retry: Some(false),
            ..Self::new(StatusCode::INTERNAL_SERVER_ERROR, "api_error", why)
        }
    }

    /// 504 `timeout_error`: no response within `limit` (Anthropic's type word for its
    /// own 504).
    pub fn timeout(limit: std::time::Duration) -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout_error",
            format!(
                "no response within the limit of {:.1} s (the generation was cancelled; stream the response, or ask for fewer tokens)",
                limit.as_secs_f64()
            ),
        )
    }

    /// 503 `overloaded_error` with `Retry-After: 5`: the server is shutting down, and
    /// the request was either still waiting for a worker (answered at once, never
    /// started) or did not finish within the shutdown grace (its generation was
    /// cancelled). One message for both: the engine's error does not say which.
    pub fn shutting_down() -> Self {
        ApiError {
            retry_after_s: Some(5),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded_error",
                "the server is shutting down: the request was not started, or was cancelled before it finished; retry",
            )
        }
    }

    /// Whether a retry of the same request can succeed: [`ApiError::should_retry`] when
    /// set (a model that failed to load is a 500 no retry mends), else by status: 408,
    /// 409, 429 and 5xx (the statuses the official SDKs retry); a 400, 401, 403, 404, 413
    /// or 422 would fail the same way again.
    pub fn retryable(&self) -> bool {
        self.should_retry.unwrap_or_else(|| {
            matches!(self.status.as_u16(), 408 | 409 | 429) || self.status.is_server_error()
        })
    }

    /// The same error in another shape.
    pub fn with_flavor(mut self, flavor: Flavor) -> Self {
        self.flavor = flavor;
        self
    }

    /// The same error with OpenAI's `code` and the `param` it is about.
    pub fn with_code(mut self, code: &'static str, param: &'static str) -> Self {
        self.code = Some((code, param));
        self
    }

    /// The `type` word in OpenAI's shape: [`ApiError::kind`], except that OpenAI types
    /// an unknown model's 404 `invalid_request_error` ([`ApiError::model_not_found`]).
    fn openai_type(&self) -> &'static str {
        match self.code {
            Some((MODEL_NOT_FOUND, _)) => "invalid_request_error",
            _ => self.kind,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        match self.flavor {
            Flavor::OpenAi => serde_json::to_value(ErrorResponse {
                error: ErrorObject {
                    message: self.message.clone(),
                    kind: self.openai_type().to_string(),
                    param: self.code.map(|c| c.1.to_string()),
                    code: self.code.map(|c| c.0.to_string()),
                },
            })
            .unwrap_or_default(),
            Flavor::Anthropic => serde_json::to_value(fak_wire::anthropic::ErrorResponse::new(
                self.kind,
                &self.message,
            ))
            .unwrap_or_default(),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let msg = e.to_string();
        match e {
            EngineError::UnknownModel { .. } => ApiError::model_not_found(msg),
            EngineError::InvalidRequest(_) | EngineError::ContextOverflow { .. } => {
                ApiError::bad_request(msg)
            }
            EngineError::Overloaded { retry_after_s, .. } => ApiError {
                retry_after_s: Some(retry_after_s.max(1)),
                ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", msg)
            },
            EngineError::NotReady(_) => ApiError {
                retry_after_s: Some(5),
                ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded_error", msg)
            },
            EngineError::LoadFailed(_) => ApiError::load_failed(msg),
            EngineError::ShuttingDown => ApiError::shutting_down(),
            EngineError::Internal(_) => ApiError::internal(msg),
            EngineError::Upstream(_) => Self::new(StatusCode::BAD_GATEWAY, "api_error", msg),
            EngineError::UpstreamTimeout(_) => {
                Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout_error", msg)
            }
            EngineError::Refused { status: 403, .. } => {
                Self::new(StatusCode::FORBIDDEN, "permission_error", msg)
            }
            EngineError::Refused { .. } => {
                Self::new(StatusCode::UNAUTHORIZED, "authentication_error", msg)
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        r.headers_mut().insert(
            SHOULD_RETRY,
            HeaderValue::from_static(if self.retryable() { "true" } else { "false" }),
        );
        if let Some(s) = self.retry_after_s {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}
