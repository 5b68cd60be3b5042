//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answer of the API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, `authentication_error`, `server_error`).
    pub kind: &'static str,
    /// The parameter at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code, if any.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400: the request cannot succeed as sent.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
        }
    }

    /// 401.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 404, also for another tenant's objects.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 413.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some("file".into()),
            code: Some(batch_wire::error_codes::FILE_TOO_LARGE),
        }
    }

    /// 429 for a tenant over one of its quotas, OpenAI's `insufficient_quota` shape; the message
    /// names the quota. SDKs are told not to retry it: waiting alone does not cure it.
    pub fn over_quota(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "insufficient_quota",
            param: param.map(str::to_owned),
            code: Some("insufficient_quota"),
        }
    }

    /// 503: a part the service needs (Redis, storage) is not answering; the SDK retries it.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// With this code.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
}

impl From<batch_state::StoreError> for ApiError {
    fn from(e: batch_state::StoreError) -> Self {
        tracing::warn!(error = %e, "state store failed");
        if e.is_transient() {
            Self::unavailable("The service's state store is not answering; retry shortly.")
        } else {
            Self::internal(format!("The service's state store failed: {e}"))
        }
    }
}

impl From<batch_storage::StorageError> for ApiError {
    fn from(e: batch_storage::StorageError) -> Self {
        tracing::warn!(error = %e, "storage failed");
        match e {
            batch_storage::StorageError::NotFound(_) => {
                Self::not_found("The file's content is gone from storage.")
            }
            _ => Self::unavailable("The service's storage is not answering; retry shortly."),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        });
        let mut response = (self.status, axum::Json(body)).into_response();
        if self.status.is_client_error() {
            // Permanent: an SDK that honours this header does not retry it.
            response.headers_mut().insert(
                "x-should-retry",
                axum::http::HeaderValue::from_static("false"),
            );
        }
        response
    }
}
