#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod collect;
mod dispatcher;
mod error;
mod load;
#[macro_use]
mod table;
mod types;
mod values;

pub use dispatcher::{
    DispatcherQueueEntry, DispatcherQueues, DispatcherTransportConfig, GateSizing, PoolQueues,
    PoolSizing, DISPATCHER_BATCH_SIZE, DISPATCHER_CONCURRENCY, DISPATCHER_GATE_TYPE,
    DISPATCHER_GATE_TYPES, DISPATCHER_MAX_CONCURRENCY, DISPATCHER_POLL_INTERVAL_MS,
    DISPATCHER_REQUEST_PATH, DISPATCHER_RETRY_QUEUE, PLACEHOLDER_GATEWAY_URL,
};
pub use error::{ConfigError, ConfigErrors};
pub use load::{check_tenant, ENV_NESTING, ENV_PREFIX};
pub use types::{
    AimdConfig, ApiKey, AsyncDispatchConfig, ConcurrencyConfig, DispatchMode, DispatcherSettings,
    InputLimits, LimiterAlgorithm, LoadConfig, ModelGatewayConfig, ObservabilityConfig,
    PoolSettings, ProcessorConfig, RedisTlsConfig, S3Config, Secret, ServeConfig, ServeTls,
    TlsConfig, WebhooksConfig, DEFAULT_REDIS_URL_FILE, REDACTED,
};
pub use values::{parse_byte_size, parse_duration};

/// Re-exported so embedders can build a figment without depending on figment's version.
pub use figment;

impl ProcessorConfig {
    /// The resolved configuration as YAML, secrets shown as `[redacted]`.
    pub fn to_redacted_yaml(&self) -> String {
        // Only strings, numbers, maps and redacted secrets: serialisation cannot fail.
        serde_yaml::to_string(self)
            .unwrap_or_else(|e| format!("# the configuration could not be printed: {e}\n"))
    }
}
