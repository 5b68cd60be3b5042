//! A TLS-only `redis-server` with certificates made in the test ([`TestPki`], rcgen).

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tempfile::TempDir;

use crate::process::Process;
use crate::{binary, free_port, spawn_command};

/// A fresh CA with a server certificate for `127.0.0.1` and `localhost` and a client
/// certificate, all PEM files in one directory.
#[derive(Debug, Clone)]
pub struct TestPki {
    /// The CA certificate.
    pub ca: PathBuf,
    /// The server certificate (SANs `127.0.0.1`, `localhost`), signed by the CA.
    pub server_cert: PathBuf,
    /// The server's private key.
    pub server_key: PathBuf,
    /// A client certificate (for mutual TLS), signed by the CA.
    pub client_cert: PathBuf,
    /// The client's private key.
    pub client_key: PathBuf,
}

impl TestPki {
    /// Makes the CA and both certificates in `dir` (files `ca.pem`, `server.pem`, `server.key`,
    /// `client.pem`, `client.key`). Every call makes a different CA.
    pub fn generate(dir: &Path) -> Self {
        let ca_key = KeyPair::generate().expect("generating the CA key");
        let mut ca_params =
            CertificateParams::new(Vec::<String>::new()).expect("CA certificate parameters");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "batch-testkit CA");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key).expect("signing the CA");
        let issuer = Issuer::new(ca_params, ca_key);
        let (server_cert, server_key) = leaf(
            vec!["127.0.0.1".into(), "localhost".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
            &issuer,
        );
        let (client_cert, client_key) = leaf(
            vec!["batch-processor".into()],
            ExtendedKeyUsagePurpose::ClientAuth,
            &issuer,
        );
        let write = |name: &str, pem: &str| {
            let path = dir.join(name);
            std::fs::write(&path, pem).unwrap_or_else(|e| panic!("writing {name}: {e}"));
            path
        };
        TestPki {
            ca: write("ca.pem", &ca_cert.pem()),
            server_cert: write("server.pem", &server_cert),
            server_key: write("server.key", &server_key),
            client_cert: write("client.pem", &client_cert),
            client_key: write("client.key", &client_key),
        }
    }
}

fn leaf(
    names: Vec<String>,
    usage: ExtendedKeyUsagePurpose,
    issuer: &Issuer<'_, KeyPair>,
) -> (String, String) {
    let key = KeyPair::generate().expect("generating a key");
    let mut params = CertificateParams::new(names).expect("certificate parameters");
    params
        .distinguished_name
        .push(DnType::CommonName, "batch-testkit leaf");
    params.use_authority_key_identifier_extension = true;
    params.key_usages.push(KeyUsagePurpose::DigitalSignature);
    params.extended_key_usages.push(usage);
    let cert = params.signed_by(&key, issuer).expect("signing a leaf");
    (cert.pem(), key.serialize_pem())
}

/// Whether the TLS server asks clients for a certificate (`--tls-auth-clients`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// A client may present one (`optional`).
    Optional,
    /// A client must present one signed by the CA (`yes`).
    Required,
}

/// A running TLS-only `redis-server` (`--port 0 --tls-port P`) on 127.0.0.1, killed when
/// dropped.
///
/// ```no_run
/// use batch_testkit::{ClientAuth, TlsRedis};
///
/// let redis = TlsRedis::start(ClientAuth::Optional);
/// assert!(redis.url().starts_with("rediss://127.0.0.1:"));
/// assert_eq!(redis.command(&["PING"]), "PONG");
/// ```
#[derive(Debug)]
pub struct TlsRedis {
    process: Process,
    port: u16,
    pki: TestPki,
    auth: ClientAuth,
    dir: TempDir,
}

impl TlsRedis {
    /// Makes a [`TestPki`] and starts the server; panics with the log when it cannot.
    pub fn start(auth: ClientAuth) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("batch-testkit-tls-redis-")
            .tempdir()
            .expect("creating a temporary directory for redis-server");
        let pki = TestPki::generate(dir.path());
        let mut server = TlsRedis {
            process: Process::default(),
            port: 0,
            pki,
            auth,
            dir,
        };
        for _ in 0..5 {
            server.port = free_port();
            server
                .process
                .set(server.spawn().unwrap_or_else(|e| panic!("{e}")));
            match server.wait_ready() {
                Ok(()) => return server,
                Err(e) => {
                    server.kill();
                    let log = std::fs::read_to_string(server.dir.path().join("redis.log"))
                        .unwrap_or_default();
                    if !log.contains("Address already in use") {
                        panic!(
                            "TLS redis-server did not become ready: {e}\n--- redis.log ---\n{log}"
                        );
                    }
                }
            }
        }
        panic!("TLS redis-server found no free port in 5 tries");
    }

    fn spawn(&self) -> Result<Child, String> {
        let bin = binary();
        let mut cmd = Command::new(&bin);
        let auth = match self.auth {
            ClientAuth::Optional => "optional",
            ClientAuth::Required => "yes",
        };
        cmd.args(["--bind", "127.0.0.1", "--port", "0"])
            .args(["--tls-port", &self.port.to_string()])
            .arg("--tls-cert-file")
            .arg(&self.pki.server_cert)
            .arg("--tls-key-file")
            .arg(&self.pki.server_key)
            .arg("--tls-ca-cert-file")
            .arg(&self.pki.ca)
            .args(["--tls-auth-clients", auth])
            .arg("--dir")
            .arg(self.dir.path())
            .args(["--logfile", "redis.log", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--protected-mode", "yes"]);
        spawn_command(cmd, &bin)
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        self.process.wait_ready(
            "redis-server",
            "PONG over TLS",
            Duration::from_secs(10),
            Duration::from_millis(50),
            || self.try_command(&["PING"]).as_deref() == Ok("PONG"),
        )
    }

    /// The TLS port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `rediss://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.port)
    }

    /// The CA and certificates the server and its clients use.
    pub fn pki(&self) -> &TestPki {
        &self.pki
    }

    /// The server's directory (also where `redis.log` is).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Runs one command with `redis-cli --tls` and the client certificate; its output, trimmed
    /// (`PONG`, `OK`, a value; errors as `ERR ...`).
    pub fn command(&self, args: &[&str]) -> String {
        self.try_command(args)
            .unwrap_or_else(|e| panic!("redis-cli {args:?} failed: {e}"))
    }

    fn try_command(&self, args: &[&str]) -> Result<String, String> {
        let output = Command::new("redis-cli")
            .args(["--tls", "-h", "127.0.0.1", "-p", &self.port.to_string()])
            .arg("--cacert")
            .arg(&self.pki.ca)
            .arg("--cert")
            .arg(&self.pki.client_cert)
            .arg("--key")
            .arg(&self.pki.client_key)
            .args(args)
            .output()
            .map_err(|e| format!("running redis-cli (install redis-tools): {e}"))?;
        let stdout = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        if output.status.success() && !stdout.starts_with("Could not connect") {
            Ok(stdout)
        } else {
            Err(format!(
                "{stdout} {}",
                String::from_utf8_lossy(&output.stderr).trim()
            ))
        }
    }

    /// Kills the server (as `kill -9` would).
    pub fn kill(&mut self) {
        self.process.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speaks_tls_only_and_stops() {
        let redis = TlsRedis::start(ClientAuth::Required);
        let port = redis.port();
        assert_ne!(port, 6379);
        assert_eq!(redis.command(&["SET", "k", "v"]), "OK");
        assert_eq!(redis.command(&["GET", "k"]), "v");
        // A plaintext PING gets no PONG from a TLS port.
        assert!(!crate::ping(port));
        let dir = redis.dir().to_path_buf();
        drop(redis);
        assert!(!dir.exists(), "directory not removed");
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
    }
}
