//! The pooled HTTP(S) client, built by [`batch_http_client`]; its TLS errors are
//! [`DispatchError::Tls`].

use std::net::IpAddr;

pub use batch_http_client::{CheckedClient, CheckedResolver, HttpClient};

use crate::{DispatchError, TlsOptions};

impl From<batch_http_client::TlsError> for DispatchError {
    fn from(e: batch_http_client::TlsError) -> Self {
        DispatchError::Tls(e.0)
    }
}

/// A keep-alive http and https client with these TLS settings; it follows no redirect.
pub fn build(tls: &TlsOptions) -> Result<HttpClient, DispatchError> {
    Ok(batch_http_client::build(tls)?)
}

/// Like [`build`], connecting to a host name only through the addresses `allow` accepts: a
/// name whose every address is refused is a connection error naming them. IP literals are not
/// resolved, so not seen by `allow`.
pub fn build_checked(
    tls: &TlsOptions,
    allow: impl Fn(IpAddr) -> bool + Send + Sync + 'static,
) -> Result<CheckedClient, DispatchError> {
    Ok(batch_http_client::build_checked(tls, allow)?)
}
