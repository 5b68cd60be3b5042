//! Redis URLs: the one parser that both config validation and [`crate::connect`] use, so they
//! accept exactly the same forms.

use std::fmt;

use fred::types::config::Config;

/// How the servers behind a URL are arranged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// One server (`redis://`, `rediss://`).
    Single,
    /// A Redis Cluster, reached from one or more seed nodes (`redis-cluster://`).
    Cluster,
    /// A primary found through Sentinels (`redis-sentinel://`).
    Sentinel {
        /// The `sentinelServiceName`: the name the Sentinels monitor the primary under.
        service_name: String,
    },
}

/// A Redis URL that [`parse_url`] accepted. Its `Debug` shows no credentials.
#[derive(Clone)]
pub struct RedisUrl {
    topology: Topology,
    tls: bool,
    nodes: Vec<(String, u16)>,
    database: Option<u8>,
    credentials: bool,
    /// fred's config for the URL, without TLS (connect adds it).
    pub(crate) config: Config,
}

impl RedisUrl {
    /// Single server, cluster or sentinel.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Whether the scheme asks for TLS (`rediss…`). Such a URL never falls back to plaintext.
    pub fn is_tls(&self) -> bool {
        self.tls
    }

    /// The server (single), the seed nodes (cluster) or the Sentinels (sentinel), in URL order.
    pub fn nodes(&self) -> &[(String, u16)] {
        &self.nodes
    }

    /// The database selected after connecting, if the URL names one.
    pub fn database(&self) -> Option<u8> {
        self.database
    }

    /// Whether the URL carries a user name or password.
    pub fn has_credentials(&self) -> bool {
        self.credentials
    }

    /// `host:port` of every node, comma-separated, for messages.
    pub fn addresses(&self) -> String {
        self.nodes
            .iter()
            .map(|(host, port)| format!("{host}:{port}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisUrl")
            .field("topology", &self.topology)
            .field("tls", &self.tls)
            .field("nodes", &self.nodes)
            .field("database", &self.database)
            .field("credentials", &self.credentials)
            .finish()
    }
}

/// Why a string is not an accepted Redis URL. The message never quotes the URL (it may hold a
/// password); callers add [`crate::redact_url`] of it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct UrlError {
    /// What is wrong.
    pub reason: String,
}

fn bad<T>(reason: impl Into<String>) -> Result<T, UrlError> {
    Err(UrlError {
        reason: reason.into(),
    })
}

/// The accepted schemes: (scheme, topology without its name, TLS).
const SCHEMES: [(&str, u8, bool); 6] = [
    ("redis", 0, false),
    ("rediss", 0, true),
    ("redis-cluster", 1, false),
    ("rediss-cluster", 1, true),
    ("redis-sentinel", 2, false),
    ("rediss-sentinel", 2, true),
];

/// Schemes a mistaken URL plausibly has, named in the error (none carries a secret).
const KNOWN_OTHER_SCHEMES: [&str; 14] = [
    "http",
    "https",
    "tcp",
    "tls",
    "unix",
    "redis+unix",
    "rediss+unix",
    "valkey",
    "valkeys",
    "valkey-cluster",
    "valkeys-cluster",
    "valkey-sentinel",
    "valkeys-sentinel",
    "sentinel",
];

const EXPECTED: &str = "expected redis://, rediss://, redis-cluster://, rediss-cluster://, \
    redis-sentinel:// or rediss-sentinel://";

/// Parses and checks a Redis URL (the forms of fred, the client):
///
/// - `redis://[[user]:password@]host[:port][/db]`, `rediss://…` for TLS (port 6379 by default);
/// - `redis-cluster://[[user]:password@]host:port[?node=host:port&node=…]`, `rediss-cluster://…`:
///   seed nodes of a Redis Cluster (database 0 only);
/// - `redis-sentinel://[[user]:password@]host[:port][/db]?sentinelServiceName=NAME[&node=host:port…]
///   [&sentinelUsername=U&sentinelPassword=P]`, `rediss-sentinel://…`: the hosts are Sentinels
///   (port 26379 by default), the user and password are the primary's; the Sentinels get
///   `sentinelUsername`/`sentinelPassword`, or no AUTH at all when those are not given.
///
/// Anything else is refused: other schemes, query parameters the form does not take (a `node=` on
/// a `redis://` URL would be silently ignored otherwise), a user without a password, a database
/// on a cluster.
///
/// ```
/// use batch_redis::{parse_url, Topology};
///
/// let url = parse_url("rediss-cluster://:pw@10.0.0.1:7000?node=10.0.0.2:7000")?;
/// assert_eq!(url.topology(), &Topology::Cluster);
/// assert!(url.is_tls());
/// assert_eq!(url.addresses(), "10.0.0.1:7000, 10.0.0.2:7000");
/// assert!(parse_url("unix:///tmp/redis.sock").is_err());
/// # Ok::<(), batch_redis::UrlError>(())
/// ```
pub fn parse_url(url: &str) -> Result<RedisUrl, UrlError> {
    let (kind, tls) = scheme(url)?;
    let (parsed, host) = well_formed(url)?;
    let credentials = !parsed.username().is_empty() || parsed.password().is_some();
    let default_port = if kind == 2 { 26379 } else { 6379 };
    let mut nodes = vec![(host, parsed.port().unwrap_or(default_port))];
    let service_name = query(kind, &parsed, &mut nodes)?;
    let database = database(parsed.path())?;
    let topology = topology(kind, database, service_name)?;
    let config = client_config(url, tls)?;
    Ok(RedisUrl {
        topology,
        tls,
        nodes,
        database,
        credentials,
        config,
    })
}

/// The topology without its name (an index into the forms of [`SCHEMES`]) and whether the URL
/// asks for TLS.
fn scheme(url: &str) -> Result<(u8, bool), UrlError> {
    let Some((scheme, _)) = url.split_once("://") else {
        return bad(format!("not a Redis URL ({EXPECTED})"));
    };
    let Some(&(_, kind, tls)) = SCHEMES.iter().find(|(s, ..)| *s == scheme) else {
        // Only well-known schemes are named: whatever else precedes :// could be a secret.
        let shown = match KNOWN_OTHER_SCHEMES.contains(&scheme) {
            true => format!("scheme {scheme:?}"),
            false => "scheme".to_owned(),
        };
        return bad(format!("unsupported {shown} ({EXPECTED})"));
    };
    Ok((kind, tls))
}

/// The URL parsed, with its host: no whitespace, no fragment, and a password with any user.
fn well_formed(url: &str) -> Result<(url::Url, String), UrlError> {
    if url.chars().any(char::is_whitespace) {
        return bad("the URL contains whitespace");
    }
    let parsed = match url::Url::parse(url) {
        Ok(parsed) => parsed,
        Err(e) => {
            return bad(format!(
                "the URL does not parse: {e} (a password with # / ? @ or % must be percent-encoded: %23 %2F %3F %40 %25)"
            ))
        }
    };
    let host = match parsed.host_str() {
        Some(host) if !host.is_empty() => host.to_owned(),
        _ => return bad("the URL has no host"),
    };
    if parsed.fragment().is_some() {
        return bad("the URL has a #fragment (a '#' in a password must be written %23)");
    }
    if !parsed.username().is_empty() && parsed.password().is_none() {
        return bad("the URL has a user name but no password (write user:password@host)");
    }
    Ok((parsed, host))
}

/// Reads the query parameters the form of `kind` takes: further nodes into `nodes`, and the
/// sentinel service name, returned; any other parameter is refused.
fn query(
    kind: u8,
    parsed: &url::Url,
    nodes: &mut Vec<(String, u16)>,
) -> Result<Option<String>, UrlError> {
    let mut service_name = None;
    for (key, value) in parsed.query_pairs() {
        match (kind, key.as_ref()) {
            (1 | 2, "node") => nodes.push(node(&value)?),
            (2, "sentinelServiceName") => {
                if value.is_empty() {
                    return bad("sentinelServiceName is empty");
                }
                if service_name.replace(value.into_owned()).is_some() {
                    return bad("sentinelServiceName is given twice");
                }
            }
            (2, "sentinelUsername" | "sentinelPassword") => {}
            (_, key) => return Err(unknown_parameter(kind, key)),
        }
    }
    Ok(service_name)
}

/// Why `key` is refused on a URL of `kind`, naming the key only when it cannot be a secret.
fn unknown_parameter(kind: u8, key: &str) -> UrlError {
    let shown = if key.len() <= 32 && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        format!("query parameter {key:?}")
    } else {
        "query parameter".to_owned()
    };
    let hint = match kind {
        0 => " (a redis:// URL takes none; use redis-cluster:// or redis-sentinel:// for several nodes)",
        1 => " (a cluster URL takes only node=host:port)",
        _ => " (a sentinel URL takes sentinelServiceName, node, sentinelUsername, sentinelPassword)",
    };
    UrlError {
        reason: format!("unknown {shown}{hint}"),
    }
}

/// The topology of `kind`: a cluster has database 0 only, a sentinel URL names its service.
fn topology(
    kind: u8,
    database: Option<u8>,
    service_name: Option<String>,
) -> Result<Topology, UrlError> {
    Ok(match kind {
        0 => Topology::Single,
        1 => {
            if database.unwrap_or(0) != 0 {
                return bad("a cluster has only database 0; remove the /db part");
            }
            Topology::Cluster
        }
        _ => Topology::Sentinel {
            service_name: service_name.ok_or(UrlError {
                reason:
                    "a sentinel URL needs ?sentinelServiceName=NAME (the monitored primary's name)"
                        .into(),
            })?,
        },
    })
}

/// The client's own configuration from the same URL.
fn client_config(url: &str, tls: bool) -> Result<Config, UrlError> {
    // fred parses the same string; TLS is left to connect, which builds it from the options.
    let plain = match tls {
        true => format!("redis{}", &url["rediss".len()..]),
        false => url.to_owned(),
    };
    match Config::from_url(&plain) {
        Ok(config) => Ok(config),
        Err(e) => bad(format!("the Redis client refuses the URL: {}", e.details())),
    }
}

fn node(value: &str) -> Result<(String, u16), UrlError> {
    match value.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && !host.contains(':') => match port.parse() {
            Ok(port) => Ok((host.to_owned(), port)),
            Err(_) => bad(format!(
                "node={value}: the port is not a number between 0 and 65535"
            )),
        },
        _ => bad(format!("node={value}: expected host:port")),
    }
}

fn database(path: &str) -> Result<Option<u8>, UrlError> {
    let db = path.strip_prefix('/').unwrap_or(path);
    if db.is_empty() {
        return Ok(None);
    }
    match db.parse::<u8>() {
        Ok(db) => Ok(Some(db)),
        Err(_) => bad("the path must be a database number between 0 and 255 (/0)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_every_documented_form() {
        let single = parse_url("redis://user:pw@127.0.0.1:6390/2").unwrap();
        assert_eq!(single.topology(), &Topology::Single);
        assert!(!single.is_tls());
        assert!(single.has_credentials());
        assert_eq!(single.database(), Some(2));
        assert_eq!(single.config.username.as_deref(), Some("user"));
        assert_eq!(single.config.password.as_deref(), Some("pw"));
        assert!(single.config.tls.is_none());

        let tls = parse_url("rediss://:p%40ss@redis.internal").unwrap();
        assert!(tls.is_tls());
        assert_eq!(tls.nodes(), [("redis.internal".to_owned(), 6379)]);
        assert_eq!(tls.config.password.as_deref(), Some("p@ss"));
        assert!(tls.config.tls.is_none(), "TLS comes from the options");

        let cluster =
            parse_url("redis-cluster://127.0.0.1:7000?node=127.0.0.1:7001&node=127.0.0.1:7002")
                .unwrap();
        assert_eq!(cluster.topology(), &Topology::Cluster);
        assert_eq!(cluster.nodes().len(), 3);
        assert!(cluster.config.server.is_clustered());
        assert!(parse_url("rediss-cluster://h:1").unwrap().is_tls());

        let sentinel = parse_url(
            "rediss-sentinel://:pw@127.0.0.1/1?sentinelServiceName=main&node=127.0.0.1:26380\
             &sentinelPassword=x",
        )
        .unwrap();
        assert_eq!(
            sentinel.topology(),
            &Topology::Sentinel {
                service_name: "main".into()
            }
        );
        assert_eq!(sentinel.addresses(), "127.0.0.1:26379, 127.0.0.1:26380");
        assert_eq!(sentinel.database(), Some(1));
        assert!(sentinel.config.server.is_sentinel());
        assert!(!format!("{sentinel:?}").contains("pw"));
    }

    #[test]
    fn refuses_what_connect_cannot_use() {
        for (url, needle) in [
            ("127.0.0.1:6379", "not a Redis URL"),
            ("http://host", "unsupported scheme \"http\""),
            ("unix:///tmp/r.sock", "unsupported scheme \"unix\""),
            ("s3cret://host", "unsupported scheme ("),
            ("redis+unix:///tmp/r.sock", "unsupported scheme"),
            ("redis://", "no host"),
            ("redis://host:port", "does not parse"),
            ("redis://user@host", "no password"),
            ("redis://host/x", "database number"),
            ("redis://host/300", "database number"),
            ("redis://:pw@host#x", "fragment"),
            ("redis://:p#w@host", "percent-encoded"),
            ("redis://h?node=h:2", "unknown query parameter \"node\""),
            ("redis-cluster://h:1/3", "only database 0"),
            ("redis-cluster://h:1?node=h", "expected host:port"),
            ("redis-cluster://h:1?node=h:x", "port is not a number"),
            ("redis-cluster://h:1?sentinelServiceName=a", "unknown query"),
            ("redis-sentinel://h:1", "needs ?sentinelServiceName"),
            ("redis-sentinel://h:1?sentinelServiceName=", "is empty"),
            (
                "redis-sentinel://h?sentinelServiceName=a&sentinelServiceName=b",
                "twice",
            ),
            (
                "redis-sentinel://h?sentinelServiceName=a&x=1",
                "unknown query",
            ),
            ("redis://ho st", "whitespace"),
        ] {
            let err = parse_url(url).unwrap_err().to_string();
            assert!(err.contains(needle), "{url}: {err}");
        }
    }

    #[test]
    fn errors_do_not_quote_secrets() {
        for url in ["s3cret", "s3cret://x", "redis://:s3cret@h/s3cret"] {
            let err = parse_url(url).unwrap_err().to_string();
            assert!(!err.contains("s3cret"), "{url}: {err}");
        }
    }
}
