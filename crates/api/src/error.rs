//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`. Every error the
//! API answers is one [`ErrorCode`]: its HTTP status, `type` and `code` come from the table
//! there, the message (and a parameter at fault) from the route.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use batch_wire::error_codes;
use serde_json::json;

/// Every error of the Files and Batches API, as OpenAI answers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// 400: the request cannot succeed as sent.
    InvalidRequest,
    /// 401: no API key, or one the service does not know.
    InvalidApiKey,
    /// 404: no such object (also another tenant's), or no such route.
    NotFound,
    /// 405: the route does not take this method.
    MethodNotAllowed,
    /// 413: a JSON body over `serve.max_json_body_bytes`.
    RequestTooLarge,
    /// 413: an upload over the service's file size limit.
    FileTooLarge,
    /// 413: an upload with more requests than the service's limit.
    TooManyRequestsInFile,
    /// 414: a request URL over [`crate::MAX_URI_BYTES`].
    UriTooLong,
    /// 431: request headers over [`crate::MAX_HEADERS`] or [`crate::MAX_HEADER_BYTES`].
    HeadersTooLarge,
    /// 429: a tenant over one of its quotas. SDKs are told not to retry it: waiting alone does
    /// not cure it.
    InsufficientQuota,
    /// 500.
    Internal,
    /// 503: a part the service needs (Redis, storage) is not answering; the SDK retries it.
    Unavailable,
}

impl ErrorCode {
    /// The HTTP status, the error's `type`, its `code`, and the `param` it always names.
    const fn row(
        self,
    ) -> (
        StatusCode,
        &'static str,
        Option<&'static str>,
        Option<&'static str>,
    ) {
        const INVALID: &str = "invalid_request_error";
        match self {
            Self::InvalidRequest => (StatusCode::BAD_REQUEST, INVALID, None, None),
            Self::InvalidApiKey => (
                StatusCode::UNAUTHORIZED,
                INVALID,
                Some("invalid_api_key"),
                None,
            ),
            Self::NotFound => (StatusCode::NOT_FOUND, INVALID, None, None),
            Self::MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, INVALID, None, None),
            Self::RequestTooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                INVALID,
                Some("request_too_large"),
                None,
            ),
            Self::FileTooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                INVALID,
                Some(error_codes::FILE_TOO_LARGE),
                Some("file"),
            ),
            Self::TooManyRequestsInFile => (
                StatusCode::PAYLOAD_TOO_LARGE,
                INVALID,
                Some(error_codes::TOO_MANY_REQUESTS_IN_FILE),
                Some("file"),
            ),
            Self::UriTooLong => (
                StatusCode::URI_TOO_LONG,
                INVALID,
                Some("uri_too_long"),
                None,
            ),
            Self::HeadersTooLarge => (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                INVALID,
                Some("headers_too_large"),
                None,
            ),
            Self::InsufficientQuota => (
                StatusCode::TOO_MANY_REQUESTS,
                "insufficient_quota",
                Some("insufficient_quota"),
                None,
            ),
            Self::Internal => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                None,
                None,
            ),
            Self::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "server_error", None, None),
        }
    }

    /// The HTTP status.
    pub const fn status(self) -> StatusCode {
        self.row().0
    }

    /// OpenAI's error `type`.
    pub const fn kind(self) -> &'static str {
        self.row().1
    }

    /// The machine-readable `code`, if it has one.
    pub const fn code(self) -> Option<&'static str> {
        self.row().2
    }
}

/// An error answer of the API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// Which error.
    pub code: ErrorCode,
    /// What went wrong, for a person.
    pub message: String,
    /// The parameter at fault, if one is.
    pub param: Option<String>,
}

impl ApiError {
    /// Error `code` saying `message`, with the parameter the code always names, if any.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            param: code.row().3.map(str::to_owned),
        }
    }

    /// With `param` as the parameter at fault.
    pub fn param(mut self, param: &str) -> Self {
        self.param = Some(param.to_owned());
        self
    }

    /// [`ErrorCode::InvalidRequest`], the most common, naming `param` if one is at fault.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        let e = Self::new(ErrorCode::InvalidRequest, message);
        match param {
            Some(p) => e.param(p),
            None => e,
        }
    }
}

impl From<batch_state::StoreError> for ApiError {
    fn from(e: batch_state::StoreError) -> Self {
        if let batch_state::StoreError::UnknownCursor(id) = &e {
            return Self::invalid(
                format!("after {id:?} names no object of this listing: give the id of an object listed before, or a number of objects to skip."),
                Some("after"),
            );
        }
        tracing::warn!(error = %e, "state store failed");
        if e.is_transient() {
            Self::new(
                ErrorCode::Unavailable,
                "The service's state store is not answering; retry shortly.",
            )
        } else {
            Self::new(
                ErrorCode::Internal,
                format!("The service's state store failed: {e}"),
            )
        }
    }
}

impl From<batch_storage::StorageError> for ApiError {
    fn from(e: batch_storage::StorageError) -> Self {
        tracing::warn!(error = %e, "storage failed");
        match e {
            batch_storage::StorageError::NotFound(_) => Self::new(
                ErrorCode::NotFound,
                "The file's content is gone from storage.",
            ),
            _ => Self::new(
                ErrorCode::Unavailable,
                "The service's storage is not answering; retry shortly.",
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind, code, _) = self.code.row();
        let body = json!({
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": code,
            }
        });
        let mut response = (status, axum::Json(body)).into_response();
        if status.is_client_error() {
            // Permanent: an SDK that honours this header does not retry it.
            response.headers_mut().insert(
                "x-should-retry",
                axum::http::HeaderValue::from_static("false"),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes OpenAI's SDKs read, for a code with a fixed param and one without a code.
    #[tokio::test]
    async fn answers_keep_their_shape() {
        let cases = [
            (
                ApiError::new(ErrorCode::FileTooLarge, "big"),
                413,
                r#"{"error":{"code":"file_too_large","message":"big","param":"file","type":"invalid_request_error"}}"#,
            ),
            (
                ApiError::invalid("bad", Some("limit")),
                400,
                r#"{"error":{"code":null,"message":"bad","param":"limit","type":"invalid_request_error"}}"#,
            ),
            (
                ApiError::new(ErrorCode::InsufficientQuota, "full").param("file"),
                429,
                r#"{"error":{"code":"insufficient_quota","message":"full","param":"file","type":"insufficient_quota"}}"#,
            ),
            (
                ApiError::new(ErrorCode::Unavailable, "down"),
                503,
                r#"{"error":{"code":null,"message":"down","param":null,"type":"server_error"}}"#,
            ),
        ];
        for (error, status, body) in cases {
            let response = error.into_response();
            assert_eq!(response.status().as_u16(), status);
            assert_eq!(
                response.headers().get("x-should-retry").is_some(),
                status < 500
            );
            let bytes = axum::body::to_bytes(response.into_body(), 1 << 10)
                .await
                .unwrap();
            assert_eq!(std::str::from_utf8(&bytes).unwrap(), body);
        }
    }
}
