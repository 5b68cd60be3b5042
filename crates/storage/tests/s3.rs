//! What only S3 storage has, against a real S3-compatible server (moto_server, started by the
//! test helpers): multipart parts, a missing bucket, the configuration from the environment and
//! shared files. What every backend does is in `suite.rs`.
//!
//! The settings go in through [`S3Options`] (tests share one process environment); one test runs
//! this binary again with the `AWS_*` environment alone, as `processor serve` is given it.

mod common;

use batch_storage::{S3Options, Storage, StorageError};
use batch_testkit::S3Server;
use bytes::Bytes;
use futures::StreamExt;

fn options(s3: &S3Server) -> S3Options {
    common::s3_options(s3)
}

async fn open(s3: &S3Server, prefix: &str) -> Storage {
    Storage::open(&format!("s3://{}/{prefix}", s3.bucket()), &options(s3))
        .await
        .unwrap()
}

/// Deterministic bytes, made chunk by chunk as they are sent.
fn byte_at(i: u64) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8
}

#[tokio::test]
async fn a_large_upload_streams_in_parts() {
    let s3 = S3Server::start();
    let s = open(&s3, "").await;
    const CHUNK: u64 = 1 << 20;
    const CHUNKS: u64 = 25;
    let chunks = futures::stream::iter(0..CHUNKS).map(|c| {
        let chunk: Vec<u8> = (c * CHUNK..(c + 1) * CHUNK).map(byte_at).collect();
        Ok::<_, std::io::Error>(Bytes::from(chunk))
    });
    let n = s.put_stream("files/big", chunks).await.unwrap();
    assert_eq!(n, CHUNK * CHUNKS);
    // 25 MiB in 10 MiB parts: a multipart upload of three parts, as S3 names its ETag.
    let etag = s3.etag("files/big").expect("the object exists");
    assert!(etag.ends_with("-3\""), "not a 3-part upload: {etag}");
    assert!(s3.open_uploads().is_empty());

    let dir = batch_testkit::tempdir().unwrap();
    let back = dir.path().join("big");
    assert_eq!(s.download("files/big", &back).await.unwrap(), n);
    let bytes = std::fs::read(&back).unwrap();
    assert_eq!(bytes.len() as u64, n);
    let first_bad = (0..n).find(|&i| bytes[i as usize] != byte_at(i));
    assert_eq!(first_bad, None, "downloaded bytes differ");
}

#[tokio::test]
async fn a_missing_bucket_is_named_with_its_endpoint() {
    let s3 = S3Server::start();
    let err = Storage::open("s3://no-such-bucket/p", &options(&s3))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, StorageError::Unavailable { .. }), "{err:?}");
    assert!(text.contains("\"no-such-bucket\""), "{text}");
    assert!(text.contains(&s3.endpoint()), "{text}");
    assert!(text.contains("NoSuchBucket"), "{text}");
    assert!(!text.contains(s3.secret_access_key()), "{text}");

    // Another bucket on the same server is fine.
    s3.create_bucket("other");
    Storage::open("s3://other", &options(&s3)).await.unwrap();
}

#[test]
fn bad_s3_urls_are_named() {
    let err = Storage::from_url("s3:///prefix").unwrap_err();
    assert!(err.to_string().contains("s3:///prefix"), "{err}");
}

/// Runs `child` and checks that it passed and wrote its object.
fn child_passes(mut child: std::process::Command, s3: &S3Server) {
    let out = child.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "child failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(s3.keys(), ["env/files/x"]);
}

/// This binary's `from_the_environment_child`, for a bucket of `s3`, with no `AWS_*` variable
/// of this process: the caller gives it the ones it tests.
fn environment_child(s3: &S3Server) -> std::process::Command {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap());
    child
        .args([
            "--exact",
            "from_the_environment_child",
            "--ignored",
            "--nocapture",
        ])
        .env("BATCH_S3_CHILD_BUCKET", s3.bucket());
    for (name, _) in std::env::vars() {
        if name.starts_with("AWS_") {
            child.env_remove(name);
        }
    }
    child
}

/// Runs this binary's `from_the_environment_child` with only the `AWS_*` variables of the
/// server, as a deployment gives them.
#[test]
fn the_environment_configures_s3() {
    let s3 = S3Server::start();
    let mut child = environment_child(&s3);
    // The shared files must not interfere: point them at nothing.
    let dir = batch_testkit::tempdir().unwrap();
    child
        .env("AWS_SHARED_CREDENTIALS_FILE", dir.path().join("none"))
        .env("AWS_CONFIG_FILE", dir.path().join("none"));
    s3.apply_env(&mut child);
    child_passes(child, &s3);
}

/// Part of [`the_environment_configures_s3`], which runs it in a process of its own.
#[tokio::test]
#[ignore = "run by the_environment_configures_s3 with the server's environment"]
async fn from_the_environment_child() {
    let bucket = std::env::var("BATCH_S3_CHILD_BUCKET").expect("run by its parent test");
    let s = Storage::from_url(&format!("s3://{bucket}/env")).unwrap();
    // Never a request to AWS itself from a test.
    assert!(
        s.describe().contains("http://127.0.0.1:"),
        "{}",
        s.describe()
    );
    s.check().await.unwrap();
    s.put_bytes("files/x", Bytes::from_static(b"x"))
        .await
        .unwrap();
    assert_eq!(s.size("files/x").await.unwrap(), Some(1));
}

/// The shared credentials and config files, as the AWS SDKs read them, when the environment
/// names no credentials.
#[test]
fn the_shared_files_configure_s3() {
    let s3 = S3Server::start();
    let dir = batch_testkit::tempdir().unwrap();
    let credentials = dir.path().join("credentials");
    let config = dir.path().join("config");
    std::fs::write(
        &credentials,
        format!(
            "[default]\naws_access_key_id = wrong\n[ci]\naws_access_key_id = {}\naws_secret_access_key = {}\n",
            s3.access_key_id(),
            s3.secret_access_key()
        ),
    )
    .unwrap();
    std::fs::write(
        &config,
        format!(
            "[profile ci]\nregion = {}\nendpoint_url = {}\n",
            s3.region(),
            s3.endpoint()
        ),
    )
    .unwrap();
    let mut child = environment_child(&s3);
    child
        .env("AWS_SHARED_CREDENTIALS_FILE", &credentials)
        .env("AWS_CONFIG_FILE", &config)
        .env("AWS_PROFILE", "ci")
        .env("AWS_ALLOW_HTTP", "true");
    child_passes(child, &s3);
}

#[tokio::test]
async fn an_unreachable_endpoint_is_named() {
    // Nothing listens there: connecting fails at once, after object_store's retries.
    let endpoint = format!("http://127.0.0.1:{}", batch_testkit::free_port());
    let options = S3Options {
        endpoint: Some(endpoint.clone()),
        access_key_id: Some("id".into()),
        secret_access_key: Some("secret-key-value".into()),
        allow_http: Some(true),
        ..Default::default()
    };
    let err = Storage::open("s3://b", &options).await.unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, StorageError::Unavailable { .. }), "{err:?}");
    assert!(
        text.starts_with(&format!("S3 bucket \"b\" at {endpoint}:")),
        "{text}"
    );
    assert!(!text.contains("secret-key-value"), "{text}");
}
