//! One suite for every backend: each test below runs against a directory (`file://`) and against
//! a real S3-compatible server (moto_server, started by the test helpers), as object_store runs
//! one suite on each of its stores. What only one backend has (S3's multipart parts, its
//! configuration) is tested in `s3.rs`.

use std::path::{Path, PathBuf};

mod common;

use batch_storage::{Storage, StorageError};
use batch_testkit::{S3Server, TempDir};
use bytes::Bytes;
use futures::TryStreamExt;

/// A store to test, and a way to see what it holds behind the API's back.
enum Backend {
    Dir(TempDir),
    S3(S3Server),
}

/// Every backend's stores are opened under this prefix, to show keys stay under it.
const PREFIX: &str = "tenant/a";

impl Backend {
    fn dir() -> Self {
        Self::Dir(batch_testkit::tempdir().unwrap())
    }

    fn s3() -> Self {
        Self::S3(S3Server::start())
    }

    async fn open(&self) -> Storage {
        match self {
            Self::Dir(dir) => {
                Storage::from_url(&format!("file://{}/{PREFIX}", dir.path().display())).unwrap()
            }
            Self::S3(s3) => Storage::open(
                &format!("s3://{}/{PREFIX}", s3.bucket()),
                &common::s3_options(s3),
            )
            .await
            .unwrap(),
        }
    }

    /// The keys stored, from the store's root (below [`PREFIX`]), sorted.
    fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = match self {
            Self::Dir(dir) => {
                let root = dir.path().join(PREFIX);
                files_under(&root)
                    .iter()
                    .map(|p| p.strip_prefix(&root).unwrap().display().to_string())
                    .collect()
            }
            Self::S3(s3) => s3
                .keys()
                .into_iter()
                .map(|k| {
                    k.strip_prefix(&format!("{PREFIX}/"))
                        .unwrap_or_else(|| panic!("{k} is not under {PREFIX}"))
                        .to_owned()
                })
                .collect(),
        };
        keys.sort();
        keys
    }

    /// Nothing half-written is left: no stray file, no open multipart upload.
    fn assert_no_leftovers(&self) {
        match self {
            Self::Dir(dir) => {
                let all = files_under(dir.path());
                assert!(all.is_empty(), "left behind: {all:?}");
            }
            Self::S3(s3) => {
                assert!(s3.keys().is_empty(), "left behind: {:?}", s3.keys());
                assert!(s3.open_uploads().is_empty(), "upload not aborted");
            }
        }
    }
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            found.extend(files_under(&path));
        } else {
            found.push(path);
        }
    }
    found
}

async fn read_all(storage: &Storage, key: &str) -> Vec<u8> {
    let object = storage.get(key).await.unwrap();
    let chunks: Vec<Bytes> = object.stream.try_collect().await.unwrap();
    chunks.concat()
}

async fn streams_in_and_out_and_deletes(backend: Backend) {
    let s = backend.open().await;
    let chunks: Vec<Result<Bytes, std::io::Error>> = (0..100)
        .map(|i| Ok(Bytes::from(format!("line {i}\n"))))
        .collect();
    let expected: String = (0..100).map(|i| format!("line {i}\n")).collect();
    let n = s
        .put_stream("files/a", futures::stream::iter(chunks))
        .await
        .unwrap();
    assert_eq!(n, expected.len() as u64);
    assert_eq!(backend.keys(), ["files/a"]);
    assert_eq!(read_all(&s, "files/a").await, expected.as_bytes());
    assert_eq!(s.size("files/a").await.unwrap(), Some(n));
    assert_eq!(s.size("files/none").await.unwrap(), None);
    s.put_bytes("records/r", Bytes::from_static(b"{}"))
        .await
        .unwrap();
    assert_eq!(read_all(&s, "records/r").await, b"{}");

    let dir = batch_testkit::tempdir().unwrap();
    let back = dir.path().join("down/a.jsonl");
    assert_eq!(s.download("files/a", &back).await.unwrap(), n);
    assert_eq!(std::fs::read(&back).unwrap(), expected.as_bytes());
    assert!(!back.with_extension("partial").exists());
    let local = dir.path().join("up.jsonl");
    std::fs::write(&local, b"uploaded\n").unwrap();
    assert_eq!(s.put_file("files/up", &local).await.unwrap(), 9);
    assert_eq!(read_all(&s, "files/up").await, b"uploaded\n");

    s.delete("files/a").await.unwrap();
    s.delete("files/a").await.unwrap();
    assert!(matches!(
        s.get("files/a").await,
        Err(StorageError::NotFound(_))
    ));
    assert!(matches!(
        s.download("files/a", &back).await,
        Err(StorageError::NotFound(_))
    ));
    assert_eq!(s.size("files/a").await.unwrap(), None);
    s.check().await.unwrap();
    assert_eq!(backend.keys(), ["files/up", "records/r"]);
}

async fn a_failed_source_leaves_nothing(backend: Backend) {
    let s = backend.open().await;
    // Bigger than the first buffer (10 MiB), so a multipart upload had begun.
    let big = Bytes::from(vec![b'x'; 11 * 1024 * 1024]);
    let chunks = futures::stream::iter(vec![
        Ok(big),
        Err(std::io::Error::other("client went away")),
    ]);
    let err = s.put_stream("files/b", chunks).await.unwrap_err();
    assert!(err.to_string().contains("client went away"), "{err}");
    assert_eq!(s.size("files/b").await.unwrap(), None);
    backend.assert_no_leftovers();

    // A small one fails before anything is sent.
    let chunks = futures::stream::iter(vec![
        Ok(Bytes::from_static(b"a")),
        Err(std::io::Error::other("stopped")),
    ]);
    s.put_stream("files/c", chunks).await.unwrap_err();
    backend.assert_no_leftovers();
}

async fn files_go_up_and_down_whole(backend: Backend) {
    let s = backend.open().await;
    let dir = batch_testkit::tempdir().unwrap();
    let local = dir.path().join("in.jsonl");
    let content: Vec<u8> = (0..2_000_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&local, &content).unwrap();
    assert_eq!(
        s.put_file("files/c", &local).await.unwrap(),
        content.len() as u64
    );
    let back = dir.path().join("back/out.jsonl");
    assert_eq!(
        s.download("files/c", &back).await.unwrap(),
        content.len() as u64
    );
    assert_eq!(std::fs::read(&back).unwrap(), content);

    assert_eq!(
        s.put_file_prefix("cp/1/c", &local, 1_000_001)
            .await
            .unwrap(),
        1_000_001
    );
    assert_eq!(read_all(&s, "cp/1/c").await, &content[..1_000_001]);
    s.put_bytes("cp/2/d", Bytes::from_static(b"x"))
        .await
        .unwrap();
    assert_eq!(s.delete_prefix("cp").await.unwrap(), 2);
    assert_eq!(s.size("cp/1/c").await.unwrap(), None);
    assert_eq!(s.size("files/c").await.unwrap(), Some(content.len() as u64));
    assert_eq!(backend.keys(), ["files/c"]);
}

/// Each test of the suite, once per backend: `dir::<name>` and `s3::<name>`.
macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod dir {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::Backend::dir()).await;
                }
            )*
        }
        mod s3 {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::Backend::s3()).await;
                }
            )*
        }
    };
}

suite!(
    streams_in_and_out_and_deletes,
    a_failed_source_leaves_nothing,
    files_go_up_and_down_whole,
);
