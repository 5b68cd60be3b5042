//! The batch processor's configuration.
//!
//! A YAML file, overridable by `PROCESSOR_…` environment variables (`__` separates nested keys:
//! `PROCESSOR_ASYNC_DISPATCH__RESULT_POLL_TIMEOUT=1s`), resolved into a [`ProcessorConfig`] with
//! every default applied. Validation never stops at the first problem: [`ConfigErrors`] lists them
//! all, each naming the file (or the environment variable) and the field path, e.g.
//! `processor.yaml: model_gateways.llama-3.url: missing (every model needs a url in sync mode)`.
//! Unknown keys are errors, so a typo is never silently ignored.
//!
//! Relative file paths resolve against the directory of the file that set them (the current
//! directory for environment variables). figment lowercases environment keys and splits them on
//! `.`, so a per-model override such as `PROCESSOR_MODEL_GATEWAYS__LLAMA-3__MAX_RETRIES=5` only
//! reaches models whose names are lowercase and hold no `.`.
//!
//! Secrets (the Redis URL, gateway API keys) live in mounted files named by the config; they are
//! read at load time into [`Secret`]s, which print as `[redacted]`. The Redis URL is checked by
//! the connection library's own parser ([`batch_redis::parse_url`]), so the config accepts exactly
//! the forms connecting accepts; `redis_tls` ([`RedisTlsConfig`]) goes only with a `rediss…` URL.
//!
//! ```
//! use batch_config::{DispatchMode, ProcessorConfig};
//! use figment::{providers::{Format, Yaml}, Figment};
//!
//! let yaml = r#"
//! model_gateways:
//!   llama-3:
//!     url: http://127.0.0.1:8000
//!     inference_pool_name: pool-a
//!   Qwen/Qwen3-0.6B:
//!     url: http://127.0.0.1:8001
//!     inference_pool_name: pool-a
//!     request_timeout: 30s
//! "#;
//! let config = ProcessorConfig::from_figment(Figment::from(Yaml::string(yaml)))?;
//! assert_eq!(config.dispatch_mode, DispatchMode::Sync);
//! assert_eq!(config.model_gateways["Qwen/Qwen3-0.6B"].request_timeout.as_secs(), 30);
//! assert_eq!(config.pools()["pool-a"], ["Qwen/Qwen3-0.6B", "llama-3"]);
//! assert_eq!(
//!     config.queue_names().request_queue_name("pool-a")?,
//!     "llm-d-async:requests:pool-a"
//! );
//!
//! let broken = "dispatch_mode: fast\nmodel_gateways:\n  m: {request_timeout: 0s}\n";
//! let errors = ProcessorConfig::from_figment(Figment::from(Yaml::string(broken))).unwrap_err();
//! assert_eq!(errors.len(), 3); // the mode, the zero timeout, the missing url
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(missing_docs)]

mod collect;
mod dispatcher;
mod error;
mod load;
mod types;
mod values;

pub use dispatcher::{
    DispatcherQueueEntry, DispatcherQueues, DispatcherTransportConfig, GateSizing, PoolQueues,
    DISPATCHER_BATCH_SIZE, DISPATCHER_CONCURRENCY, DISPATCHER_GATE_TYPE, DISPATCHER_GATE_TYPES,
    DISPATCHER_MAX_CONCURRENCY, DISPATCHER_POLL_INTERVAL_MS, DISPATCHER_REQUEST_PATH,
    DISPATCHER_RETRY_QUEUE, PLACEHOLDER_GATEWAY_URL,
};
pub use error::{ConfigError, ConfigErrors};
pub use load::{check_tenant, ENV_NESTING, ENV_PREFIX};
pub use types::{
    AimdConfig, ApiKey, AsyncDispatchConfig, ConcurrencyConfig, DispatchMode, DispatcherSettings,
    InputLimits, LimiterAlgorithm, LoadConfig, ModelGatewayConfig, ObservabilityConfig,
    ProcessorConfig, RedisTlsConfig, S3Config, Secret, ServeConfig, ServeTls, TlsConfig,
    WebhooksConfig, DEFAULT_REDIS_URL_FILE, REDACTED,
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
