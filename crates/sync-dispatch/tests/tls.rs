//! HTTPS with a custom CA and client certificates, against a tokio-rustls server on 127.0.0.1.

mod common;

use std::sync::Arc;

use batch_sync_dispatch::{DispatchError, LimitOptions, SyncDispatcher, SyncOutcome, TlsOptions};
use batch_testkit::TestPki;
use common::{fast_options, request, Gateway, Reply};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

/// A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files in a
/// directory kept as long as they are used.
struct Pki {
    _dir: tempfile::TempDir,
    files: TestPki,
}

impl std::ops::Deref for Pki {
    type Target = TestPki;
    fn deref(&self) -> &TestPki {
        &self.files
    }
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let files = TestPki::generate(dir.path());
    Pki { _dir: dir, files }
}

fn acceptor(pki: &Pki, require_client_cert: bool) -> tokio_rustls::TlsAcceptor {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&pki.server_cert)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(&pki.server_key).unwrap();
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = if require_client_cert {
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_file(&pki.ca).unwrap())
            .unwrap();
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .unwrap();
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let config = builder.with_single_cert(chain, key).unwrap();
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

fn failure(outcome: SyncOutcome) -> (String, String) {
    match outcome {
        SyncOutcome::Failed { code, message } => (code, message),
        other => panic!("expected a failure, got {other:?}"),
    }
}

#[tokio::test]
async fn mutual_tls_with_a_custom_ca_and_a_client_certificate() {
    let pki = pki();
    let gateway = Gateway::start_tls(acceptor(&pki, true), |_, _| Reply::ok()).await;
    assert!(gateway.url.starts_with("https://"));
    let d = SyncDispatcher::new(LimitOptions::default());

    let mut options = fast_options(&gateway.url);
    options.max_retries = 0;
    options.tls = TlsOptions {
        ca_cert_file: Some(pki.ca.clone()),
        client_cert_file: Some(pki.client_cert.clone()),
        client_key_file: Some(pki.client_key.clone()),
        insecure_skip_verify: false,
    };
    d.add_endpoint("mtls", options.clone()).unwrap();
    let outcome = d.dispatch("mtls", request("r1")).await;
    assert!(
        matches!(outcome, SyncOutcome::Http { status: 200, .. }),
        "{outcome:?}"
    );
    assert_eq!(gateway.counters.requests(), 1);

    // Same CA, no client certificate: the server refuses the handshake.
    options.tls.client_cert_file = None;
    options.tls.client_key_file = None;
    d.add_endpoint("no-client-cert", options).unwrap();
    let (code, _) = failure(d.dispatch("no-client-cert", request("r2")).await);
    assert_eq!(code, "INFERENCE_ERROR");
    assert_eq!(gateway.counters.requests(), 1, "nothing got through");
}

#[tokio::test]
async fn an_unknown_ca_is_refused_unless_verification_is_skipped() {
    let pki = pki();
    let gateway = Gateway::start_tls(acceptor(&pki, false), |_, _| Reply::ok()).await;
    let d = SyncDispatcher::new(LimitOptions::default());

    let mut options = fast_options(&gateway.url);
    options.max_retries = 0;
    d.add_endpoint("system-roots", options.clone()).unwrap();
    let (code, message) = failure(d.dispatch("system-roots", request("r1")).await);
    assert_eq!(code, "INFERENCE_ERROR");
    assert!(message.to_lowercase().contains("certificate"), "{message}");
    assert_eq!(gateway.counters.requests(), 0);

    options.tls.insecure_skip_verify = true;
    d.add_endpoint("insecure", options.clone()).unwrap();
    let outcome = d.dispatch("insecure", request("r2")).await;
    assert!(
        matches!(outcome, SyncOutcome::Http { status: 200, .. }),
        "{outcome:?}"
    );

    options.tls.insecure_skip_verify = false;
    options.tls.ca_cert_file = Some(pki.ca.clone());
    d.add_endpoint("custom-ca", options).unwrap();
    let outcome = d.dispatch("custom-ca", request("r3")).await;
    assert!(
        matches!(outcome, SyncOutcome::Http { status: 200, .. }),
        "{outcome:?}"
    );
    assert_eq!(gateway.counters.requests(), 2);
}

#[test]
fn unreadable_tls_files_are_reported_with_their_path() {
    let pki = pki();
    let d = SyncDispatcher::new(LimitOptions::default());
    let mut options = fast_options("https://127.0.0.1:1");
    options.tls.ca_cert_file = Some("/nonexistent/ca.pem".into());
    let err = d.add_endpoint("a", options.clone()).unwrap_err();
    assert!(
        matches!(&err, DispatchError::Tls(m) if m.contains("/nonexistent/ca.pem")),
        "{err}"
    );

    // A key file where a certificate is expected.
    options.tls.ca_cert_file = Some(pki.client_key.clone());
    let err = d.add_endpoint("b", options.clone()).unwrap_err();
    assert!(
        matches!(&err, DispatchError::Tls(m) if m.contains("client.key")),
        "{err}"
    );

    // A certificate where the key is expected.
    options.tls.ca_cert_file = Some(pki.ca.clone());
    options.tls.client_cert_file = Some(pki.client_cert.clone());
    options.tls.client_key_file = Some(pki.client_cert.clone());
    let err = d.add_endpoint("c", options).unwrap_err();
    assert!(
        matches!(&err, DispatchError::Tls(m) if m.contains("private key")),
        "{err}"
    );
}
