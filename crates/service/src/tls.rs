//! HTTPS on the API (`serve.tls`): the certificate and key are read from their files at start,
//! and again whenever the files' bytes change, as a mounted Kubernetes secret is updated in
//! place (cert-manager renewing it); connections open at the change keep the certificate they
//! started with.

use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use batch_config::ServeTls;
use rustls::crypto::ring::sign::any_supported_type;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// How often the files are read to see whether they changed (two small files).
const CHECK_EVERY: Duration = Duration::from_secs(2);

/// The files' bytes, to tell a change.
type Stamp = (Vec<u8>, Vec<u8>);

/// The certificate served, swapped when its files change.
#[derive(Debug)]
pub(crate) struct Certificates {
    files: ServeTls,
    current: RwLock<(Stamp, Arc<CertifiedKey>)>,
}

impl Certificates {
    /// Reads the files; an error names the file and what is wrong with it.
    pub(crate) fn load(files: &ServeTls) -> Result<Arc<Self>, String> {
        let stamp = read_stamp(files)?;
        let key = certified_key(files, &stamp)?;
        Ok(Arc::new(Self {
            files: files.clone(),
            current: RwLock::new((stamp, key)),
        }))
    }

    /// A TLS acceptor serving the current certificate (HTTP/1.1 only, as the server).
    pub(crate) fn acceptor(self: &Arc<Self>) -> Result<TlsAcceptor, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("serve.tls: {e}"))?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(TlsAcceptor::from(Arc::new(config)))
    }

    /// Reads the files every [`CHECK_EVERY`] until `stop`, and serves what they hold once it
    /// changed and is a valid pair; a bad pair (a half-written update) is logged and the
    /// certificate in use kept.
    pub(crate) async fn watch(self: Arc<Self>, stop: CancellationToken) {
        let mut failing = false;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(CHECK_EVERY) => {}
            }
            let files = self.files.clone();
            let me = self.clone();
            let changed = tokio::task::spawn_blocking(move || {
                let stamp = read_stamp(&files)?;
                if me.current.read().unwrap_or_else(|e| e.into_inner()).0 == stamp {
                    return Ok(false);
                }
                let key = certified_key(&files, &stamp)?;
                *me.current.write().unwrap_or_else(|e| e.into_inner()) = (stamp, key);
                Ok::<_, String>(true)
            })
            .await;
            match changed {
                Ok(Ok(true)) => {
                    failing = false;
                    tracing::info!(cert = %self.files.cert_file.display(), "serve.tls: serving the new certificate");
                }
                Ok(Ok(false)) => failing = false,
                Ok(Err(e)) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, "serve.tls: keeping the certificate in use");
                }
                _ => {}
            }
        }
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .1
                .clone(),
        )
    }
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("serve.tls: reading {}: {e}", path.display()))
}

fn read_stamp(files: &ServeTls) -> Result<Stamp, String> {
    Ok((read(&files.cert_file)?, read(&files.key_file)?))
}

/// The certificate chain and key of `stamp` (the files' bytes), checked to belong together.
fn certified_key(files: &ServeTls, (cert, key): &Stamp) -> Result<Arc<CertifiedKey>, String> {
    let cert_name = files.cert_file.display();
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("serve.tls: {cert_name}: {e}"))?;
    if chain.is_empty() {
        return Err(format!("serve.tls: {cert_name} holds no certificate"));
    }
    let key_name = files.key_file.display();
    let key = PrivateKeyDer::from_pem_slice(key)
        .map_err(|e| format!("serve.tls: {key_name} holds no private key: {e}"))?;
    let signer = any_supported_type(&key).map_err(|e| format!("serve.tls: {key_name}: {e}"))?;
    let certified = CertifiedKey::new(chain, signer);
    certified
        .keys_match()
        .map_err(|e| format!("serve.tls: {key_name} is not the key of {cert_name}: {e}"))?;
    Ok(Arc::new(certified))
}
