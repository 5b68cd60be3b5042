//! Shared by the storage tests.

use batch_storage::S3Options;
use batch_testkit::S3Server;

/// Options that reach `s3` (the tests share one process environment, so nothing comes from it).
pub fn s3_options(s3: &S3Server) -> S3Options {
    S3Options {
        endpoint: Some(s3.endpoint()),
        region: Some(s3.region().into()),
        access_key_id: Some(s3.access_key_id().into()),
        secret_access_key: Some(s3.secret_access_key().into()),
        allow_http: Some(true),
        ..Default::default()
    }
}
