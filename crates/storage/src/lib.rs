#![doc = include_str!("../README.md")]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt, TryStreamExt};
use object_store::buffered::BufWriter;
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::prefix::PrefixStore;
use object_store::ObjectStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod s3;

pub use s3::S3Options;

/// Why a storage operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The storage URL cannot be used.
    #[error("storage URL {url:?}: {problem}")]
    Url {
        /// The URL as configured.
        url: String,
        /// What is wrong with it.
        problem: String,
    },
    /// No object under this key.
    #[error("{0}: no such object")]
    NotFound(String),
    /// The store failed; the message names the key.
    #[error("storage {key}: {message}")]
    Store {
        /// The key.
        key: String,
        /// The store's error.
        message: String,
    },
    /// The bytes being uploaded failed at their source (the client, a local file).
    #[error("upload of {key} stopped: {message}")]
    Source {
        /// The key.
        key: String,
        /// Why the source stopped.
        message: String,
    },
    /// The store as a whole cannot be used (no such bucket, unreachable endpoint, refused
    /// credentials).
    #[error("{store}: {message}")]
    Unavailable {
        /// Which store: the bucket and endpoint, or the directory (never a secret).
        store: String,
        /// What failed.
        message: String,
    },
    /// A local file could not be read or written.
    #[error("{path}: {error}")]
    Local {
        /// The file.
        path: PathBuf,
        /// What failed.
        error: std::io::Error,
    },
}

impl StorageError {
    fn store(key: &str, error: object_store::Error) -> Self {
        match error {
            object_store::Error::NotFound { .. } => Self::NotFound(key.to_owned()),
            other => Self::Store {
                key: key.to_owned(),
                message: other.to_string(),
            },
        }
    }

    fn local(path: &Path, error: std::io::Error) -> Self {
        Self::Local {
            path: path.to_owned(),
            error,
        }
    }
}

/// An object being read: its size and its bytes.
pub struct Object {
    /// Size in bytes.
    pub size: u64,
    /// The bytes, in chunks.
    pub stream: BoxStream<'static, Result<Bytes, StorageError>>,
}

/// Where the service keeps files.
#[derive(Clone)]
pub struct Storage {
    store: Arc<dyn ObjectStore>,
    url: String,
    /// Names the store in errors about it as a whole.
    describe: String,
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Storage").field("url", &self.url).finish()
    }
}

/// Chunk size of reads from local files.
const READ_CHUNK: usize = 256 * 1024;

impl Storage {
    /// Storage at `url`: `file:///absolute/dir` (created if missing) or `s3://bucket[/prefix]`
    /// configured from the environment. Makes no request: see [`Storage::open`].
    pub fn from_url(url: &str) -> Result<Self, StorageError> {
        Self::from_url_with(url, &S3Options::default())
    }

    /// Like [`Storage::from_url`], with S3 settings that take precedence over the environment.
    pub fn from_url_with(url: &str, s3: &S3Options) -> Result<Self, StorageError> {
        let bad = |problem: &str| StorageError::Url {
            url: url.to_owned(),
            problem: problem.to_owned(),
        };
        if let Some(dir) = url.strip_prefix("file://") {
            if !dir.starts_with('/') {
                return Err(bad("expected an absolute directory: file:///dir"));
            }
            std::fs::create_dir_all(dir).map_err(|e| bad(&format!("cannot create {dir}: {e}")))?;
            let store = LocalFileSystem::new_with_prefix(dir)
                .map_err(|e| bad(&e.to_string()))?
                .with_automatic_cleanup(true);
            return Ok(Self {
                store: Arc::new(store),
                url: url.to_owned(),
                describe: format!("directory {dir}"),
            });
        }
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(bad("expected s3://bucket[/prefix]"));
            }
            let built = s3::build(bucket, s3).map_err(|e| bad(&e))?;
            let prefix = prefix.trim_matches('/');
            let store: Arc<dyn ObjectStore> = if prefix.is_empty() {
                Arc::new(built.store)
            } else {
                let prefix = ObjectPath::parse(prefix)
                    .map_err(|e| bad(&format!("prefix {prefix:?}: {e}")))?;
                Arc::new(PrefixStore::new(built.store, prefix))
            };
            return Ok(Self {
                store,
                url: url.to_owned(),
                describe: built.describe,
            });
        }
        Err(bad("expected file:///directory or s3://bucket[/prefix]"))
    }

    /// [`Storage::from_url_with`], then [`Storage::check`]: fails at once when the bucket does
    /// not exist or cannot be reached, naming the bucket and endpoint.
    pub async fn open(url: &str, s3: &S3Options) -> Result<Self, StorageError> {
        let storage = Self::from_url_with(url, s3)?;
        storage.check().await?;
        Ok(storage)
    }

    /// Storage over any `object_store` implementation (tests, embedders).
    pub fn from_store(store: Arc<dyn ObjectStore>, url: impl Into<String>) -> Self {
        let url = url.into();
        Self {
            store,
            describe: url.clone(),
            url,
        }
    }

    /// The URL it was made from.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Names the store for people: `S3 bucket "b" at http://minio:9000`, `directory /srv/x`.
    pub fn describe(&self) -> &str {
        &self.describe
    }

    fn path(key: &str) -> Result<ObjectPath, StorageError> {
        ObjectPath::parse(key).map_err(|e| StorageError::Store {
            key: key.to_owned(),
            message: e.to_string(),
        })
    }

    /// Writes the chunks of `source` under `key` and returns the byte count. The object appears
    /// only when the source ended cleanly: an error from the source aborts the upload.
    pub async fn put_stream<S, E>(&self, key: &str, source: S) -> Result<u64, StorageError>
    where
        S: Stream<Item = Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        let path = Self::path(key)?;
        let mut writer = BufWriter::new(self.store.clone(), path);
        let mut source = std::pin::pin!(source);
        let mut written = 0u64;
        let failure = loop {
            match source.next().await {
                None => break None,
                Some(Err(e)) => {
                    break Some(StorageError::Source {
                        key: key.to_owned(),
                        message: e.to_string(),
                    })
                }
                Some(Ok(chunk)) => {
                    written += chunk.len() as u64;
                    if let Err(e) = writer.write_all(&chunk).await {
                        break Some(StorageError::Store {
                            key: key.to_owned(),
                            message: e.to_string(),
                        });
                    }
                }
            }
        };
        if let Some(e) = failure {
            if let Err(abort) = writer.abort().await {
                tracing::warn!(key, error = %abort, "could not abort a failed upload");
            }
            return Err(e);
        }
        writer.shutdown().await.map_err(|e| StorageError::Store {
            key: key.to_owned(),
            message: e.to_string(),
        })?;
        Ok(written)
    }

    /// Writes `bytes` under `key` in one request (small objects: records, markers).
    pub async fn put_bytes(&self, key: &str, bytes: Bytes) -> Result<(), StorageError> {
        let path = Self::path(key)?;
        self.store
            .put(&path, bytes.into())
            .await
            .map_err(|e| StorageError::store(key, e))?;
        Ok(())
    }

    /// Uploads the local file `local` under `key`, streamed; returns its size.
    pub async fn put_file(&self, key: &str, local: &Path) -> Result<u64, StorageError> {
        self.put_file_prefix(key, local, u64::MAX).await
    }

    /// Uploads the first `len` bytes of `local` (all of it if shorter) under `key`, streamed.
    pub async fn put_file_prefix(
        &self,
        key: &str,
        local: &Path,
        len: u64,
    ) -> Result<u64, StorageError> {
        let file = tokio::fs::File::open(local)
            .await
            .map_err(|e| StorageError::local(local, e))?;
        let chunks = futures::stream::try_unfold((file, len), |(mut file, left)| async move {
            if left == 0 {
                return Ok::<_, std::io::Error>(None);
            }
            let mut buf = vec![0u8; READ_CHUNK.min(left.try_into().unwrap_or(usize::MAX))];
            let n = file.read(&mut buf).await?;
            if n == 0 {
                return Ok(None);
            }
            buf.truncate(n);
            Ok(Some((Bytes::from(buf), (file, left - n as u64))))
        });
        self.put_stream(key, chunks).await
    }

    /// Opens the object under `key` for reading.
    pub async fn get(&self, key: &str) -> Result<Object, StorageError> {
        let got = self.fetch(key).await?;
        let size = got.meta.size;
        let owned = key.to_owned();
        let stream = got
            .into_stream()
            .map_err(move |e| StorageError::store(&owned, e))
            .boxed();
        Ok(Object { size, stream })
    }

    /// Copies the object under `key` to the local file `local` (written aside, then renamed, so
    /// a crash never leaves a partial file under that name); returns its size.
    pub async fn download(&self, key: &str, local: &Path) -> Result<u64, StorageError> {
        let mut object = self.get(key).await?;
        let partial = local.with_extension("partial");
        if let Some(dir) = local.parent() {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(|e| StorageError::local(dir, e))?;
        }
        let mut file = tokio::fs::File::create(&partial)
            .await
            .map_err(|e| StorageError::local(&partial, e))?;
        let mut size = 0u64;
        while let Some(chunk) = object.stream.next().await {
            let chunk = chunk?;
            size += chunk.len() as u64;
            file.write_all(&chunk)
                .await
                .map_err(|e| StorageError::local(&partial, e))?;
        }
        file.sync_all()
            .await
            .map_err(|e| StorageError::local(&partial, e))?;
        drop(file);
        tokio::fs::rename(&partial, local)
            .await
            .map_err(|e| StorageError::local(local, e))?;
        Ok(size)
    }

    /// The size of the object under `key`, or `None` when there is none.
    pub async fn size(&self, key: &str) -> Result<Option<u64>, StorageError> {
        let path = Self::path(key)?;
        match self.store.head(&path).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(StorageError::store(key, e)),
        }
    }

    /// Deletes the object under `key`; deleting what is not there succeeds.
    pub async fn delete(&self, key: &str) -> Result<(), StorageError> {
        let path = Self::path(key)?;
        match self.store.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(StorageError::store(key, e)),
        }
    }

    /// Reads the whole object under `key` into memory (small objects: records).
    pub async fn get_bytes(&self, key: &str) -> Result<Bytes, StorageError> {
        let got = self.fetch(key).await?;
        got.bytes().await.map_err(|e| StorageError::store(key, e))
    }

    async fn fetch(&self, key: &str) -> Result<object_store::GetResult, StorageError> {
        let path = Self::path(key)?;
        self.store
            .get(&path)
            .await
            .map_err(|e| StorageError::store(key, e))
    }

    /// The keys of every object under `prefix/`, sorted.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, StorageError> {
        let path = Self::path(prefix)?;
        let mut keys: Vec<String> = self
            .store
            .list(Some(&path))
            .map_ok(|meta| meta.location.to_string())
            .try_collect()
            .await
            .map_err(|e| StorageError::store(prefix, e))?;
        keys.sort();
        Ok(keys)
    }

    /// Deletes every object whose key starts with `prefix/`.
    pub async fn delete_prefix(&self, prefix: &str) -> Result<usize, StorageError> {
        let path = Self::path(prefix)?;
        let keys: Vec<ObjectPath> = self
            .store
            .list(Some(&path))
            .map_ok(|meta| meta.location)
            .try_collect()
            .await
            .map_err(|e| StorageError::store(prefix, e))?;
        for key in &keys {
            match self.store.delete(key).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(StorageError::store(key.as_ref(), e)),
            }
        }
        Ok(keys.len())
    }

    /// Whether the store answers (at start, for readiness): lists one key, which fails when the
    /// bucket is missing, the endpoint unreachable or the credentials refused.
    pub async fn check(&self) -> Result<(), StorageError> {
        let prefix = ObjectPath::from("files");
        let mut listing = self.store.list(Some(&prefix));
        match listing.next().await {
            None | Some(Ok(_)) => Ok(()),
            Some(Err(e)) => Err(StorageError::Unavailable {
                store: self.describe.clone(),
                message: s3::explain(&e),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // What every backend does is tested once for all of them in tests/suite.rs.

    #[test]
    fn bad_urls_are_named() {
        let err = Storage::from_url("file://relative/dir").unwrap_err();
        assert!(err.to_string().contains("file://relative/dir"), "{err}");
        assert!(Storage::from_url("ftp://x").is_err());
    }
}
