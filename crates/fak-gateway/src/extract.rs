//! Typed request bodies: an axum extractor that parses the body as JSON into a
//! fak-wire type and rejects in the error shape of the API the route speaks, so no
//! handler restates the 400 / 413 answers.
//!
//! - a body over [`crate::GatewayConfig::max_body_bytes`]: 413 `request_too_large`;
//! - a body that cannot be read: 400 naming the reason;
//! - invalid JSON, a missing field or a value of the wrong type: 400
//!   `invalid request body: PATH: WHAT` (PATH the field at fault, such as
//!   `messages[0].role`, from `serde_path_to_error`).

use crate::error::{ApiError, Flavor};
use crate::AppState;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;
use std::marker::PhantomData;

/// Which API a route speaks, for the shape of its rejections.
pub(crate) trait Wire {
    /// The error shape.
    const FLAVOR: Flavor;
}

/// The OpenAI wire (`{"error": {...}}`).
pub(crate) struct OpenAi;

impl Wire for OpenAi {
    const FLAVOR: Flavor = Flavor::OpenAi;
}

/// A JSON body parsed into `T`, rejected in `W`'s error shape.
pub(crate) struct WireJson<T, W>(pub T, pub PhantomData<W>);

/// A JSON body of the OpenAI wire.
pub(crate) type OpenAiJson<T> = WireJson<T, OpenAi>;

impl<T, W> FromRequest<AppState> for WireJson<T, W>
where
    T: DeserializeOwned,
    W: Wire,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, s: &AppState) -> Result<Self, ApiError> {
        let body = Bytes::from_request(req, s).await;
        let bytes = crate::body_bytes(s, body, W::FLAVOR)?;
        crate::parse_json(&bytes, W::FLAVOR).map(|t| WireJson(t, PhantomData))
    }
}
