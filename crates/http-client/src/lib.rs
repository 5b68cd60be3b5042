#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::dns::Name;
use hyper_util::client::legacy::connect::{Connect, HttpConnector};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// TLS settings of a client. Endpoints with equal settings can share one connection pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct TlsOptions {
    /// PEM file of extra trusted CA certificates (added to the system roots).
    pub ca_cert_file: Option<PathBuf>,
    /// PEM file of the client certificate chain, for mutual TLS; needs `client_key_file`.
    pub client_cert_file: Option<PathBuf>,
    /// PEM file of the client private key; needs `client_cert_file`.
    pub client_key_file: Option<PathBuf>,
    /// Accept any server certificate. For tests and labs only.
    pub insecure_skip_verify: bool,
}

/// Why a client could not be built: its TLS settings are unusable (a file that cannot be read
/// or holds nothing usable, a certificate without its key). The message names the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tls: {0}")]
pub struct TlsError(pub String);

/// A keep-alive client with its TLS settings ([`build`]); clones share its connection pool.
pub type HttpClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Idle keep-alive connections are closed after this long.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// A keep-alive client that connects only to the addresses a host name resolves to that a
/// rule accepts (see [`CheckedResolver`]).
pub type CheckedClient = Client<HttpsConnector<HttpConnector<CheckedResolver>>, Full<Bytes>>;

/// A keep-alive http and https client with these TLS settings; it follows no redirect.
pub fn build(tls: &TlsOptions) -> Result<HttpClient, TlsError> {
    over(tls, HttpConnector::new())
}

/// Like [`build`], connecting to a host name only through the addresses `allow` accepts: a
/// name whose every address is refused is a connection error naming them. IP literals are not
/// resolved, so not seen by `allow`.
pub fn build_checked(
    tls: &TlsOptions,
    allow: impl Fn(IpAddr) -> bool + Send + Sync + 'static,
) -> Result<CheckedClient, TlsError> {
    over(
        tls,
        HttpConnector::new_with_resolver(CheckedResolver {
            allow: Arc::new(allow),
        }),
    )
}

fn over<R>(
    tls: &TlsOptions,
    mut http: HttpConnector<R>,
) -> Result<Client<HttpsConnector<HttpConnector<R>>, Full<Bytes>>, TlsError>
where
    HttpsConnector<HttpConnector<R>>: Connect + Clone + Send + Sync + 'static,
{
    let config = tls_config(tls)?;
    http.enforce_http(false);
    http.set_nodelay(true);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .build(https))
}

/// Resolves host names with the system's resolver and keeps the addresses a rule accepts,
/// at each connection: what a name resolved to when it was checked may not be what it
/// resolves to when it is called.
#[derive(Clone)]
pub struct CheckedResolver {
    allow: Arc<dyn Fn(IpAddr) -> bool + Send + Sync>,
}

impl tower::Service<Name> for CheckedResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let allow = self.allow.clone();
        Box::pin(async move {
            let host = name.as_str();
            let found: Vec<SocketAddr> = tokio::net::lookup_host((host, 0)).await?.collect();
            let kept: Vec<SocketAddr> = found.iter().copied().filter(|a| allow(a.ip())).collect();
            if kept.is_empty() {
                let refused: Vec<IpAddr> = found.iter().map(SocketAddr::ip).collect();
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("{host} resolves to no address the rules allow ({refused:?})"),
                ));
            }
            Ok(kept.into_iter())
        })
    }
}

fn tls_error(path: Option<&Path>, message: impl std::fmt::Display) -> TlsError {
    TlsError(match path {
        Some(path) => format!("{}: {message}", path.display()),
        None => message.to_string(),
    })
}

fn tls_config(tls: &TlsOptions) -> Result<ClientConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| tls_error(None, e))?;
    let builder = if tls.insecure_skip_verify {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyServerCert(provider)))
    } else {
        builder.with_root_certificates(roots(tls.ca_cert_file.as_deref())?)
    };
    match (&tls.client_cert_file, &tls.client_key_file) {
        (Some(cert_file), Some(key_file)) => {
            let chain = batch_pem::read_certs(cert_file).map_err(pem_error)?;
            let key = batch_pem::read_key(key_file).map_err(pem_error)?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| tls_error(Some(cert_file), e))
        }
        (None, None) => Ok(builder.with_no_client_auth()),
        _ => Err(tls_error(
            None,
            "client_cert_file and client_key_file go together",
        )),
    }
}

/// A PEM file's problem, whose message already names the file.
fn pem_error(e: batch_pem::PemError) -> TlsError {
    TlsError(e.to_string())
}

/// The system's roots plus the configured CA file.
fn roots(ca_cert_file: Option<&Path>) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    // A container may have no system store at all; the CA file is then the only root.
    let native = rustls_native_certs::load_native_certs();
    roots.add_parsable_certificates(native.certs);
    if let Some(path) = ca_cert_file {
        batch_pem::add_roots(&mut roots, path).map_err(pem_error)?;
    }
    Ok(roots)
}

/// `insecure_skip_verify`: trusts any certificate, but still checks the handshake signatures
/// so the session keys belong to whoever presented it.
#[derive(Debug)]
struct AcceptAnyServerCert(Arc<CryptoProvider>);

impl ServerCertVerifier for AcceptAnyServerCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// An error with its causes, `: `-separated: hyper keeps what went wrong in the source chain and
/// its own message is terse (`client error (Connect)`).
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_certificate_needs_its_key() {
        let dir = batch_testkit::tempdir().unwrap();
        let pki = batch_testkit::TestPki::generate(dir.path());
        let tls = TlsOptions {
            client_cert_file: Some(pki.client_cert.clone()),
            ..TlsOptions::default()
        };
        let e = build(&tls).err().unwrap();
        assert_eq!(
            e.to_string(),
            "tls: client_cert_file and client_key_file go together"
        );
        let tls = TlsOptions {
            ca_cert_file: Some(pki.ca.clone()),
            client_cert_file: Some(pki.client_cert.clone()),
            client_key_file: Some(pki.client_key.clone()),
            insecure_skip_verify: false,
        };
        assert!(build(&tls).is_ok());
    }

    #[test]
    fn an_unusable_ca_file_is_named() {
        let dir = batch_testkit::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let tls = TlsOptions {
            ca_cert_file: Some(missing.clone()),
            ..TlsOptions::default()
        };
        let e = build(&tls).err().unwrap();
        assert!(e.0.starts_with(&missing.display().to_string()), "{e}");

        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let tls = TlsOptions {
            ca_cert_file: Some(empty.clone()),
            ..TlsOptions::default()
        };
        let e = build(&tls).err().unwrap();
        assert_eq!(
            e.0,
            format!("{}: no PEM certificate in the file", empty.display())
        );
    }

    #[tokio::test]
    async fn the_resolver_keeps_only_the_addresses_allowed() {
        use tower::Service;
        let name = |host: &str| host.parse::<Name>().unwrap();
        let mut open = CheckedResolver {
            allow: Arc::new(|_| true),
        };
        let found: Vec<SocketAddr> = open.call(name("localhost")).await.unwrap().collect();
        assert!(found.iter().all(|a| a.ip().is_loopback()), "{found:?}");
        assert!(!found.is_empty());

        let mut closed = CheckedResolver {
            allow: Arc::new(|ip: IpAddr| !ip.is_loopback()),
        };
        let e = closed.call(name("localhost")).await.err().unwrap();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
        assert!(
            e.to_string()
                .starts_with("localhost resolves to no address the rules allow"),
            "{e}"
        );
    }
}
