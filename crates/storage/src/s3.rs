//! S3 and S3-compatible stores: settings gathered as the AWS SDKs gather them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};

/// S3 settings from the service's config, each taking precedence over the environment and the
/// shared AWS files. `None` leaves a setting to them.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct S3Options {
    /// Endpoint of an S3-compatible store (`http://minio:9000`); requests are then path-style.
    pub endpoint: Option<String>,
    /// Region (default `us-east-1`).
    pub region: Option<String>,
    /// Access key id.
    pub access_key_id: Option<String>,
    /// Secret access key; never printed.
    pub secret_access_key: Option<String>,
    /// Session token of temporary credentials; never printed.
    pub session_token: Option<String>,
    /// Allows a plain-http endpoint.
    pub allow_http: Option<bool>,
    /// Profile of the shared credentials and config files (default `$AWS_PROFILE`, else
    /// `default`).
    pub profile: Option<String>,
}

impl std::fmt::Debug for S3Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |v: &Option<String>| v.as_ref().map(|_| "<redacted>");
        f.debug_struct("S3Options")
            .field("endpoint", &self.endpoint.as_deref().map(display_endpoint))
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &hidden(&self.secret_access_key))
            .field("session_token", &hidden(&self.session_token))
            .field("allow_http", &self.allow_http)
            .field("profile", &self.profile)
            .finish()
    }
}

/// A built store and the words naming it in errors.
pub(crate) struct Built {
    pub store: AmazonS3,
    pub describe: String,
}

/// The store for `bucket`: [`S3Options`] over the `AWS_*` environment over the shared files
/// (`AWS_SHARED_CREDENTIALS_FILE`, `AWS_CONFIG_FILE`, default `~/.aws/credentials` and
/// `~/.aws/config`), as the AWS SDKs rank them.
pub(crate) fn build(bucket: &str, options: &S3Options) -> Result<Built, String> {
    use AmazonS3ConfigKey as K;
    let mut builder = AmazonS3Builder::from_env();
    // The SDKs' S3-only endpoint variable wins over the general one.
    if let Some(endpoint) = env("AWS_ENDPOINT_URL_S3") {
        builder = builder.with_endpoint(endpoint);
    }
    let profile = options
        .profile
        .clone()
        .or_else(|| env("AWS_PROFILE"))
        .unwrap_or_else(|| "default".into());
    let shared = SharedFiles::read(&profile)?;
    let unset = |builder: &AmazonS3Builder, key: K| builder.get_config_value(&key).is_none();
    if unset(&builder, K::AccessKeyId) && options.access_key_id.is_none() {
        // Keys of one source go together: never a key id from one and a secret from another.
        if let (Some(id), Some(secret)) = (
            shared.get("aws_access_key_id"),
            shared.get("aws_secret_access_key"),
        ) {
            builder = builder
                .with_access_key_id(id)
                .with_secret_access_key(secret);
            if let Some(token) = shared.get("aws_session_token") {
                builder = builder.with_token(token);
            }
        }
    }
    if unset(&builder, K::Region) {
        if let Some(region) = shared.get("region") {
            builder = builder.with_region(region);
        }
    }
    if unset(&builder, K::Endpoint) {
        if let Some(endpoint) = shared.get("endpoint_url") {
            builder = builder.with_endpoint(endpoint);
        }
    }
    if let Some(v) = &options.endpoint {
        builder = builder.with_endpoint(v);
    }
    if let Some(v) = &options.region {
        builder = builder.with_region(v);
    }
    if let Some(v) = &options.access_key_id {
        builder = builder.with_access_key_id(v);
    }
    if let Some(v) = &options.secret_access_key {
        builder = builder.with_secret_access_key(v);
    }
    if let Some(v) = &options.session_token {
        builder = builder.with_token(v);
    }
    if let Some(v) = options.allow_http {
        builder = builder.with_allow_http(v);
    }
    let endpoint = builder.get_config_value(&K::Endpoint);
    let region = builder
        .get_config_value(&K::Region)
        .unwrap_or_else(|| "us-east-1".into());
    let describe = match &endpoint {
        Some(e) => format!("S3 bucket {bucket:?} at {}", display_endpoint(e)),
        None => format!("S3 bucket {bucket:?} (AWS, region {region})"),
    };
    if endpoint.is_some() && env("AWS_VIRTUAL_HOSTED_STYLE_REQUEST").is_none() {
        // MinIO, Ceph RGW and most other stores have no per-bucket host names.
        builder = builder.with_virtual_hosted_style_request(false);
    }
    let store = builder
        .with_bucket_name(bucket)
        .build()
        .map_err(|e| format!("{describe}: {}", explain(&e)))?;
    Ok(Built { store, describe })
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The endpoint without user, password, query or fragment, for messages.
pub(crate) fn display_endpoint(endpoint: &str) -> String {
    match url::Url::parse(endpoint) {
        Ok(mut url) => {
            let _ = url.set_username("");
            let _ = url.set_password(None);
            url.set_query(None);
            url.set_fragment(None);
            url.to_string().trim_end_matches('/').to_owned()
        }
        Err(_) => "<an endpoint that is not a URL>".into(),
    }
}

/// An `object_store` error in few words: S3's `<Code>` and `<Message>` when the store sent them,
/// else the error's own text.
pub(crate) fn explain(error: &object_store::Error) -> String {
    let text = error.to_string();
    let element = |name: &str| {
        let open = format!("<{name}>");
        let (_, rest) = text.split_once(&open)?;
        rest.split_once(&format!("</{name}>")).map(|(v, _)| v)
    };
    match (element("Code"), element("Message")) {
        (Some(code), Some(message)) => format!("{code}: {message}"),
        (Some(code), None) => code.to_owned(),
        _ => text,
    }
}

/// One profile's keys from the shared credentials file, then the config file.
#[derive(Debug, Default)]
struct SharedFiles {
    credentials: HashMap<String, String>,
    config: HashMap<String, String>,
}

impl SharedFiles {
    fn read(profile: &str) -> Result<Self, String> {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let path = |var: &str, default: &str| {
            env(var)
                .map(PathBuf::from)
                .or_else(|| home.as_ref().map(|h| h.join(default)))
        };
        let mut files = Self::default();
        if let Some(file) = path("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials") {
            files.credentials = read_section(&file, profile)?;
        }
        if let Some(file) = path("AWS_CONFIG_FILE", ".aws/config") {
            // The config file names profiles other than `default` as `[profile NAME]`.
            let section = if profile == "default" {
                "default".to_owned()
            } else {
                format!("profile {profile}")
            };
            files.config = read_section(&file, &section)?;
        }
        Ok(files)
    }

    fn get(&self, key: &str) -> Option<String> {
        self.credentials
            .get(key)
            .or_else(|| self.config.get(key))
            .cloned()
    }
}

/// The `key = value` lines of `[section]` in an INI file; nothing when the file is missing.
fn read_section(file: &Path, section: &str) -> Result<HashMap<String, String>, String> {
    let text = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
        Err(e) => return Err(format!("cannot read {}: {e}", file.display())),
    };
    Ok(parse_section(&text, section))
}

fn parse_section(text: &str, section: &str) -> HashMap<String, String> {
    let mut found = HashMap::new();
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = name.trim() == section;
            continue;
        }
        if inside {
            if let Some((key, value)) = line.split_once('=') {
                found.insert(key.trim().to_ascii_lowercase(), value.trim().to_owned());
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profile_section_is_read() {
        let text = "# comment\n[default]\naws_access_key_id = A\n\n[other]\nAWS_ACCESS_KEY_ID=B\nregion = eu-west-1\n";
        assert_eq!(parse_section(text, "default")["aws_access_key_id"], "A");
        let other = parse_section(text, "other");
        assert_eq!(other["aws_access_key_id"], "B");
        assert_eq!(other["region"], "eu-west-1");
        assert!(parse_section(text, "missing").is_empty());
    }

    #[test]
    fn endpoints_are_shown_without_secrets() {
        assert_eq!(
            display_endpoint("http://user:pw@127.0.0.1:9000/?X-Amz-Signature=s"),
            "http://127.0.0.1:9000"
        );
        assert_eq!(
            display_endpoint("not a url pw"),
            "<an endpoint that is not a URL>"
        );
    }

    #[test]
    fn options_hide_secrets() {
        let options = S3Options {
            access_key_id: Some("id".into()),
            secret_access_key: Some("very-secret".into()),
            session_token: Some("token-secret".into()),
            ..Default::default()
        };
        let shown = format!("{options:?}");
        assert!(shown.contains("id"), "{shown}");
        assert!(
            !shown.contains("very-secret") && !shown.contains("token-secret"),
            "{shown}"
        );
    }
}
