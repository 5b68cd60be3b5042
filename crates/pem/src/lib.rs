#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

use std::path::{Path, PathBuf};

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::RootCertStore;

/// Why a PEM file gave nothing usable. The message starts with the file's path.
#[derive(Debug, thiserror::Error)]
pub enum PemError {
    /// The file cannot be read, or is not PEM.
    #[error("{}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What reading or parsing it said.
        source: pem::Error,
    },
    /// The file holds no certificate.
    #[error("{}: no PEM certificate in the file", path.display())]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// The file holds no private key rustls can use.
    #[error("{}: no usable private key: {source}", path.display())]
    NoKey {
        /// The file.
        path: PathBuf,
        /// What reading or parsing it said.
        source: pem::Error,
    },
    /// A certificate of a CA file cannot be a trust anchor.
    #[error("{}: unusable CA certificate: {source}", path.display())]
    UnusableCa {
        /// The file.
        path: PathBuf,
        /// Why rustls refused it.
        source: rustls::Error,
    },
}

/// Every certificate in the PEM file at `path`, in order; at least one.
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|source| PemError::Read {
            path: path.to_path_buf(),
            source,
        })?;
    if certs.is_empty() {
        return Err(PemError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

/// The first private key (PKCS#8, PKCS#1 or SEC1) in the PEM file at `path`.
pub fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, PemError> {
    PrivateKeyDer::from_pem_file(path).map_err(|source| PemError::NoKey {
        path: path.to_path_buf(),
        source,
    })
}

/// Adds every certificate of the CA file at `path` to `roots`, each of which must be usable as
/// a trust anchor.
pub fn add_roots(roots: &mut RootCertStore, path: &Path) -> Result<(), PemError> {
    for cert in read_certs(path)? {
        roots.add(cert).map_err(|source| PemError::UnusableCa {
            path: path.to_path_buf(),
            source,
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_and_keys_are_read_and_bad_files_named() {
        let dir = batch_testkit::tempdir().unwrap();
        let pki = batch_testkit::TestPki::generate(dir.path());
        assert_eq!(read_certs(&pki.client_cert).unwrap().len(), 1);
        read_key(&pki.client_key).unwrap();
        let mut roots = RootCertStore::empty();
        add_roots(&mut roots, &pki.ca).unwrap();
        assert_eq!(roots.len(), 1);

        let missing = dir.path().join("missing.pem");
        let e = read_certs(&missing).unwrap_err();
        assert!(matches!(e, PemError::Read { .. }), "{e:?}");
        assert!(
            e.to_string()
                .starts_with(&format!("{}: ", missing.display())),
            "{e}"
        );
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        assert_eq!(
            read_certs(&empty).unwrap_err().to_string(),
            format!("{}: no PEM certificate in the file", empty.display())
        );
        // A certificate is no key, and a key no certificate.
        let e = read_key(&pki.client_cert).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "{}: no usable private key",
                pki.client_cert.display()
            )),
            "{e}"
        );
        assert!(matches!(
            read_certs(&pki.client_key),
            Err(PemError::NoCertificate { .. })
        ));
    }
}
