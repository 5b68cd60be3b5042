//! `processor serve` with its files in S3: a real S3-compatible server (moto_server, from the test
//! helpers) reached through the `AWS_*` environment as a deployment gives it. An uploaded input
//! and the batch's output land under the storage prefix, and a missing bucket stops the start
//! with an error naming the bucket and the endpoint.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use batch_testkit::S3Server;
use dispatcher_sim::GatewayConfig;
use serde_json::{json, Value};
use support::{Env, PROCESSOR};

/// The processor's `serve` with the S3 server's environment and no other `AWS_*` variable.
fn serve_command(config: &std::path::Path, s3: &S3Server) -> Command {
    let mut cmd = Command::new(PROCESSOR);
    cmd.args(["serve", "--config"])
        .arg(config)
        .args(["--listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, _) in std::env::vars() {
        if name.starts_with("AWS_") {
            cmd.env_remove(name);
        }
    }
    // No shared AWS files of the machine's user.
    cmd.env("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        .env("AWS_CONFIG_FILE", "/nonexistent");
    s3.apply_env(&mut cmd);
    cmd
}

/// Kills the service if a test fails before stopping it.
struct Serving(Child);

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One HTTP/1.1 request, `Connection: close`, read to its end (chunked or not).
fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    content_type: &str,
    body: &[u8],
) -> (u16, Vec<u8>) {
    let mut stream = TcpStream::connect(addr).expect("connecting to the service");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(body).unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("an HTTP response head");
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let mut rest = &raw[split + 4..];
    if !head.contains("transfer-encoding: chunked") {
        return (status, rest.to_vec());
    }
    let mut body = Vec::new();
    loop {
        let line_end = rest.windows(2).position(|w| w == b"\r\n").unwrap();
        let size =
            usize::from_str_radix(std::str::from_utf8(&rest[..line_end]).unwrap().trim(), 16)
                .unwrap();
        rest = &rest[line_end + 2..];
        if size == 0 {
            return (status, body);
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

fn json_of(method: &str, addr: SocketAddr, path: &str, body: Option<&Value>) -> Value {
    let bytes = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
    let (status, reply) = http(addr, method, path, "application/json", &bytes);
    let text = String::from_utf8_lossy(&reply);
    assert_eq!(status, 200, "{method} {path}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{method} {path}: {e}: {text}"))
}

fn upload(addr: SocketAddr, name: &str, content: &[u8]) -> Value {
    let boundary = "batch-test-boundary";
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: application/jsonl\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(content);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let (status, reply) = http(
        addr,
        "POST",
        "/v1/files",
        &format!("multipart/form-data; boundary={boundary}"),
        &body,
    );
    let text = String::from_utf8_lossy(&reply);
    assert_eq!(status, 200, "upload: {text}");
    serde_json::from_str(&text).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_and_outputs_live_in_s3() {
    let env = Env::start(GatewayConfig::default()).await;
    let s3 = S3Server::start();
    let extra = format!(
        "redis_url_file: {}\nserve:\n  storage: s3://{}/svc/a\n",
        env.redis_url_file.display(),
        s3.bucket()
    );
    let config = env.sync_config(&["m"], "", &extra);
    let input = env.path("input.jsonl");
    let lines = support::write_input(&input, 40, &["m"]);
    let content = std::fs::read(&input).unwrap();

    let mut child = Serving(
        serve_command(&config, &s3)
            .spawn()
            .expect("starting processor serve"),
    );
    let mut first = String::new();
    BufReader::new(child.0.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let addr: SocketAddr = first
        .trim()
        .strip_prefix("listening on http://")
        .unwrap_or_else(|| panic!("no address in {first:?}"))
        .parse()
        .unwrap();

    // Blocking HTTP off the runtime's threads, which serve the gateway.
    let (file, batch, output) = tokio::task::spawn_blocking(move || {
        let file = upload(addr, "input.jsonl", &content);
        let id = file["id"].as_str().unwrap().to_owned();
        let (status, back) = http(
            addr,
            "GET",
            &format!("/v1/files/{id}/content"),
            "text/plain",
            &[],
        );
        assert_eq!(status, 200);
        assert_eq!(back, content, "the input read back from S3 differs");
        let created = json_of(
            "POST",
            addr,
            "/v1/batches",
            Some(&json!({
                "input_file_id": id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h"
            })),
        );
        let batch_id = created["id"].as_str().unwrap().to_owned();
        // Generous: a loaded 2-core machine.
        let deadline = Instant::now() + Duration::from_secs(180);
        let batch = loop {
            let batch = json_of("GET", addr, &format!("/v1/batches/{batch_id}"), None);
            match batch["status"].as_str().unwrap() {
                "completed" => break batch,
                "failed" | "expired" | "cancelled" => panic!("batch ended: {batch}"),
                _ if Instant::now() > deadline => panic!("batch not done in 180 s: {batch}"),
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        };
        let out_id = batch["output_file_id"].as_str().expect("an output file");
        let (status, output) = http(
            addr,
            "GET",
            &format!("/v1/files/{out_id}/content"),
            "text/plain",
            &[],
        );
        assert_eq!(status, 200);
        (file, batch, output)
    })
    .await
    .unwrap();

    let output = String::from_utf8(output).unwrap();
    let sorted_ids = |lines: &mut dyn Iterator<Item = &str>| {
        let mut ids: Vec<String> = lines
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["custom_id"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        ids.sort();
        ids
    };
    assert_eq!(
        sorted_ids(&mut output.lines()),
        sorted_ids(&mut lines.iter().map(String::as_str))
    );

    // Both files are objects under the prefix, and nothing lies outside it.
    let keys = s3.keys();
    let input_id = file["id"].as_str().unwrap();
    // Result files are stored per batch and lease epoch (results/<batch>/<epoch>/...).
    let batch_id = batch["id"].as_str().unwrap();
    for id in [input_id, batch_id] {
        assert!(
            keys.iter()
                .any(|k| k.starts_with("svc/a/") && k.contains(id)),
            "{id} not in {keys:?}"
        );
    }
    assert!(keys.iter().all(|k| k.starts_with("svc/a/")), "{keys:?}");

    // SIGTERM: a clean stop.
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) }, 0);
    let status = child.0.wait().unwrap();
    assert!(status.success(), "serve exited with {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bucket_stops_the_start() {
    let env = Env::start(GatewayConfig::default()).await;
    let s3 = S3Server::start();
    let extra = format!(
        "redis_url_file: {}\nserve:\n  storage: s3://no-such-bucket/svc\n",
        env.redis_url_file.display()
    );
    let config = env.sync_config(&["m"], "", &extra);
    let out = tokio::task::spawn_blocking({
        let mut cmd = serve_command(&config, &s3);
        move || cmd.output().unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "serve started: {stderr}");
    for expected in ["\"no-such-bucket\"", &s3.endpoint(), "NoSuchBucket"] {
        assert!(
            stderr.contains(expected),
            "{expected:?} missing from: {stderr}"
        );
    }
    assert!(!stderr.contains(s3.secret_access_key()), "{stderr}");
}
