//! TLS towards Redis with rustls (ring): the CA file or the system roots, optional client
//! certificate, optional server name to verify instead of the URL's host.

use std::path::PathBuf;
use std::sync::Arc;

use fred::types::config::{TlsConfig, TlsConnector, TlsHostMapping};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// TLS settings for a `rediss…` URL. Every file is PEM; the default (all `None`) trusts the
/// system's roots and sends no client certificate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisTls {
    /// CA bundle to trust instead of the system roots.
    pub ca_file: Option<PathBuf>,
    /// Client certificate chain for mutual TLS; set together with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// The client certificate's private key; set together with `cert_file`.
    pub key_file: Option<PathBuf>,
    /// The name the server certificate must carry, when it is not the URL's host (or, for a
    /// cluster or sentinel, the addresses the servers announce).
    pub server_name: Option<String>,
}

impl RedisTls {
    /// Who must have signed the server's certificate, for messages.
    pub(crate) fn trust_description(&self) -> String {
        match &self.ca_file {
            Some(path) => format!("the CA in ca_file {}", path.display()),
            None => "the system's root certificates (set ca_file for a private CA)".to_owned(),
        }
    }

    /// Reads and checks every file and the server name as [`crate::connect`] would, so a
    /// config check refuses what connecting would refuse. The error names the field and file.
    pub fn check(&self) -> Result<(), TlsSetupError> {
        self.to_fred()
            .map(drop)
            .map_err(|reason| TlsSetupError { reason })
    }

    /// fred's TLS settings; errors name the file or field at fault.
    pub(crate) fn to_fred(&self) -> Result<TlsConfig, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = Arc::new(self.roots()?);
        let webpki = WebPkiServerVerifier::builder_with_provider(roots, Arc::clone(&provider))
            .build()
            .map_err(|e| format!("cannot build the certificate verifier: {e}"))?;
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("no usable TLS version: {e}"))?;
        let builder = match &self.server_name {
            Some(name) => {
                let name = ServerName::try_from(name.clone()).map_err(|_| {
                    format!("server_name {name:?} is not a valid DNS name or IP address")
                })?;
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(VerifyAs {
                        inner: webpki,
                        name,
                    }))
            }
            None => builder.with_webpki_verifier(webpki),
        };
        let config = match (&self.cert_file, &self.key_file) {
            (Some(cert_file), Some(key_file)) => {
                let chain = batch_pem::read_certs(cert_file).map_err(named("cert_file"))?;
                let key = batch_pem::read_key(key_file).map_err(named("key_file"))?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    format!(
                        "cert_file {} and key_file {} do not make a client identity: {e}",
                        cert_file.display(),
                        key_file.display()
                    )
                })?
            }
            (None, None) => builder.with_no_client_auth(),
            (Some(_), None) => return Err("cert_file is set without key_file".into()),
            (None, Some(_)) => return Err("key_file is set without cert_file".into()),
        };
        Ok(TlsConfig {
            connector: TlsConnector::from(config),
            hostnames: TlsHostMapping::None,
        })
    }

    fn roots(&self) -> Result<RootCertStore, String> {
        let mut roots = RootCertStore::empty();
        match &self.ca_file {
            Some(path) => batch_pem::add_roots(&mut roots, path).map_err(named("ca_file"))?,
            None => {
                let native = rustls_native_certs::load_native_certs();
                let (added, _) = roots.add_parsable_certificates(native.certs);
                if added == 0 {
                    let why = native
                        .errors
                        .first()
                        .map(|e| format!(" ({e})"))
                        .unwrap_or_default();
                    return Err(format!(
                        "no system root certificate found{why}; set ca_file to the CA that signed the server's certificate"
                    ));
                }
            }
        }
        Ok(roots)
    }
}

/// A PEM file's problem (which names the file) prefixed with the setting that named the file.
fn named(field: &'static str) -> impl Fn(batch_pem::PemError) -> String {
    move |e| format!("{field} {e}")
}

/// Why TLS settings cannot be used; the message names the field and file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct TlsSetupError {
    /// What is wrong.
    pub reason: String,
}

/// Verifies the chain as usual, but against the configured `server_name`.
#[derive(Debug)]
struct VerifyAs {
    inner: Arc<WebPkiServerVerifier>,
    name: ServerName<'static>,
}

impl ServerCertVerifier for VerifyAs {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner
            .verify_server_cert(end_entity, intermediates, &self.name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A handshake failure explained, from the text fred reports; `None` when it is not one.
pub(crate) fn explain_handshake(detail: &str, tls: &RedisTls) -> Option<String> {
    let has = |s: &str| detail.contains(s);
    let why = if has("UnknownIssuer") || has("BadSignature") {
        format!(
            "the server's certificate is not trusted by {}",
            tls.trust_description()
        )
    } else if has("NotValidForName") {
        match &tls.server_name {
            Some(name) => format!("the server's certificate is not valid for server_name {name:?}"),
            None => "the server's certificate is not valid for the host in the URL \
                (set server_name to the name it carries)"
                .to_owned(),
        }
    } else if has("Expired") || has("NotValidYet") {
        "the server's certificate is expired or not yet valid".to_owned()
    } else if has("CertificateRequired") || (has("HandshakeFailure") && tls.cert_file.is_none()) {
        "the server requires a client certificate (set cert_file and key_file)".to_owned()
    } else if has("InvalidContentType")
        || has("CorruptMessage")
        || has("InvalidMessage")
        || has("received corrupt message")
        || has("HandshakeNotComplete")
        || has("tls handshake eof")
    {
        "the server did not answer the TLS handshake (does the server speak TLS on this port?)"
            .to_owned()
    } else if has("InvalidCertificate")
        || has("AlertReceived")
        || has("PeerIncompatible")
        || has("PeerMisbehaved")
    {
        "the TLS handshake was refused".to_owned()
    } else {
        return None;
    };
    Some(format!("{why}: {}", short(detail)))
}

/// rustls' error out of fred's `Custom { kind: InvalidData, error: … }` wrapping.
fn short(detail: &str) -> &str {
    match detail.split_once("error: ") {
        Some((head, rest)) if head.starts_with("Custom {") => {
            rest.strip_suffix(" }").unwrap_or(rest)
        }
        _ => detail,
    }
}
