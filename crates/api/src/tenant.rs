//! Who a request acts for: the tenant an API key stands for, or the one a trusted proxy names
//! in a header.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use batch_config::ApiKey;

use crate::{Api, ApiError, ErrorCode};

/// The tenant a request acts for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant(pub String);

/// How a request's tenant is known: API keys and the tenants they stand for, or a header a
/// trusted proxy sets.
#[derive(Clone)]
pub struct Keys {
    by_key: Arc<HashMap<String, String>>,
    header: Option<axum::http::HeaderName>,
}

/// The tenant of a service without keys.
pub const DEFAULT_TENANT: &str = "default";

impl Keys {
    /// No keys: every request is tenant [`DEFAULT_TENANT`].
    pub fn single_tenant() -> Self {
        Self {
            by_key: Arc::new(HashMap::new()),
            header: None,
        }
    }

    /// The tenant is the value of `header`, set by an authenticating proxy in front of the
    /// service (`serve.tenant_header`); `None` when `header` is not a header name.
    pub fn from_header(header: &str) -> Option<Self> {
        let header = axum::http::HeaderName::from_bytes(header.as_bytes()).ok()?;
        Some(Self {
            by_key: Arc::new(HashMap::new()),
            header: Some(header),
        })
    }

    /// These keys; an empty list means [`Keys::single_tenant`].
    pub fn new(keys: &[ApiKey]) -> Self {
        let by_key = keys
            .iter()
            .map(|k| (k.key.expose().to_owned(), k.tenant.clone()))
            .collect();
        Self {
            by_key: Arc::new(by_key),
            header: None,
        }
    }

    fn tenant(&self, headers: &axum::http::HeaderMap) -> Result<Tenant, ApiError> {
        if let Some(name) = &self.header {
            return tenant_from_header(name, headers);
        }
        let authorization = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if self.by_key.is_empty() {
            return Ok(Tenant(DEFAULT_TENANT.to_owned()));
        }
        let Some(value) = authorization else {
            return Err(ApiError::new(
                ErrorCode::InvalidApiKey,
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
            ));
        };
        // `<scheme> <key>`, the scheme `Bearer` in any case (RFC 9110 11.1); a bare key or
        // another scheme is not a bearer token.
        let key = match value.trim().split_once(' ') {
            Some((scheme, key)) if scheme.eq_ignore_ascii_case("bearer") => key.trim(),
            _ => {
                return Err(ApiError::new(
                    ErrorCode::InvalidApiKey,
                    "Send the API key as 'Authorization: Bearer <key>'.",
                ))
            }
        };
        match self.by_key.get(key) {
            Some(tenant) => Ok(Tenant(tenant.clone())),
            None => Err(ApiError::new(
                ErrorCode::InvalidApiKey,
                "Incorrect API key provided.",
            )),
        }
    }
}

/// The tenant a trusted proxy named in `name`: its last value, as a proxy appends the caller it
/// checked after whatever the client sent (as another line or after a comma).
fn tenant_from_header(
    name: &axum::http::HeaderName,
    headers: &axum::http::HeaderMap,
) -> Result<Tenant, ApiError> {
    let missing = || {
        ApiError::new(
            ErrorCode::InvalidApiKey,
            format!(
                "The request has no {name} header: it must come through the authenticating proxy."
            ),
        )
    };
    let last = headers
        .get_all(name)
        .iter()
        .next_back()
        .ok_or_else(missing)?;
    let Ok(value) = last.to_str() else {
        return Err(ApiError::invalid(
            format!("The {name} header is not plain ASCII."),
            None,
        ));
    };
    let value = value.rsplit(',').next().unwrap_or("").trim();
    if value.is_empty() {
        return Err(missing());
    }
    match batch_config::check_tenant(value) {
        Ok(()) => Ok(Tenant(value.to_owned())),
        // The value itself is not echoed: it is whatever the client or proxy sent.
        Err(_) => Err(ApiError::invalid(
            format!(
                "The {name} header is not a valid user name: 1 to 64 ASCII letters, digits, '-', '_', '.' or '@'."
            ),
            None,
        )),
    }
}

impl FromRequestParts<Arc<Api>> for Tenant {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        api: &Arc<Api>,
    ) -> Result<Self, Self::Rejection> {
        api.keys.tenant(&parts.headers)
    }
}
