//! A real S3-compatible server (`moto_server`, from PyPI's `moto`) on a free loopback port.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use tempfile::TempDir;

use crate::process::Process;

const MOTO_HINT: &str = "moto_server is not installed: run `bash scripts/test.sh` once (it \
    installs moto into the virtualenv $BATCH_VENV, default target/venv), or set MOTO_SERVER_BIN \
    to its path";

/// The bucket [`S3Server::start`] creates.
pub const S3_BUCKET: &str = "batch-test";

/// A running `moto_server` holding one bucket, killed when dropped. Objects live in its memory.
///
/// The tests' client finds it as the AWS SDKs would, through [`S3Server::env`]:
/// `AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and
/// `AWS_ALLOW_HTTP=true`.
///
/// ```no_run
/// use batch_testkit::S3Server;
///
/// let s3 = S3Server::start();
/// assert!(s3.endpoint().starts_with("http://127.0.0.1:"));
/// let mut serve = std::process::Command::new("processor");
/// s3.apply_env(&mut serve);
/// assert!(s3.keys().is_empty());
/// ```
#[derive(Debug)]
pub struct S3Server {
    process: Process,
    port: u16,
    bucket: String,
    dir: TempDir,
}

/// Where `moto_server` is: `MOTO_SERVER_BIN`, else the project's virtualenv (`$BATCH_VENV`,
/// default `<workspace>/target/venv`), else `PATH`.
pub fn moto_binary() -> PathBuf {
    if let Some(bin) = std::env::var_os("MOTO_SERVER_BIN") {
        return bin.into();
    }
    let venv = std::env::var_os("BATCH_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/venv"));
    let bin = venv.join("bin/moto_server");
    if bin.exists() {
        bin
    } else {
        "moto_server".into()
    }
}

impl S3Server {
    /// Starts a server with the bucket [`S3_BUCKET`]. Panics, saying how to install it, when
    /// `moto_server` is missing.
    pub fn start() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("batch-testkit-s3-")
            .tempdir()
            .expect("creating a temporary directory for moto_server");
        let mut server = Self {
            process: Process::default(),
            port: 0,
            bucket: S3_BUCKET.into(),
            dir,
        };
        let bin = moto_binary();
        // The free port can be taken between probing and binding; try a few.
        for _ in 0..5 {
            server.port = crate::free_port();
            let log = std::fs::File::create(server.log_path()).expect("creating moto.log");
            let mut cmd = Command::new(&bin);
            cmd.args(["-H", "127.0.0.1", "-p", &server.port.to_string()])
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("sharing moto.log"))
                .stderr(log);
            crate::kill_with_parent(&mut cmd);
            let child = cmd.spawn().unwrap_or_else(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    panic!("{MOTO_HINT} (tried {})", bin.display())
                }
                panic!("spawning {}: {e}", bin.display())
            });
            server.process.set(child);
            match server.wait_ready() {
                Ok(()) => {
                    server.create_bucket(S3_BUCKET);
                    return server;
                }
                Err(e) => {
                    server.kill();
                    let log = std::fs::read_to_string(server.log_path()).unwrap_or_default();
                    if !log.contains("Address already in use") {
                        panic!("moto_server did not become ready: {e}\n--- moto.log ---\n{log}");
                    }
                }
            }
        }
        panic!("moto_server found no free port in 5 tries");
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("moto.log")
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        // Python starts slowly on a loaded machine.
        self.process.wait_ready(
            "moto_server",
            "answer to GET /",
            Duration::from_secs(60),
            Duration::from_millis(50),
            || matches!(self.try_request("GET", "/", &[]), Ok((200, _, _))),
        )
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The bucket made at start ([`S3_BUCKET`]).
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The region clients should name.
    pub fn region(&self) -> &'static str {
        "us-east-1"
    }

    /// The access key id clients sign with (moto accepts any).
    pub fn access_key_id(&self) -> &'static str {
        "testkit-access-key"
    }

    /// The secret key clients sign with.
    pub fn secret_access_key(&self) -> &'static str {
        "testkit-secret-key"
    }

    /// The environment the AWS SDKs (and `object_store`) read to reach this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_REGION", self.region().into()),
            ("AWS_ACCESS_KEY_ID", self.access_key_id().into()),
            ("AWS_SECRET_ACCESS_KEY", self.secret_access_key().into()),
            ("AWS_ALLOW_HTTP", "true".into()),
        ]
    }

    /// Sets [`S3Server::env`] on a command (a `processor serve` under test).
    pub fn apply_env<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        cmd.envs(self.env())
    }

    /// Creates another bucket.
    pub fn create_bucket(&self, name: &str) {
        let (status, body) = self.request("PUT", &format!("/{name}"), &[]);
        assert_eq!(status, 200, "creating bucket {name}: {body}");
    }

    /// The keys in the bucket, in order (the first 1000).
    pub fn keys(&self) -> Vec<String> {
        let (status, body) = self.request("GET", &format!("/{}?list-type=2", self.bucket), &[]);
        assert_eq!(status, 200, "listing bucket {}: {body}", self.bucket);
        elements(&body, "Key")
    }

    /// The keys of multipart uploads begun and neither completed nor aborted.
    pub fn open_uploads(&self) -> Vec<String> {
        let (status, body) = self.request("GET", &format!("/{}?uploads", self.bucket), &[]);
        assert_eq!(status, 200, "listing uploads of {}: {body}", self.bucket);
        elements(&body, "Key")
    }

    /// Writes an object directly (set-up of tests).
    pub fn put_object(&self, key: &str, bytes: &[u8]) {
        let (status, body) = self.request("PUT", &format!("/{}/{key}", self.bucket), bytes);
        assert_eq!(status, 200, "writing {key}: {body}");
    }

    /// The `ETag` of an object, `None` when there is none. A multipart upload's ends in
    /// `-<parts>"`.
    pub fn etag(&self, key: &str) -> Option<String> {
        let (status, head, _) = self.exchange("HEAD", &format!("/{}/{key}", self.bucket), &[]);
        if status == 404 {
            return None;
        }
        assert_eq!(status, 200, "HEAD {key}: {head}");
        head.lines().find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("etag")
                .then(|| value.trim().to_owned())
        })
    }

    /// Kills the server (as `kill -9` would): clients then fail to connect.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Whether the server process is running.
    pub fn is_running(&mut self) -> bool {
        self.process.is_running()
    }

    /// Freezes the server (SIGSTOP): connections stay open and requests get no answer until
    /// [`S3Server::thaw`], as with a store that hangs.
    pub fn freeze(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Lets a frozen server go on (SIGCONT); the requests it held are answered.
    pub fn thaw(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: i32) {
        let pid = self.process.id().expect("the S3 server runs");
        // SAFETY: kill(2) on our own child's pid has no memory effects.
        let rc = unsafe { libc::kill(pid as i32, signal) };
        assert_eq!(rc, 0, "signalling the S3 server");
    }

    fn request(&self, method: &str, target: &str, body: &[u8]) -> (u16, String) {
        let (status, _, body) = self.exchange(method, target, body);
        (status, body)
    }

    fn exchange(&self, method: &str, target: &str, body: &[u8]) -> (u16, String, String) {
        self.try_request(method, target, body)
            .unwrap_or_else(|e| panic!("{method} {target} on moto_server: {e}"))
    }

    /// One HTTP/1.1 request, read to its end: status, head, body. moto checks no signature, but
    /// without an `Authorization` naming a key it takes the caller for anonymous and hides
    /// private objects.
    fn try_request(
        &self,
        method: &str,
        target: &str,
        body: &[u8],
    ) -> std::io::Result<(u16, String, String)> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        let head = format!(
            "{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nAuthorization: AWS4-HMAC-SHA256 \
             Credential={}/20260101/{}/s3/aws4_request, SignedHeaders=host, Signature=0\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            self.port,
            self.access_key_id(),
            self.region(),
            body.len()
        );
        stream.write_all(head.as_bytes())?;
        stream.write_all(body)?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw)?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {text:?}")))?;
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        Ok((status, head.to_owned(), body.to_owned()))
    }
}

/// The texts of every `<name>...</name>` element.
fn elements(xml: &str, name: &str) -> Vec<String> {
    let open = format!("<{name}>");
    let close = format!("</{name}>");
    xml.split(&open)
        .skip(1)
        .filter_map(|s| s.split_once(&close).map(|(v, _)| v.to_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_holds_objects_and_stops() {
        let mut s3 = S3Server::start();
        let port = s3.port();
        assert!(s3.keys().is_empty());
        s3.put_object("a/b", b"hello");
        assert_eq!(s3.keys(), ["a/b"]);
        let etag = s3.etag("a/b").expect("an ETag");
        assert!(!etag.contains('-'), "a single-part upload: {etag}");
        assert_eq!(s3.etag("missing"), None);
        assert!(s3.open_uploads().is_empty());
        let mut cmd = Command::new("true");
        s3.apply_env(&mut cmd);
        let env: Vec<_> = cmd.get_envs().collect();
        assert!(env.contains(&("AWS_ENDPOINT_URL".as_ref(), Some(s3.endpoint().as_ref()))));
        assert!(s3.is_running());
        drop(s3);
        assert!(
            TcpStream::connect(("127.0.0.1", port)).is_err(),
            "moto_server still listens after drop"
        );
    }

    #[test]
    fn elements_are_found() {
        let xml = "<R><Key>a</Key><X/><Key>b/c</Key></R>";
        assert_eq!(elements(xml, "Key"), ["a", "b/c"]);
        assert!(elements("<R/>", "Key").is_empty());
    }
}
