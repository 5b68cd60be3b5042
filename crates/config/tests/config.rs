//! Loading and validation, through real files on disk.
//!
//! Tests that read the environment run inside `figment::Jail` (which serialises them and restores
//! the environment); the others use a figment without an `Env` provider and absolute paths, so
//! they are unaffected by a jail running at the same time.

// `Jail::expect_with` takes closures returning figment's (large) error type; not ours to shrink.
#![allow(clippy::result_large_err)]

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use batch_config::figment::providers::{Format, Yaml};
use batch_config::figment::{Figment, Jail};
use batch_config::{ConfigErrors, DispatchMode, LimiterAlgorithm, ProcessorConfig, Secret};

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(&path, text).unwrap();
    path
}

/// The file alone, without the environment.
fn load_file(path: &Path) -> Result<ProcessorConfig, ConfigErrors> {
    ProcessorConfig::from_figment(Figment::from(Yaml::file_exact(path)))
}

fn errors_of(path: &Path) -> Vec<String> {
    match load_file(path) {
        Ok(config) => panic!("accepted: {config:?}"),
        Err(errors) => errors.errors.iter().map(ToString::to_string).collect(),
    }
}

fn assert_one_error(errors: &[String], expected: &str) {
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert!(
        errors[0].contains(expected),
        "{:?} lacks {expected:?}",
        errors[0]
    );
}

#[test]
fn defaults_fill_a_minimal_sync_config() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "model_gateways:\n  m:\n    url: http://127.0.0.1:8000\n",
    );
    let c = load_file(&file).unwrap();

    assert_eq!(c.dispatch_mode, DispatchMode::Sync);
    assert_eq!(c.async_dispatch.result_poll_timeout, Duration::from_secs(5));
    assert_eq!(c.async_dispatch.queue_prefix, "llm-d-async");
    assert_eq!(c.async_dispatch.consumer_id, "$batch");
    assert_eq!(
        c.async_dispatch.lost_request_timeout,
        Duration::from_secs(600)
    );
    assert_eq!(c.async_dispatch.enqueue_chunk, 1000);
    assert_eq!(c.async_dispatch.result_batch, 1000);
    assert_eq!(c.async_dispatch.result_linger, Duration::from_millis(10));

    let m = &c.model_gateways["m"];
    assert_eq!(m.url.as_deref(), Some("http://127.0.0.1:8000"));
    assert_eq!(m.inference_pool_name, None);
    assert_eq!(m.request_timeout, Duration::from_secs(300));
    assert_eq!(m.max_retries, 3);
    assert_eq!(m.initial_backoff, Duration::from_secs(1));
    assert_eq!(m.max_backoff, Duration::from_secs(60));
    assert_eq!((m.api_key_file.as_ref(), m.api_key.as_ref()), (None, None));
    assert_eq!(m.inference_objective, None);
    assert_eq!(m.tls.ca_cert_file, None);
    assert_eq!(m.tls.client_cert_file, None);
    assert_eq!(m.tls.client_key_file, None);
    assert!(!m.tls.insecure_skip_verify);

    assert_eq!(c.concurrency.global, 100);
    assert_eq!(c.concurrency.per_endpoint, 10);
    assert!(c.concurrency.aimd.enabled);
    assert_eq!(c.concurrency.aimd.min, 5);
    assert_eq!(c.concurrency.aimd.backoff_factor, 0.5);
    assert_eq!(c.concurrency.aimd.additive_increase, 1);
    assert_eq!(c.concurrency.aimd.algorithm, LimiterAlgorithm::Work);

    assert_eq!(c.redis_url_file, Path::new("/etc/.secrets/redis-url"));
    assert_eq!(
        c.redis_url, None,
        "sync mode must not read the Redis secret"
    );
    assert_eq!(c.work_dir, std::env::temp_dir().join("batch-processor"));
    assert_eq!(c.observability.addr, None);
    assert_eq!(c.observability.otlp_endpoint, None);
    assert_eq!(c.input.max_requests, 50_000);
    assert_eq!(c.input.max_file_bytes, 200 * 1024 * 1024);
}

#[test]
fn every_field_is_parsed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "redis-url", "redis://127.0.0.1:7777\n");
    write(d, "key", "  sk-test  \n");
    write(d, "ca.pem", "ca");
    write(d, "client.pem", "cert");
    write(d, "client.key", "key");
    let file = write(
        d,
        "processor.yaml",
        r#"
dispatch_mode: async
async_dispatch:
  result_poll_timeout: 250ms
  queue_prefix: staging
  consumer_id: replica-1
  lost_request_timeout: 2m
  enqueue_chunk: 50
  result_batch: 20
  result_linger: 0s
model_gateways:
  "Qwen/Qwen3-0.6B":
    url: https://gateway.example:8443/
    inference_pool_name: pool-q
    request_timeout: 30s
    max_retries: 0
    initial_backoff: 10ms
    max_backoff: 1h
    api_key_file: key
    inference_objective: batch-low
    tls_ca_cert_file: ca.pem
    tls_client_cert_file: client.pem
    tls_client_key_file: client.key
    tls_insecure_skip_verify: true
concurrency:
  global: 7
  per_endpoint: 3
  aimd: {enabled: false, algorithm: aimd, min: 2, backoff_factor: 0.75, additive_increase: 2}
redis_url_file: redis-url
work_dir: /var/tmp/jobs
observability: {addr: "127.0.0.1:9090", otlp_endpoint: "http://127.0.0.1:4318"}
input: {max_requests: 10, max_file_bytes: 1MiB}
"#,
    );
    let c = load_file(&file).unwrap();

    assert_eq!(c.dispatch_mode, DispatchMode::Async);
    let a = &c.async_dispatch;
    assert_eq!(a.result_poll_timeout, Duration::from_millis(250));
    assert_eq!(
        (a.queue_prefix.as_str(), a.consumer_id.as_str()),
        ("staging", "replica-1")
    );
    assert_eq!(a.lost_request_timeout, Duration::from_secs(120));
    assert_eq!((a.enqueue_chunk, a.result_batch), (50, 20));
    assert_eq!(a.result_linger, Duration::ZERO);

    let m = &c.model_gateways["Qwen/Qwen3-0.6B"];
    assert_eq!(m.url.as_deref(), Some("https://gateway.example:8443/"));
    assert_eq!(m.inference_pool_name.as_deref(), Some("pool-q"));
    assert_eq!(m.request_timeout, Duration::from_secs(30));
    assert_eq!(m.max_retries, 0);
    assert_eq!(m.initial_backoff, Duration::from_millis(10));
    assert_eq!(m.max_backoff, Duration::from_secs(3600));
    assert_eq!(m.api_key_file.as_deref(), Some(d.join("key").as_path()));
    assert_eq!(m.api_key.as_ref().map(Secret::expose), Some("sk-test"));
    assert_eq!(m.inference_objective.as_deref(), Some("batch-low"));
    assert_eq!(
        m.tls.ca_cert_file.as_deref(),
        Some(d.join("ca.pem").as_path())
    );
    assert_eq!(
        m.tls.client_cert_file.as_deref(),
        Some(d.join("client.pem").as_path())
    );
    assert_eq!(
        m.tls.client_key_file.as_deref(),
        Some(d.join("client.key").as_path())
    );
    assert!(m.tls.insecure_skip_verify);

    assert_eq!((c.concurrency.global, c.concurrency.per_endpoint), (7, 3));
    let aimd = &c.concurrency.aimd;
    assert_eq!(
        (
            aimd.enabled,
            aimd.min,
            aimd.backoff_factor,
            aimd.additive_increase
        ),
        (false, 2, 0.75, 2)
    );
    assert_eq!(aimd.algorithm, LimiterAlgorithm::Aimd);
    assert_eq!(c.redis_url_file, d.join("redis-url"));
    assert_eq!(
        c.redis_url.as_ref().map(Secret::expose),
        Some("redis://127.0.0.1:7777")
    );
    assert_eq!(c.work_dir, Path::new("/var/tmp/jobs"));
    assert_eq!(
        c.observability.addr,
        Some("127.0.0.1:9090".parse().unwrap())
    );
    assert_eq!(
        c.observability.otlp_endpoint.as_deref(),
        Some("http://127.0.0.1:4318")
    );
    assert_eq!(
        (c.input.max_requests, c.input.max_file_bytes),
        (10, 1 << 20)
    );

    let names = c.queue_names();
    assert_eq!(
        names.result_queue_name("pool-q").unwrap(),
        "staging:results:pool-q:replica-1"
    );
}

#[test]
fn tls_may_also_be_written_nested() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "ca.pem", "ca");
    let file = write(
        d,
        "processor.yaml",
        "model_gateways:\n  m:\n    url: https://h\n    tls: {ca_cert_file: ca.pem, insecure_skip_verify: true}\n",
    );
    let c = load_file(&file).unwrap();
    assert_eq!(
        c.model_gateways["m"].tls.ca_cert_file,
        Some(d.join("ca.pem"))
    );
    assert!(c.model_gateways["m"].tls.insecure_skip_verify);

    let twice = write(
        d,
        "twice.yaml",
        "model_gateways:\n  m:\n    url: https://h\n    tls_ca_cert_file: ca.pem\n    tls: {ca_cert_file: ca.pem}\n",
    );
    assert_one_error(
        &errors_of(&twice),
        "model_gateways.m.tls_ca_cert_file: also set as tls.ca_cert_file",
    );
}

#[test]
fn env_overrides_the_file() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file(
            "processor.yaml",
            "model_gateways:\n  llama-3: {url: 'http://127.0.0.1:8000', inference_pool_name: pool-a}\n",
        )?;
        jail.create_dir("from-env")?;
        jail.create_file("from-env/redis-url", "redis://127.0.0.1:6380\n")?;
        jail.set_env("PROCESSOR_DISPATCH_MODE", "async");
        jail.set_env("PROCESSOR_ASYNC_DISPATCH__RESULT_POLL_TIMEOUT", "1s");
        jail.set_env("PROCESSOR_REDIS_URL_FILE", "from-env/redis-url");
        jail.set_env("PROCESSOR_CONCURRENCY__GLOBAL", "7");
        jail.set_env("PROCESSOR_MODEL_GATEWAYS__LLAMA-3__MAX_RETRIES", "9");

        let c = ProcessorConfig::load(Path::new("processor.yaml")).map_err(|e| e.to_string())?;
        assert_eq!(c.dispatch_mode, DispatchMode::Async);
        assert_eq!(c.async_dispatch.result_poll_timeout, Duration::from_secs(1));
        assert_eq!(c.concurrency.global, 7);
        assert_eq!(c.model_gateways["llama-3"].max_retries, 9);
        assert_eq!(
            c.model_gateways["llama-3"].url.as_deref(),
            Some("http://127.0.0.1:8000")
        );
        // A relative path from the environment is relative to the current directory.
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(c.redis_url_file, cwd.join("from-env/redis-url"));
        assert_eq!(
            c.redis_url.as_ref().map(Secret::expose),
            Some("redis://127.0.0.1:6380")
        );
        Ok(())
    });
}

#[test]
fn env_errors_name_the_variable() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file(
            "processor.yaml",
            "model_gateways:\n  m: {url: 'http://127.0.0.1:8000'}\n",
        )?;
        jail.set_env("PROCESSOR_ASYNC_DISPATCH__RESULT_POLL_TIMEOUT", "0s");
        jail.set_env("PROCESSOR_CONCURENCY__GLOBAL", "3");
        jail.set_env("PROCESSOR_MODEL_GATEWAYS__M__REQUEST_TIMEOUT", "5");

        let errors = ProcessorConfig::load(Path::new("processor.yaml"))
            .unwrap_err()
            .to_string();
        let lines: Vec<&str> = errors.lines().collect();
        assert_eq!(lines.len(), 3, "{errors}");
        assert!(lines.contains(
            &"PROCESSOR_ASYNC_DISPATCH__RESULT_POLL_TIMEOUT: async_dispatch.result_poll_timeout: must be greater than 0"
        ), "{errors}");
        assert!(
            lines.contains(
                &"PROCESSOR_CONCURENCY: concurency: unknown key (did you mean concurrency?)"
            ),
            "{errors}"
        );
        assert!(lines.iter().any(|l| l.starts_with(
            "PROCESSOR_MODEL_GATEWAYS__M__REQUEST_TIMEOUT: model_gateways.m.request_timeout: expected a duration such as 5s"
        )), "{errors}");
        Ok(())
    });
}

#[test]
fn a_missing_config_file_is_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.yaml");
    let errors = ProcessorConfig::load(&missing).unwrap_err();
    assert_eq!(errors.len(), 1);
    let line = errors.to_string();
    assert!(
        line.starts_with(&format!(
            "{}: cannot read the config file",
            missing.display()
        )),
        "{line}"
    );
}

#[test]
fn unparsable_yaml_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "bad.yaml", "model_gateways: [unclosed\n");
    let errors = errors_of(&file);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].starts_with(&format!("{}: ", file.display())),
        "{errors:?}"
    );
    assert!(errors[0].contains("cannot parse"), "{errors:?}");
}

#[test]
fn all_errors_are_collected_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        r#"
dispatch_mode: sync
async_dispatch:
  result_poll_timeout: 0s
model_gateways:
  llama-3:
    inference_pool_name: pool-a
  mistral:
    url: http://127.0.0.1:8001
    max_backoff: 10ms
concurrency:
  global: 0
  aimd:
    algorithm: vegas
    backoff_factor: 1.5
"#,
    );
    let errors = errors_of(&file);
    let f = file.display();
    let expected = [
        format!("{f}: async_dispatch.result_poll_timeout: must be greater than 0"),
        format!("{f}: model_gateways.llama-3.url: missing (every model needs a url in sync mode)"),
        format!("{f}: model_gateways.mistral.max_backoff: must be at least initial_backoff (1s)"),
        format!("{f}: concurrency.global: must be at least 1, got 0"),
        format!("{f}: concurrency.aimd.algorithm: unknown limiter algorithm \"vegas\" (expected aimd or gradient or work)"),
        format!("{f}: concurrency.aimd.backoff_factor: must be strictly between 0 and 1, got 1.5"),
    ];
    assert_eq!(errors, expected);
    // Display is one line per error.
    let display = load_file(&file).unwrap_err().to_string();
    assert_eq!(display.lines().count(), 6, "{display}");
}

#[test]
fn missing_url_in_sync_mode() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "model_gateways:\n  llama-3:\n    max_retries: 1\n",
    );
    let errors = errors_of(&file);
    assert_eq!(
        errors,
        [format!(
            "{}: model_gateways.llama-3.url: missing (every model needs a url in sync mode)",
            file.display()
        )]
    );
}

#[test]
fn urls_must_be_http_with_a_host() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "model_gateways:\n  m: {url: '127.0.0.1:8000'}\n",
    );
    assert_one_error(
        &errors_of(&file),
        "model_gateways.m.url: expected an http:// or https:// URL",
    );
}

#[test]
fn unknown_dispatch_mode() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "dispatch_mode: fast\nmodel_gateways:\n  m: {url: 'http://127.0.0.1:8000'}\n",
    );
    assert_one_error(
        &errors_of(&file),
        "dispatch_mode: unknown dispatch mode \"fast\" (expected sync, async or dry_run)",
    );
}

#[test]
fn dry_run_needs_neither_a_url_nor_a_pool_nor_redis() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "dispatch_mode: dry_run\nmodel_gateways:\n  m: {}\n",
    );
    let c = load_file(&file).unwrap();
    assert_eq!(c.dispatch_mode, DispatchMode::DryRun);
    assert_eq!(c.dispatch_mode.to_string(), "dry_run");
    assert_eq!(c.redis_url, None);
}

#[test]
fn zero_poll_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "async_dispatch: {result_poll_timeout: 0ms}\nmodel_gateways:\n  m: {url: 'http://127.0.0.1:8000'}\n",
    );
    assert_one_error(
        &errors_of(&file),
        "async_dispatch.result_poll_timeout: must be greater than 0",
    );
}

#[test]
fn zero_request_timeout_is_an_error_not_five_minutes() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "model_gateways:\n  m: {url: 'http://127.0.0.1:8000', request_timeout: 0s}\n",
    );
    assert_one_error(
        &errors_of(&file),
        "model_gateways.m.request_timeout: must be greater than 0",
    );
}

#[test]
fn a_bare_number_is_not_a_duration() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "model_gateways:\n  m: {url: 'http://127.0.0.1:8000', initial_backoff: 5}\n",
    );
    assert_one_error(
        &errors_of(&file),
        "model_gateways.m.initial_backoff: expected a duration such as 5s",
    );
}

#[test]
fn async_mode_needs_a_pool_per_model() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "redis-url", "redis://127.0.0.1:7000");
    let file = write(
        dir.path(),
        "processor.yaml",
        "dispatch_mode: async\nredis_url_file: redis-url\nmodel_gateways:\n  with: {inference_pool_name: p}\n  without: {url: 'http://127.0.0.1:8000'}\n",
    );
    assert_eq!(errors_of(&file), [format!(
        "{}: model_gateways.without.inference_pool_name: missing (every model needs an inference_pool_name in async mode)",
        file.display()
    )]);
}

#[test]
fn unreadable_secret_files_name_the_field_and_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "dispatch_mode: async\nredis_url_file: missing/redis-url\nmodel_gateways:\n  m: {inference_pool_name: p, api_key_file: /nonexistent/key}\n",
    );
    let errors = errors_of(&file);
    let f = file.display();
    let redis = dir.path().join("missing/redis-url");
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert!(
        errors[0].starts_with(&format!(
            "{f}: model_gateways.m.api_key_file: cannot read secret file /nonexistent/key:"
        )),
        "{errors:#?}"
    );
    assert!(
        errors[1].starts_with(&format!(
            "{f}: redis_url_file: cannot read secret file {}:",
            redis.display()
        )),
        "{errors:#?}"
    );
}

#[test]
fn the_default_redis_url_file_is_only_read_in_async_mode() {
    let dir = tempfile::tempdir().unwrap();
    let sync = write(
        dir.path(),
        "sync.yaml",
        "model_gateways:\n  m: {url: 'http://127.0.0.1:8000'}\n",
    );
    assert!(load_file(&sync).is_ok());
    if Path::new("/etc/.secrets/redis-url").exists() {
        return; // this machine has the real secret: the async half cannot fail here
    }
    let asynchronous = write(
        dir.path(),
        "async.yaml",
        "dispatch_mode: async\nmodel_gateways:\n  m: {inference_pool_name: p}\n",
    );
    assert_one_error(
        &errors_of(&asynchronous),
        "redis_url_file: cannot read secret file /etc/.secrets/redis-url",
    );
}

#[test]
fn empty_or_malformed_secrets_are_errors_without_their_content() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "empty-key", " \n");
    write(dir.path(), "redis-url", "hunter2-not-a-url\n");
    let file = write(
        dir.path(),
        "processor.yaml",
        "dispatch_mode: async\nredis_url_file: redis-url\nmodel_gateways:\n  m: {inference_pool_name: p, api_key_file: empty-key}\n",
    );
    let errors = errors_of(&file);
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert!(
        errors[0].contains("model_gateways.m.api_key_file: secret file")
            && errors[0].ends_with("is empty")
    );
    assert!(
        errors[1].contains("redis_url_file: ") && errors[1].contains("does not hold a Redis URL")
    );
    assert!(!errors.join("\n").contains("hunter2"), "{errors:#?}");
}

#[test]
fn unknown_keys_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        r#"
model_gateways:
  m: {url: 'http://127.0.0.1:8000', max_retry: 2, tls: {ca_file: x}}
concurrency: {globl: 3}
observabilty: {}
"#,
    );
    let f = file.display();
    assert_eq!(errors_of(&file), [
        format!("{f}: observabilty: unknown key (did you mean observability?)"),
        format!("{f}: model_gateways.m.max_retry: unknown key (did you mean max_retries?)"),
        format!("{f}: model_gateways.m.tls.ca_file: unknown key (expected one of: ca_cert_file, client_cert_file, client_key_file, insecure_skip_verify)"),
        format!("{f}: concurrency.globl: unknown key (did you mean global?)"),
    ]);
}

#[test]
fn bad_pool_name() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "model_gateways:\n  m: {url: 'http://127.0.0.1:8000', inference_pool_name: 'a:b'}\n",
    );
    assert_one_error(
        &errors_of(&file),
        "model_gateways.m.inference_pool_name: pool name \"a:b\" contains ':'",
    );
}

#[test]
fn bad_queue_prefix_and_consumer_id() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "async_dispatch: {queue_prefix: 'x y', consumer_id: ''}\nmodel_gateways:\n  m: {url: 'http://127.0.0.1:8000'}\n",
    );
    let errors = errors_of(&file);
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert!(
        errors[0].contains("async_dispatch.queue_prefix: prefix \"x y\" contains ' '"),
        "{errors:#?}"
    );
    assert!(
        errors[1].contains("async_dispatch.consumer_id: consumer id is empty"),
        "{errors:#?}"
    );
}

#[test]
fn cross_field_limits() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "concurrency: {per_endpoint: 3, aimd: {min: 4, additive_increase: 0}}\nmodel_gateways: {}\n",
    );
    let f = file.display();
    assert_eq!(errors_of(&file), [
        format!("{f}: model_gateways: no model configured (add at least one model under model_gateways)"),
        format!("{f}: concurrency.aimd.min: 4 is above concurrency.per_endpoint (3)"),
        format!("{f}: concurrency.aimd.additive_increase: must be at least 1, got 0"),
    ]);
}

#[test]
fn client_certificate_and_key_come_together_and_must_be_readable() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "client.pem", "cert");
    let file = write(
        dir.path(),
        "processor.yaml",
        "model_gateways:\n  m: {url: 'https://h', tls_client_cert_file: client.pem, tls_ca_cert_file: nope.pem}\n",
    );
    let errors = errors_of(&file);
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert!(
        errors[0].contains(&format!(
            "model_gateways.m.tls_ca_cert_file: cannot read {}",
            dir.path().join("nope.pem").display()
        )),
        "{errors:#?}"
    );
    assert!(
        errors[1].contains("model_gateways.m.tls_client_cert_file: set tls_client_key_file too"),
        "{errors:#?}"
    );
}

#[test]
fn model_names_may_hold_dots_and_slashes() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "model_gateways:\n  Qwen/Qwen3-0.6B: {request_timeout: 2s}\n  meta.llama-3.1: {url: 'http://127.0.0.1:1'}\n",
    );
    assert_eq!(errors_of(&file), [format!(
        "{}: model_gateways.\"Qwen/Qwen3-0.6B\".url: missing (every model needs a url in sync mode)",
        file.display()
    )]);
    write(
        dir.path(),
        "processor.yaml",
        "model_gateways:\n  Qwen/Qwen3-0.6B: {url: 'http://127.0.0.1:1', request_timeout: 2s}\n",
    );
    let c = load_file(&file).unwrap();
    assert_eq!(
        c.model_gateways["Qwen/Qwen3-0.6B"].request_timeout,
        Duration::from_secs(2)
    );
}

#[test]
fn secrets_never_appear_in_debug_display_or_yaml() {
    const API_KEY: &str = "sk-live-4f9a7c21e0b3";
    const REDIS_PASSWORD: &str = "hunter2-5d1e";
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "api-key", &format!("{API_KEY}\n"));
    write(
        dir.path(),
        "redis-url",
        &format!("redis://:{REDIS_PASSWORD}@127.0.0.1:7000\n"),
    );
    let file = write(
        dir.path(),
        "processor.yaml",
        "dispatch_mode: async\nredis_url_file: redis-url\nmodel_gateways:\n  m: {inference_pool_name: p, api_key_file: api-key}\n",
    );
    let c = load_file(&file).unwrap();
    let key = c.model_gateways["m"].api_key.clone().unwrap();
    assert_eq!(key.expose(), API_KEY);
    assert!(c
        .redis_url
        .as_ref()
        .unwrap()
        .expose()
        .contains(REDIS_PASSWORD));

    let yaml = c.to_redacted_yaml();
    for shown in [
        format!("{c:?}"),
        format!("{key}"),
        format!("{key:?}"),
        yaml.clone(),
    ] {
        assert!(!shown.contains(API_KEY), "API key leaked: {shown}");
        assert!(
            !shown.contains(REDIS_PASSWORD),
            "Redis password leaked: {shown}"
        );
    }
    assert!(yaml.contains("api_key: '[redacted]'"), "{yaml}");
    assert!(yaml.contains("redis_url: '[redacted]'"), "{yaml}");
}

#[test]
fn relative_paths_resolve_against_the_config_directory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "conf/secrets/redis-url", "redis://127.0.0.1:7000");
    write(d, "keys/m", "k");
    write(d, "conf/ca.pem", "ca");
    let file = write(
        d,
        "conf/processor.yaml",
        "dispatch_mode: async\nredis_url_file: secrets/redis-url\nwork_dir: work\nmodel_gateways:\n  m: {inference_pool_name: p, api_key_file: ../keys/m, tls_ca_cert_file: ca.pem}\n",
    );
    let c = load_file(&file).unwrap();
    let conf = d.join("conf");
    assert_eq!(c.redis_url_file, conf.join("secrets/redis-url"));
    assert_eq!(c.work_dir, conf.join("work"));
    assert_eq!(
        c.model_gateways["m"].api_key_file,
        Some(conf.join("../keys/m"))
    );
    assert_eq!(
        c.model_gateways["m"].api_key.as_ref().map(Secret::expose),
        Some("k")
    );
    assert_eq!(
        c.model_gateways["m"].tls.ca_cert_file,
        Some(conf.join("ca.pem"))
    );
}

#[test]
fn the_redacted_yaml_shows_resolved_values() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "model_gateways:\n  m: {url: 'http://127.0.0.1:8000', request_timeout: 90s}\n",
    );
    let yaml = load_file(&file).unwrap().to_redacted_yaml();
    for expected in [
        "dispatch_mode: sync",
        "result_poll_timeout: 5s",
        "request_timeout: 1m 30s",
        "tls_insecure_skip_verify: false",
        "queue_prefix: llm-d-async",
        "max_file_bytes: 209715200",
    ] {
        assert!(
            yaml.contains(expected),
            "{expected:?} missing from:\n{yaml}"
        );
    }
}

#[test]
fn dispatcher_queues_follow_the_pools() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "redis-url", "redis://127.0.0.1:7000");
    let file = write(
        dir.path(),
        "processor.yaml",
        r#"
dispatch_mode: async
redis_url_file: redis-url
model_gateways:
  mistral: {inference_pool_name: pool-b}
  llama-3: {url: "http://127.0.0.1:8001/", inference_pool_name: pool-a}
  a-first: {inference_pool_name: pool-a}
"#,
    );
    let c = load_file(&file).unwrap();
    assert_eq!(c.pools()["pool-a"], ["a-first", "llama-3"]);
    let q = c.dispatcher_queues().unwrap();
    assert_eq!(q.pools.len(), 2);
    assert_eq!(q.pools[0].request_queue_name, "llm-d-async:requests:pool-a");
    assert_eq!(
        q.pools[0].result_queue_name,
        "llm-d-async:results:pool-a:$batch"
    );
    assert_eq!(q.pools[1].models, ["mistral"]);
    assert_eq!(
        q.result_queue_name.as_deref(),
        Some("llm-d-async:results:pool-a:$batch")
    );

    let json: serde_json::Value = serde_json::from_str(&q.queues_config_json()).unwrap();
    let expected = serde_json::json!([
        {"queue_name": "llm-d-async:requests:pool-a", "igw_base_url": "http://127.0.0.1:8001",
         "request_path_url": "/v1/chat/completions", "gate_type": "prometheus-budget",
         "gate_params": {"pool": "pool-a", "max_concurrency": "100", "baseline": "0.25"}},
        {"queue_name": "llm-d-async:requests:pool-b", "igw_base_url": "http://CHANGE-ME",
         "request_path_url": "/v1/chat/completions", "gate_type": "prometheus-budget",
         "gate_params": {"pool": "pool-b", "max_concurrency": "100", "baseline": "0.25"}}
    ]);
    assert_eq!(json, expected);

    // v0.10: the same entries inside the transport object, with our pacing (the dispatcher's
    // batch size while the pool is not sized) and no Redis URL (it may hold a password).
    let transport: serde_json::Value =
        serde_json::from_str(&q.transport_config().to_json()).unwrap();
    assert_eq!(
        transport,
        serde_json::json!({
            "retry_queue_name": "retry-sortedset",
            "result_queue_name": "llm-d-async:results:pool-a:$batch",
            "poll_interval_ms": 200, "batch_size": 10, "enable_tracing": false,
            "queues": expected,
        })
    );
    assert!(!q.transport_config().to_json().contains("7000"));
    // Unsized, the gate closes only at 75 running per pod: said, naming the setting.
    assert_eq!(q.sizing.concurrency, 64);
    assert!(
        q.sizing.warnings.iter().any(|w| w.contains("max_num_seqs")),
        "{:?}",
        q.sizing.warnings
    );
}

/// An async config in `dir` of model `a` on pool-a and `b` on pool-b, with `dispatcher` (indented
/// YAML) as `async_dispatch.dispatcher`: the file and what loading it gives.
fn load_two_pools(
    dir: &Path,
    dispatcher: &str,
) -> (PathBuf, Result<ProcessorConfig, ConfigErrors>) {
    write(dir, "redis-url", "redis://127.0.0.1:6379");
    let file = write(
        dir,
        "processor.yaml",
        &format!(
            "dispatch_mode: async\nredis_url_file: redis-url\nmodel_gateways:\n  a: {{inference_pool_name: pool-a}}\n  b: {{inference_pool_name: pool-b}}\nasync_dispatch:\n  dispatcher:\n{dispatcher}"
        ),
    );
    let loaded = load_file(&file);
    (file, loaded)
}

/// `async_dispatch.dispatcher`: the gate and pacing sized from the pool (`max_num_seqs`, `pods`,
/// `headroom`), each explicit setting winning over what would be derived.
#[test]
fn the_dispatchers_gate_is_sized_from_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let load = |dispatcher: &str| load_two_pools(dir.path(), dispatcher).1;
    let q = load("    max_num_seqs: 16\n    pods: 2\n")
        .unwrap()
        .dispatcher_queues()
        .unwrap();
    let s = &q.sizing;
    let b = &s.pools["pool-b"];
    assert_eq!((b.pods, b.max_concurrency, b.baseline), (2, 16, 0.25));
    assert_eq!(s.pools["pool-a"], *b);
    // A full budget fills the pool's 2 × 16 slots in one poll; the workers stop at 12 per pod.
    assert_eq!((s.batch_size, s.concurrency), (32, 2 * 2 * 12));
    assert_eq!(
        (s.poll_interval_ms, s.prometheus_cache_ttl.as_str()),
        (200, "1s")
    );
    assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    let params = &q.queues_config[1].gate_params;
    assert_eq!(params["pool"], "pool-b");
    assert_eq!(params["max_concurrency"], "16");
    assert_eq!(params["baseline"], "0.25");
    let v09 = q.command_v0_9("queues.json");
    for flag in [
        "--redis.ss.poll-interval-ms 200",
        "--redis.ss.batch-size 32",
        "--concurrency 48",
        "--prometheus-cache-ttl 1s",
    ] {
        assert!(v09.contains(flag), "{flag} missing from {v09}");
    }
    assert!(q.command_v0_10("t.json").contains("--concurrency 48"));
    let needs = q.prometheus_requirements().join("\n");
    assert!(needs.contains("inference_pool_ready_pods"), "{needs}");
    assert!(needs.contains("vllm:num_requests_running"), "{needs}");

    // Explicit settings win; a gate that cannot close (running never passes 16) is said.
    let q = load(
        "    max_num_seqs: 16\n    max_concurrency: 40\n    baseline: 0.1\n    batch_size: 5\n    concurrency: 7\n    poll_interval: 50ms\n    prometheus_cache_ttl: 500ms\n",
    )
    .unwrap()
    .dispatcher_queues()
    .unwrap();
    let s = &q.sizing;
    let a = &s.pools["pool-a"];
    assert_eq!(
        (a.max_concurrency, a.baseline, s.batch_size, s.concurrency),
        (40, 0.1, 5, 7)
    );
    assert_eq!(
        (s.poll_interval_ms, s.prometheus_cache_ttl.as_str()),
        (50, "500ms")
    );
    assert!(
        s.warnings.iter().any(|w| w.contains("can never close")),
        "{:?}",
        s.warnings
    );

    // A local-max-concurrency gate gets its limit from the same sizing: 12 per pod.
    let q = load("    gate_type: local-max-concurrency\n    max_num_seqs: 16\n")
        .unwrap()
        .dispatcher_queues()
        .unwrap();
    assert_eq!(
        q.queues_config[0].gate_params,
        [("limit".to_owned(), "12".to_owned())].into()
    );
    assert!(!q.needs_prometheus());

    // With the pods' pages known, each pool's gate reads them itself: endpoint-scrape for one
    // pod, composite over several; no Prometheus, and readings as fresh as the poll.
    let q = load(
        "    max_num_seqs: 16\n    metrics_urls:\n      pool-a: [\"http://a0:8000/metrics\"]\n      pool-b: [\"http://b0:8000/metrics\", \"http://b1:8000/metrics\"]\n",
    )
    .unwrap()
    .dispatcher_queues()
    .unwrap();
    assert!(!q.needs_prometheus() && q.reads_load());
    assert!(q.sizing.warnings.is_empty(), "{:?}", q.sizing.warnings);
    assert_eq!(q.sizing.prometheus_cache_ttl, "200ms");
    // Pool a (one pod): its running gate and its waiting gate, in a composite.
    let gates_of = |i: usize| -> serde_json::Value {
        let entry = &q.queues_config[i];
        assert_eq!(entry.gate_type, "composite");
        serde_json::from_str(&entry.gate_params["gates"]).unwrap()
    };
    let a = gates_of(0);
    assert_eq!(
        a,
        serde_json::json!([
            {"gate_type": "endpoint-scrape", "gate_params": {"url": "http://a0:8000/metrics",
             "metric": "vllm:num_requests_running", "max_count_per_pod": "16", "baseline": "0.25"}},
            {"gate_type": "endpoint-scrape", "gate_params": {"url": "http://a0:8000/metrics",
             "metric": "vllm:num_requests_waiting", "max_count_per_pod": "1", "baseline": "0"}},
        ])
    );
    // Pool b (two pods): both gates of each.
    let b = gates_of(1);
    assert_eq!(b.as_array().unwrap().len(), 4);
    assert_eq!(b[2]["gate_params"]["url"], "http://b1:8000/metrics");
    assert_eq!(b[3]["gate_params"]["metric"], "vllm:num_requests_waiting");
    let v10 = q.command_v0_10("t.json");
    assert!(!v10.contains("--prometheus-url"), "{v10}");
    assert!(v10.contains("--prometheus-cache-ttl 200ms"), "{v10}");
    // Without the waiting gate, one pod's gate is a plain endpoint-scrape.
    let q = load(
        "    max_num_seqs: 16\n    waiting_gate: false\n    metrics_urls:\n      pool-a: [\"http://a0:8000/metrics\"]\n      pool-b: [\"http://b0:8000/metrics\"]\n",
    )
    .unwrap()
    .dispatcher_queues()
    .unwrap();
    let a = &q.queues_config[0];
    assert_eq!(a.gate_type, "endpoint-scrape");
    assert_eq!(a.gate_params["url"], "http://a0:8000/metrics");
    assert_eq!(a.gate_params["max_count_per_pod"], "16");

    // A pool left out of metrics_urls keeps the Prometheus gate, said.
    let q = load("    metrics_urls:\n      pool-a: [\"http://a0:8000/metrics\"]\n")
        .unwrap()
        .dispatcher_queues()
        .unwrap();
    assert_eq!(q.queues_config[1].gate_type, "prometheus-budget");
    assert!(q.needs_prometheus());
    assert!(
        q.sizing
            .warnings
            .iter()
            .any(|w| w.contains("pool pool-b has no metrics_urls")),
        "{:?}",
        q.sizing.warnings
    );

    // Bad values are named with their field.
    let err = load(
        "    headroom: 1.5\n    pods: 0\n    baseline: 1\n    gate: x\n    metrics_urls:\n      pool-a: [\"ftp://x\"]\n",
    )
    .unwrap_err()
    .to_string();
    for field in [
        "headroom",
        "pods",
        "baseline",
        "gate",
        "metrics_urls.pool-a",
    ] {
        assert!(
            err.contains(&format!("async_dispatch.dispatcher.{field}")),
            "{field}: {err}"
        );
    }
}

/// `async_dispatch.dispatcher.pools`: each pool's own facts over the dispatcher's; each gate is
/// sized from its pool, the dispatcher-wide workers and batch size from all of them.
#[test]
fn each_pool_can_have_its_own_gate() {
    let dir = tempfile::tempdir().unwrap();
    let load = |dispatcher: &str| load_two_pools(dir.path(), dispatcher);
    // pool-a: 2 pods of 16 (the dispatcher's keys); pool-b: 1 pod of 64, headroom 0.2.
    let (_, config) = load(
        "    max_num_seqs: 16\n    pods: 2\n    pools:\n      pool-b: {max_num_seqs: 64, pods: 1, headroom: 0.2}\n",
    );
    let q = config.unwrap().dispatcher_queues().unwrap();
    let s = &q.sizing;
    let (a, b) = (&s.pools["pool-a"], &s.pools["pool-b"]);
    assert_eq!((a.pods, a.max_concurrency, a.baseline), (2, 16, 0.25));
    assert_eq!((b.pods, b.max_concurrency, b.baseline), (1, 64, 0.2));
    assert_eq!((a.closes_at(), b.closes_at()), (12.0, 51.2));
    // Workers: 2 × 12 + 1 × ⌊64 × 0.8⌋; a poll never brings more than the smaller pool's 32.
    assert_eq!((s.concurrency, s.batch_size), (24 + 51, 32));
    assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    let params = |i: usize| {
        let p = &q.queues_config[i].gate_params;
        (
            p["pool"].clone(),
            p["max_concurrency"].clone(),
            p["baseline"].clone(),
        )
    };
    assert_eq!(params(0), ("pool-a".into(), "16".into(), "0.25".into()));
    assert_eq!(params(1), ("pool-b".into(), "64".into(), "0.2".into()));
    assert!(q.command_v0_10("t.json").contains("--concurrency 75"));
    assert_eq!(q.transport_config().batch_size, 32);

    // A pool's explicit gate params win over its facts, and the pods' gate takes them too.
    let (_, config) = load(
        "    max_num_seqs: 16\n    metrics_urls:\n      pool-b: [\"http://b0:8000/metrics\"]\n    pools:\n      pool-b: {max_num_seqs: 64, max_concurrency: 32, baseline: 0.5}\n",
    );
    let q = config.unwrap().dispatcher_queues().unwrap();
    let gates: serde_json::Value =
        serde_json::from_str(&q.queues_config[1].gate_params["gates"]).unwrap();
    assert_eq!(gates[0]["gate_params"]["max_count_per_pod"], "32");
    assert_eq!(gates[0]["gate_params"]["baseline"], "0.5");
    // 1 × 12 + 1 × ⌊32 × 0.5⌋.
    assert_eq!(q.sizing.concurrency, 12 + 16);

    // Warnings stay per pool: only pool-b, sized nowhere, is unsized; the workers can then not
    // be derived, but the batch size still comes from the sized pool.
    let (_, config) = load("    pools:\n      pool-a: {max_num_seqs: 16}\n");
    let s = config.unwrap().dispatcher_queues().unwrap().sizing;
    assert_eq!((s.concurrency, s.batch_size), (64, 16));
    assert_eq!(s.warnings.len(), 1, "{:?}", s.warnings);
    assert!(
        s.warnings[0].starts_with("pool pool-b: max_num_seqs is not set")
            && s.warnings[0].contains("pools.pool-b.max_num_seqs"),
        "{:?}",
        s.warnings
    );
    let (_, config) =
        load("    max_num_seqs: 16\n    pools:\n      pool-b: {max_concurrency: 40}\n");
    let s = config.unwrap().dispatcher_queues().unwrap().sizing;
    assert_eq!(s.warnings.len(), 1, "{:?}", s.warnings);
    assert!(
        s.warnings[0].starts_with("pool pool-b: the gate can never close"),
        "{:?}",
        s.warnings
    );

    // A pool no model serves, a bad value and an unknown key: each named with its field and file.
    let (file, config) = load(
        "    pools:\n      pool-x: {pods: 2}\n      pool-a: {headroom: 1, podz: 1}\n      pool-b: {baseline: 1}\n",
    );
    let errors: Vec<String> = config
        .unwrap_err()
        .errors
        .iter()
        .map(ToString::to_string)
        .collect();
    let f = file.display();
    for expected in [
        format!("{f}: async_dispatch.dispatcher.pools.pool-x: no model has inference_pool_name pool-x (the models' pools: pool-a, pool-b)"),
        format!("{f}: async_dispatch.dispatcher.pools.pool-a.headroom: must be in [0, 1), got 1"),
        format!("{f}: async_dispatch.dispatcher.pools.pool-a.podz: unknown key (did you mean pods?)"),
        format!("{f}: async_dispatch.dispatcher.pools.pool-b.baseline: must be in [0, 1) (at 1 the gate never opens), got 1"),
    ] {
        assert!(errors.contains(&expected), "{expected}\nnot in {errors:#?}");
    }
    assert_eq!(errors.len(), 4, "{errors:#?}");
}

#[test]
fn load_refuses_duplicate_keys_and_non_mappings() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file(
            "dup.yaml",
            "model_gateways:\n  m: {url: 'http://127.0.0.1:1'}\n  m: {url: 'http://127.0.0.1:2'}\n",
        )?;
        let errors = ProcessorConfig::load(Path::new("dup.yaml"))
            .unwrap_err()
            .to_string();
        assert!(
            errors.starts_with(
                "dup.yaml: invalid YAML: model_gateways: duplicate entry with key \"m\""
            ),
            "{errors}"
        );

        jail.create_file("list.yaml", "- a\n- b\n")?;
        let errors = ProcessorConfig::load(Path::new("list.yaml"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            errors,
            "list.yaml: expected a mapping of settings (key: value) at the top level"
        );
        Ok(())
    });
}

/// An async config with `url` in its redis-url file and `extra` appended.
fn async_with_redis(dir: &Path, url: &str, extra: &str) -> PathBuf {
    write(dir, "redis-url", &format!("{url}\n"));
    write(
        dir,
        "processor.yaml",
        &format!(
            "dispatch_mode: async\nredis_url_file: redis-url\nmodel_gateways:\n  m: {{inference_pool_name: p}}\n{extra}"
        ),
    )
}

#[test]
fn every_redis_url_form_the_client_takes_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    for url in [
        "redis://127.0.0.1:6379/0",
        "redis://batch:pw@redis.internal:6379",
        "redis://:pw@redis.internal",
        "rediss://batch:pw@redis.internal:6380/1",
        "redis-cluster://10.0.0.1:7000?node=10.0.0.2:7000&node=10.0.0.3:7000",
        "rediss-cluster://:pw@10.0.0.1:7000",
        "redis-sentinel://10.0.0.1:26379/0?sentinelServiceName=main&node=10.0.0.2:26379",
        "rediss-sentinel://batch:pw@10.0.0.1?sentinelServiceName=main&sentinelPassword=x",
    ] {
        let file = async_with_redis(dir.path(), url, "");
        let c = load_file(&file).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(c.redis_url.as_ref().map(Secret::expose), Some(url));
        assert_eq!(c.redis_tls, None);
    }
}

#[test]
fn redis_urls_the_client_refuses_are_config_errors_without_the_password() {
    let dir = tempfile::tempdir().unwrap();
    for (url, expected) in [
        ("unix:///run/redis.sock", "unsupported scheme"),
        (
            "redis-sentinel://:s3cret@h:26379",
            "needs ?sentinelServiceName",
        ),
        ("redis://:s3cret@h?node=h:2", "unknown query parameter"),
        ("redis-cluster://:s3cret@h:7000/2", "only database 0"),
        ("redis://s3cret@h", "no password"),
    ] {
        let file = async_with_redis(dir.path(), url, "");
        let errors = errors_of(&file);
        assert_one_error(&errors, "redis_url_file: ");
        assert!(errors[0].contains(expected), "{url}: {errors:?}");
        assert!(
            errors[0].contains("does not hold a Redis URL"),
            "{errors:?}"
        );
        assert!(!errors[0].contains("s3cret"), "{errors:?}");
    }
}

#[test]
fn redis_tls_resolves_relative_paths_and_is_shown() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    fs::create_dir_all(d.join("tls")).unwrap();
    let pki = batch_testkit::TestPki::generate(&d.join("tls"));
    let file = async_with_redis(
        d,
        "rediss://:pw@127.0.0.1:6380",
        "redis_tls:\n  ca_file: tls/ca.pem\n  cert_file: tls/client.pem\n  key_file: tls/client.key\n  server_name: redis.internal\n",
    );
    let c = load_file(&file).unwrap();
    let tls = c.redis_tls.clone().unwrap();
    assert_eq!(tls.ca_file, Some(d.join("tls/ca.pem")));
    assert_eq!(tls.ca_file.as_deref(), Some(pki.ca.as_path()));
    assert_eq!(tls.cert_file, Some(d.join("tls/client.pem")));
    assert_eq!(tls.key_file, Some(d.join("tls/client.key")));
    assert_eq!(tls.server_name.as_deref(), Some("redis.internal"));
    let options = c.redis_connect_options();
    assert_eq!(options.tls, Some(tls.to_options()));

    let yaml = c.to_redacted_yaml();
    assert!(yaml.contains("redis_tls:"), "{yaml}");
    assert!(
        yaml.contains(&format!("ca_file: {}", d.join("tls/ca.pem").display())),
        "{yaml}"
    );
    assert!(yaml.contains("server_name: redis.internal"), "{yaml}");
    assert!(!yaml.contains(":pw@"), "{yaml}");

    // A TLS URL without redis_tls is fine: the system's roots.
    let file = async_with_redis(d, "rediss://127.0.0.1:6380", "");
    let c = load_file(&file).unwrap();
    assert_eq!(c.redis_tls, None);
    assert_eq!(c.redis_connect_options().tls, None);
}

#[test]
fn redis_tls_files_must_be_readable_and_named() {
    let dir = tempfile::tempdir().unwrap();
    let file = async_with_redis(
        dir.path(),
        "rediss://127.0.0.1:6380",
        "redis_tls:\n  ca_file: missing/ca.pem\n",
    );
    let errors = errors_of(&file);
    assert_one_error(&errors, "redis_tls.ca_file: cannot read ");
    assert!(
        errors[0].contains(&dir.path().join("missing/ca.pem").display().to_string()),
        "{errors:?}"
    );
}

#[test]
fn redis_tls_cert_and_key_go_together() {
    let dir = tempfile::tempdir().unwrap();
    let pki = batch_testkit::TestPki::generate(dir.path());
    let file = async_with_redis(
        dir.path(),
        "rediss://127.0.0.1:6380",
        &format!("redis_tls:\n  cert_file: {}\n", pki.client_cert.display()),
    );
    assert_one_error(&errors_of(&file), "redis_tls.cert_file: set key_file too");
    let file = async_with_redis(
        dir.path(),
        "rediss://127.0.0.1:6380",
        &format!("redis_tls:\n  key_file: {}\n", pki.client_key.display()),
    );
    assert_one_error(&errors_of(&file), "redis_tls.key_file: set cert_file too");
}

#[test]
fn redis_tls_with_a_plaintext_url_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let pki = batch_testkit::TestPki::generate(dir.path());
    for url in [
        "redis://127.0.0.1:6379",
        "redis-cluster://127.0.0.1:7000",
        "redis-sentinel://127.0.0.1?sentinelServiceName=m",
    ] {
        let file = async_with_redis(
            dir.path(),
            url,
            &format!("redis_tls:\n  ca_file: {}\n", pki.ca.display()),
        );
        assert_one_error(
            &errors_of(&file),
            "redis_tls: redis_tls is set but the URL in redis_url_file is not rediss://",
        );
    }
}

#[test]
fn redis_tls_files_are_checked_as_connecting_would() {
    let dir = tempfile::tempdir().unwrap();
    let pki = batch_testkit::TestPki::generate(dir.path());
    write(dir.path(), "not-a-cert.pem", "just text\n");
    let file = async_with_redis(
        dir.path(),
        "rediss://127.0.0.1:6380",
        "redis_tls:\n  ca_file: not-a-cert.pem\n",
    );
    let errors = errors_of(&file);
    assert_one_error(&errors, "redis_tls: ca_file ");
    assert!(errors[0].contains("no PEM certificate"), "{errors:?}");

    // A certificate where the key belongs.
    let file = async_with_redis(
        dir.path(),
        "rediss://127.0.0.1:6380",
        &format!(
            "redis_tls:\n  cert_file: {}\n  key_file: {}\n",
            pki.client_cert.display(),
            pki.client_cert.display()
        ),
    );
    assert_one_error(&errors_of(&file), "redis_tls: key_file ");

    let file = async_with_redis(
        dir.path(),
        "rediss://127.0.0.1:6380",
        "redis_tls:\n  server_name: 'not a name'\n",
    );
    assert_one_error(
        &errors_of(&file),
        "server_name \"not a name\" is not a valid",
    );

    let file = async_with_redis(
        dir.path(),
        "rediss://127.0.0.1:6380",
        "redis_tls:\n  ca_fil: x\n",
    );
    assert_one_error(
        &errors_of(&file),
        "redis_tls.ca_fil: unknown key (did you mean ca_file?)",
    );
}

#[test]
fn the_async_example_documents_every_redis_url_form_and_redis_tls() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let example = fs::read_to_string(root.join("examples/config/async.yaml")).unwrap();
    let readme = fs::read_to_string(root.join("README.md")).unwrap();
    for form in [
        "redis://",
        "rediss://",
        "redis-cluster://",
        "rediss-cluster://",
        "redis-sentinel://",
        "rediss-sentinel://",
        "sentinelServiceName=",
        "node=host:port",
    ] {
        assert!(example.contains(form), "async.yaml lacks {form}");
        assert!(readme.contains(form), "README.md lacks {form}");
    }
    for key in [
        "redis_tls:",
        "ca_file:",
        "cert_file:",
        "key_file:",
        "server_name:",
    ] {
        assert!(example.contains(key), "async.yaml lacks {key}");
        assert!(readme.contains(key), "README.md lacks {key}");
    }
}

/// A `processor serve` config around `serve`, with a Redis URL file (never connected to).
fn service_config(dir: &Path, serve: &str) -> PathBuf {
    write(dir, "redis-url", "redis://127.0.0.1:1\n");
    write(
        dir,
        "processor.yaml",
        &format!(
            "redis_url_file: redis-url\nmodel_gateways:\n  m: {{url: 'http://127.0.0.1:8000'}}\nserve:\n{serve}"
        ),
    )
}

fn load_service_file(path: &Path) -> Result<ProcessorConfig, ConfigErrors> {
    ProcessorConfig::service_from_figment(Figment::from(Yaml::file_exact(path)))
}

#[test]
fn the_service_reads_redis_in_sync_mode_and_its_keys() {
    let dir = tempfile::tempdir().unwrap();
    let url = write(dir.path(), "redis-url", "redis://127.0.0.1:7000\n");
    let keys = write(
        dir.path(),
        "keys",
        "# tenants\nsk-aaa alice\n\nsk-bbb bob  # second\n",
    );
    let file = write(
        dir.path(),
        "processor.yaml",
        &format!(
            "model_gateways:\n  m:\n    url: http://127.0.0.1:8000\nredis_url_file: {}\nwork_dir: /var/w\nserve:\n  listen: 127.0.0.1:9000\n  api_keys_file: {}\n  max_active_jobs: 3\n  reaper_interval: 2s\n",
            url.display(),
            keys.display()
        ),
    );
    let run = load_file(&file).unwrap();
    assert_eq!(
        run.redis_url, None,
        "processor run in sync mode needs no Redis"
    );
    assert!(run.serve.api_keys.is_empty(), "only the service reads keys");

    let c = load_service_file(&file).unwrap();
    assert_eq!(
        c.redis_url.as_ref().map(Secret::expose),
        Some("redis://127.0.0.1:7000")
    );
    assert_eq!(c.serve.listen.to_string(), "127.0.0.1:9000");
    assert_eq!(c.serve.max_active_jobs, 3);
    assert_eq!(c.serve.reaper_interval, Duration::from_secs(2));
    assert_eq!(c.serve.storage, "file:///var/w/storage");
    assert_eq!(c.serve.state_prefix, "batch-processor");
    let tenants: Vec<(&str, &str)> = c
        .serve
        .api_keys
        .iter()
        .map(|k| (k.key.expose(), k.tenant.as_str()))
        .collect();
    assert_eq!(tenants, [("sk-aaa", "alice"), ("sk-bbb", "bob")]);
    let printed = format!("{c:?}");
    assert!(!printed.contains("sk-aaa"), "a key leaked: {printed}");
}

#[test]
fn bad_service_settings_name_field_and_line_never_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let url = write(dir.path(), "redis-url", "redis://127.0.0.1:7000\n");
    let keys = write(
        dir.path(),
        "keys",
        "sk-secret-1 alice extra\nsk-secret-2 bad:tenant\n",
    );
    let file = write(
        dir.path(),
        "processor.yaml",
        &format!(
            "redis_url_file: {}\nserve:\n  api_keys_file: {}\n  storage: file://relative\n  max_active_jobs: 0\n",
            url.display(),
            keys.display()
        ),
    );
    let errors: Vec<String> = match load_service_file(&file) {
        Ok(c) => panic!("accepted: {c:?}"),
        Err(e) => e.errors.iter().map(ToString::to_string).collect(),
    };
    let all = errors.join("\n");
    assert!(
        all.contains("serve.api_keys_file") && all.contains("line 1"),
        "{all}"
    );
    assert!(all.contains("line 2"), "{all}");
    assert!(all.contains("serve.storage"), "{all}");
    assert!(all.contains("serve.max_active_jobs"), "{all}");
    assert!(!all.contains("sk-secret"), "a key leaked: {all}");

    let missing = write(
        dir.path(),
        "p2.yaml",
        "serve:\n  api_keys_file: /nonexistent/keys\n",
    );
    let errors: Vec<String> = match load_service_file(&missing) {
        Ok(c) => panic!("accepted: {c:?}"),
        Err(e) => e.errors.iter().map(ToString::to_string).collect(),
    };
    let all = errors.join("\n");
    assert!(all.contains("/nonexistent/keys"), "{all}");
    assert!(
        all.contains("redis_url_file"),
        "the service needs Redis: {all}"
    );
}

#[test]
fn serve_storage_in_s3_with_its_settings_validates() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "keys/id", "AKIDEXAMPLE\n");
    write(dir.path(), "keys/secret", "s3-secret-value\n");
    let file = service_config(
        dir.path(),
        "  storage: s3://batch-files/prod/a\n  s3:\n    endpoint: http://127.0.0.1:9000\n    allow_http: true\n    region: eu-west-1\n    profile: batch\n    access_key_id_file: keys/id\n    secret_access_key_file: keys/secret\n",
    );
    let c = load_service_file(&file).unwrap();
    assert_eq!(c.serve.storage, "s3://batch-files/prod/a");
    let s3 = &c.serve.s3;
    assert_eq!(s3.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
    assert_eq!(s3.allow_http, Some(true));
    assert_eq!(s3.region.as_deref(), Some("eu-west-1"));
    assert_eq!(s3.profile.as_deref(), Some("batch"));
    assert_eq!(
        s3.secret_access_key_file.as_deref(),
        Some(dir.path().join("keys/secret").as_path())
    );
    assert_eq!(s3.access_key_id.as_ref().unwrap().expose(), "AKIDEXAMPLE");
    assert_eq!(
        s3.secret_access_key.as_ref().unwrap().expose(),
        "s3-secret-value"
    );
    let shown = format!("{:?}\n{}", c, c.to_redacted_yaml());
    assert!(!shown.contains("s3-secret-value"), "{shown}");
    assert!(shown.contains("endpoint: http://127.0.0.1:9000"), "{shown}");

    // Without settings: all is left to the AWS environment and files.
    let dir = tempfile::tempdir().unwrap();
    let file = service_config(dir.path(), "  storage: s3://batch-files\n");
    let c = load_service_file(&file).unwrap();
    assert_eq!(c.serve.storage, "s3://batch-files");
    assert_eq!(c.serve.s3, batch_config::S3Config::default());
}

#[test]
fn bad_s3_settings_are_named() {
    for (serve, expected) in [
        ("  storage: s3:///prefix\n", "expected s3://bucket[/prefix]"),
        (
            "  s3:\n    endpoint: http://127.0.0.1:9000\n",
            "also needs allow_http: true",
        ),
        (
            "  s3:\n    endpoint: http://127.0.0.1:9000\n    allow_http: false\n",
            "also needs allow_http: true",
        ),
        ("  s3:\n    endpoint: ftp://h\n", "expected an http:// or https://"),
        (
            "  s3:\n    endpoint: 'https://id:pw-secret@h'\n",
            "no credentials or query",
        ),
        ("  s3:\n    allow_http: maybe\n", "expected true or false"),
        (
            "  s3:\n    access_key_id_file: id\n",
            "access_key_id_file and secret_access_key_file go together",
        ),
        (
            "  s3:\n    secret_access_key_file: /nonexistent/secret\n    access_key_id_file: /nonexistent/id\n",
            "cannot read secret file /nonexistent/id",
        ),
        ("  s3:\n    bucket: b\n", "bucket"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let file = service_config(dir.path(), serve);
        let errors = match load_service_file(&file) {
            Ok(c) => panic!("accepted {serve:?}: {c:?}"),
            Err(errors) => errors.errors.iter().map(ToString::to_string).collect::<Vec<_>>(),
        };
        assert!(
            errors.iter().any(|e| e.contains(expected)),
            "{serve:?}: {errors:#?} lack {expected:?}"
        );
        assert!(
            !errors.iter().any(|e| e.contains("pw-secret")),
            "{errors:#?}"
        );
    }
}

#[test]
fn serve_edge_limits_have_defaults_and_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let file = service_config(dir.path(), "  listen: 127.0.0.1:9000\n");
    let c = load_service_file(&file).unwrap();
    assert_eq!(c.serve.header_read_timeout, Duration::from_secs(10));
    assert_eq!(c.serve.idle_timeout, Duration::from_secs(60));
    assert_eq!(c.serve.max_connections, None);
    assert_eq!(c.serve.first_request_timeout, Duration::from_secs(3));
    // The ceiling follows the open-file limit, within bounds; one address holds 256 unless a
    // proxy is in front (`tenant_header`), when every client comes from its few addresses.
    assert_eq!(c.serve.connection_ceiling(1_048_576), 8_192);
    assert_eq!(c.serve.connection_ceiling(5_000), 3_976);
    assert_eq!(c.serve.connection_ceiling(1_024), 256);
    assert_eq!(c.serve.connections_per_peer(), 256);
    let proxied = service_config(dir.path(), "  tenant_header: X-User\n");
    assert_eq!(
        load_service_file(&proxied)
            .unwrap()
            .serve
            .connections_per_peer(),
        0
    );
    assert_eq!(c.serve.max_json_body_bytes, 1 << 20);
    assert_eq!(c.serve.max_form_field_bytes, 64 << 10);
    assert_eq!(c.serve.max_filename_bytes, 255);
    assert_eq!(c.serve.max_id_bytes, 128);

    let file = service_config(
        dir.path(),
        "  header_read_timeout: 500ms\n  idle_timeout: 2m\n  max_connections: 50\n  max_json_body_bytes: 64KiB\n  max_form_field_bytes: 1KiB\n  max_filename_bytes: 100\n  max_id_bytes: 64\n  first_request_timeout: 1s\n  max_connections_per_peer: 0\n",
    );
    let c = load_service_file(&file).unwrap();
    assert_eq!(c.serve.header_read_timeout, Duration::from_millis(500));
    assert_eq!(c.serve.idle_timeout, Duration::from_secs(120));
    assert_eq!(c.serve.max_connections, Some(50));
    assert_eq!(c.serve.connection_ceiling(1_048_576), 50);
    assert_eq!(c.serve.first_request_timeout, Duration::from_secs(1));
    assert_eq!(c.serve.connections_per_peer(), 0);
    assert_eq!(c.serve.max_json_body_bytes, 64 << 10);
    assert_eq!(c.serve.max_form_field_bytes, 1 << 10);
    assert_eq!(c.serve.max_filename_bytes, 100);
    assert_eq!(c.serve.max_id_bytes, 64);

    let file = service_config(
        dir.path(),
        "  header_read_timeout: 2h\n  idle_timeout: 0s\n  max_connections: 0\n  max_json_body_bytes: 2GiB\n  max_filename_bytes: 99999999999\n  max_id_bytes: 8\n  first_request_timeout: 0s\n  max_connections_per_peer: -1\n",
    );
    let errors: Vec<String> = match load_service_file(&file) {
        Ok(c) => panic!("accepted: {c:?}"),
        Err(e) => e.errors.iter().map(ToString::to_string).collect(),
    };
    let all = errors.join("\n");
    for field in [
        "serve.header_read_timeout",
        "serve.idle_timeout",
        "serve.max_connections",
        "serve.first_request_timeout",
        "serve.max_connections_per_peer",
        "serve.max_json_body_bytes",
        "serve.max_filename_bytes",
        "serve.max_id_bytes",
    ] {
        assert!(all.contains(field), "no error for {field}: {all}");
    }
    assert!(all.contains("at most 1h"), "{all}");

    // Every duration of the config is bounded, and the count of jobs.
    let file = service_config(
        dir.path(),
        "  lease_ttl: 9223372036854775807s
  reaper_interval: 400d
  max_active_jobs: 99999999
",
    );
    let errors: Vec<String> = match load_service_file(&file) {
        Ok(c) => panic!("accepted: {c:?}"),
        Err(e) => e.errors.iter().map(ToString::to_string).collect(),
    };
    let all = errors.join("\n");
    for field in [
        "serve.lease_ttl",
        "serve.reaper_interval",
        "serve.max_active_jobs",
    ] {
        assert!(all.contains(field), "no error for {field}: {all}");
    }
}

#[test]
fn a_byte_order_mark_does_not_hide_the_first_key_and_odd_tenants_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "keys",
        "\u{feff}sk-first alice\nsk-second bob.team_2\n",
    );
    let file = service_config(dir.path(), "  api_keys_file: keys\n");
    let c = load_service_file(&file).unwrap();
    let keys: Vec<(&str, &str)> = c
        .serve
        .api_keys
        .iter()
        .map(|k| (k.key.expose(), k.tenant.as_str()))
        .collect();
    assert_eq!(keys, [("sk-first", "alice"), ("sk-second", "bob.team_2")]);

    for tenant in [
        "a*",
        "b?",
        "c[1]",
        "d..e",
        "..",
        "f/g",
        ".hidden",
        &"t".repeat(65),
    ] {
        write(dir.path(), "keys", &format!("sk-x {tenant}\n"));
        let errors: Vec<String> = match load_service_file(&file) {
            Ok(c) => panic!("tenant {tenant:?} accepted: {:?}", c.serve.api_keys),
            Err(e) => e.errors.iter().map(ToString::to_string).collect(),
        };
        let all = errors.join("\n");
        assert!(
            all.contains("serve.api_keys_file") && all.contains("line 1"),
            "{all}"
        );
        assert!(!all.contains("sk-x"), "a key leaked: {all}");
    }
}

#[test]
fn tenant_header_pass_through_headers_and_webhooks_are_read_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let file = service_config(
        dir.path(),
        "  tenant_header: X-MaaS-Username\n  pass_through_headers: [X-Gateway-Inference-Fairness-Id, baggage]\n  webhooks:\n    allowed_hosts: [Hooks.Example.com, '*.corp.example', 10.0.0.0/8]\n    retry_initial_backoff: 1s\n",
    );
    let c = load_service_file(&file).unwrap();
    assert_eq!(c.serve.tenant_header.as_deref(), Some("x-maas-username"));
    assert_eq!(
        c.serve.pass_through_headers,
        ["x-gateway-inference-fairness-id", "baggage"]
    );
    let w = &c.serve.webhooks;
    assert!(!w.allow_http);
    assert_eq!(w.give_up_after, std::time::Duration::from_secs(25 * 3600));
    assert_eq!(w.max_endpoints_per_tenant, 16);
    assert!(w.check_url("https://hooks.example.com/x").is_ok());
    assert!(w.check_url("https://a.corp.example/x").is_ok());
    assert!(w.check_url("https://10.1.2.3/x").is_ok());
    for (url, rule) in [
        ("http://hooks.example.com/x", "allow_http"),
        ("https://corp.example/x", "allowed_hosts"),
        ("https://11.0.0.1/x", "allowed_hosts"),
        ("https://hooks.example.com.evil.org/x", "allowed_hosts"),
        ("https://u:p@hooks.example.com/x", "credentials"),
        ("https://hooks.example.com:6379/x", "allowed_ports"),
        ("https://10.1.2.3:22/x", "allowed_ports"),
    ] {
        let problem = w.check_url(url).unwrap_err();
        assert!(problem.contains(rule), "{url}: {problem}");
    }
    // Ports: 443 by default for https, and the listed others.
    assert!(w.check_url("https://hooks.example.com:8443/x").is_ok());
    assert!(w.check_url("https://hooks.example.com:443/x").is_ok());

    // The addresses a host name resolves to: public ones, or those a CIDR lists.
    for (ip, allowed) in [
        ("93.184.215.14", true),
        ("2606:2800:21f:cb07:6820:80da:af6b:8b2c", true),
        ("10.9.8.7", true),
        ("127.0.0.1", false),
        ("169.254.169.254", false),
        ("192.168.1.1", false),
        ("172.16.0.1", false),
        ("100.64.0.1", false),
        ("0.0.0.0", false),
        ("::1", false),
        ("::ffff:127.0.0.1", false),
        ("::ffff:10.1.1.1", true),
        ("64:ff9b::a9fe:a9fe", false),
        ("fd00::1", false),
        ("fe80::1", false),
    ] {
        assert_eq!(
            w.allows_address(ip.parse().unwrap()),
            allowed,
            "{ip} should be {}",
            if allowed { "allowed" } else { "refused" }
        );
    }

    let file = service_config(
        dir.path(),
        "  webhooks:\n    allowed_hosts: [hooks.example.com]\n    allowed_ports: [443, '9000-9100']\n",
    );
    let w = load_service_file(&file).unwrap().serve.webhooks;
    assert!(w.check_url("https://hooks.example.com:9050/x").is_ok());
    assert!(w.check_url("https://hooks.example.com/x").is_ok());
    assert!(w.check_url("https://hooks.example.com:8443/x").is_err());

    for (serve, field) in [
        (
            "  tenant_header: X-MaaS-Username\n  api_keys_file: keys\n",
            "serve.tenant_header",
        ),
        ("  tenant_header: 'bad header'\n", "serve.tenant_header"),
        (
            "  pass_through_headers: [authorization]\n",
            "serve.pass_through_headers",
        ),
        (
            "  pass_through_headers: [a, A]\n",
            "serve.pass_through_headers",
        ),
        (
            "  pass_through_headers: [cookie]\n",
            "serve.pass_through_headers",
        ),
        (
            "  pass_through_headers: [Set-Cookie]\n",
            "serve.pass_through_headers",
        ),
        (
            "  pass_through_headers: [expect]\n",
            "serve.pass_through_headers",
        ),
        (
            "  pass_through_headers: [trailer]\n",
            "serve.pass_through_headers",
        ),
        (
            "  pass_through_headers: [proxy-connection]\n",
            "serve.pass_through_headers",
        ),
        (
            "  tenant_header: X-User\n  pass_through_headers: [x-user]\n",
            "serve.pass_through_headers",
        ),
        (
            "  webhooks:\n    allowed_hosts: ['10.0.0.0/99']\n",
            "serve.webhooks.allowed_hosts",
        ),
        (
            "  webhooks:\n    give_up_after: 1h\n",
            "serve.webhooks.give_up_after",
        ),
        (
            "  webhooks:\n    max_endpoints_per_tenant: 0\n",
            "serve.webhooks.max_endpoints_per_tenant",
        ),
        (
            "  webhooks:\n    allowed_ports: [0]\n",
            "serve.webhooks.allowed_ports",
        ),
        (
            "  webhooks:\n    allowed_ports: ['9100-9000']\n",
            "serve.webhooks.allowed_ports",
        ),
        (
            "  webhooks:\n    allowed_ports: []\n",
            "serve.webhooks.allowed_ports",
        ),
        (
            "  webhooks:\n    allowed_ports: 443\n",
            "serve.webhooks.allowed_ports",
        ),
    ] {
        write(dir.path(), "keys", "sk-a alice\n");
        let file = service_config(dir.path(), serve);
        let errors: Vec<String> = match load_service_file(&file) {
            Ok(_) => panic!("accepted: {serve}"),
            Err(e) => e.errors.iter().map(ToString::to_string).collect(),
        };
        assert!(errors.join("\n").contains(field), "{serve}: {errors:?}");
    }
}

#[test]
fn otlp_endpoint_must_be_plain_http_and_tls_needs_both_files() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        "model_gateways:\n  m: {url: 'http://127.0.0.1:8000'}\nobservability: {otlp_endpoint: 'https://collector:4318'}\n",
    );
    assert_one_error(
        &errors_of(&file),
        "observability.otlp_endpoint: expected an http:// URL",
    );
    let file = write(
        dir.path(),
        "processor.yaml",
        "model_gateways:\n  m: {url: 'http://127.0.0.1:8000'}\nserve: {tls: {cert_file: tls.crt}}\n",
    );
    assert_one_error(
        &errors_of(&file),
        "serve.tls.key_file: is needed with cert_file",
    );
    let file = write(
        dir.path(),
        "processor.yaml",
        "model_gateways:\n  m: {url: 'http://127.0.0.1:8000'}\nserve: {tls: {cert_file: tls.crt, key_file: tls.key}}\n",
    );
    let c = load_file(&file).unwrap();
    let tls = c.serve.tls.expect("serve.tls");
    assert_eq!(tls.cert_file, dir.path().join("tls.crt"));
    assert_eq!(tls.key_file, dir.path().join("tls.key"));
}

#[test]
fn load_is_read_with_its_defaults_and_every_field() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "processor.yaml",
        r#"
model_gateways:
  a:
    url: http://127.0.0.1:8000
    load:
      metrics_urls: [http://127.0.0.1:8001/metrics, http://127.0.0.1:8002/metrics]
  b:
    url: http://127.0.0.1:8000
    load:
      prometheus_url: http://127.0.0.1:9090
      pool: pool-b
      max_running_per_pod: 16
      interval: 500ms
      headroom: 0.3
      priority: -2
  c:
    url: http://127.0.0.1:8000
"#,
    );
    let c = load_file(&file).unwrap();
    let a = c.model_gateways["a"].load.as_ref().unwrap();
    assert_eq!(
        a.metrics_urls,
        [
            "http://127.0.0.1:8001/metrics",
            "http://127.0.0.1:8002/metrics"
        ]
    );
    assert_eq!(a.prometheus_url, None);
    assert_eq!(a.max_running_per_pod, None);
    assert_eq!(a.interval, Duration::from_millis(100));
    assert_eq!(a.headroom, 0.15);
    assert_eq!(a.priority, None);
    let b = c.model_gateways["b"].load.as_ref().unwrap();
    assert_eq!(b.prometheus_url.as_deref(), Some("http://127.0.0.1:9090"));
    assert_eq!(b.pool.as_deref(), Some("pool-b"));
    assert_eq!(b.max_running_per_pod, Some(16));
    assert_eq!(b.interval, Duration::from_millis(500));
    assert_eq!(b.headroom, 0.3);
    assert_eq!(b.priority, Some(-2));
    assert_eq!(c.model_gateways["c"].load, None);
}

#[test]
fn a_bad_load_section_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let case = |name: &str, mode: &str, load: &str| {
        let text = format!(
            "dispatch_mode: {mode}\nmodel_gateways:\n  m:\n    url: http://127.0.0.1:8000\n    inference_pool_name: p\n    load: {load}\n"
        );
        let file = write(dir.path(), name, &text);
        errors_of(&file)
    };
    assert_one_error(
        &case("none.yaml", "sync", "{headroom: 0.2}"),
        "model_gateways.m.load: set metrics_urls (the model servers' /metrics) or prometheus_url with pool",
    );
    assert_one_error(
        &case(
            "both.yaml",
            "sync",
            "{metrics_urls: [http://a:1/metrics], prometheus_url: http://p:9090, pool: x}",
        ),
        "model_gateways.m.load.prometheus_url: set metrics_urls or prometheus_url, not both",
    );
    assert_one_error(
        &case("pool.yaml", "sync", "{prometheus_url: http://p:9090}"),
        "model_gateways.m.load.pool: missing",
    );
    assert_one_error(
        &case("url.yaml", "sync", "{metrics_urls: [ftp://a/metrics]}"),
        "model_gateways.m.load.metrics_urls: [0] \"ftp://a/metrics\"",
    );
    assert_one_error(
        &case(
            "headroom.yaml",
            "sync",
            "{metrics_urls: [http://a:1/metrics], headroom: 1}",
        ),
        "model_gateways.m.load.headroom: must be in [0, 1), got 1",
    );
    let typo = case("key.yaml", "sync", "{metrics_url: [http://a:1/metrics]}");
    assert!(
        typo[0].ends_with(
            "model_gateways.m.load.metrics_url: unknown key (did you mean metrics_urls?)"
        ),
        "{typo:#?}"
    );
    assert_one_error(
        &case(
            "priority.yaml",
            "sync",
            "{metrics_urls: [http://a:1/metrics], priority: high}",
        ),
        "model_gateways.m.load.priority: expected a whole number",
    );
    let in_async = case(
        "async.yaml",
        "async",
        "{metrics_urls: [http://a:1/metrics]}",
    );
    assert!(
        in_async
            .iter()
            .any(|e| e.contains("model_gateways.m.load: is read in sync mode only")),
        "{in_async:#?}"
    );
}

#[test]
fn tenant_preemption_is_on_by_default_with_a_minimum_run_between_two() {
    let dir = tempfile::tempdir().unwrap();
    let file = service_config(dir.path(), "  listen: 127.0.0.1:9000\n");
    let serve = load_service_file(&file).unwrap().serve;
    assert!(serve.tenant_preemption);
    assert_eq!(serve.tenant_preemption_min_run, Duration::from_secs(10));

    let file = service_config(
        dir.path(),
        "  tenant_preemption: false\n  tenant_preemption_min_run: 2m\n",
    );
    let serve = load_service_file(&file).unwrap().serve;
    assert!(!serve.tenant_preemption);
    assert_eq!(serve.tenant_preemption_min_run, Duration::from_secs(120));

    let file = service_config(dir.path(), "  tenant_preemption_min_run: 0s\n");
    let errors: Vec<String> = match load_service_file(&file) {
        Ok(c) => panic!("accepted: {:?}", c.serve.tenant_preemption_min_run),
        Err(e) => e.errors.iter().map(ToString::to_string).collect(),
    };
    assert!(
        errors
            .join("\n")
            .contains("serve.tenant_preemption_min_run"),
        "{errors:?}"
    );
}

#[test]
fn tenant_weights_are_whole_numbers_per_tenant_and_default_to_none() {
    let dir = tempfile::tempdir().unwrap();
    let file = service_config(dir.path(), "  listen: 127.0.0.1:9000\n");
    assert!(load_service_file(&file)
        .unwrap()
        .serve
        .tenant_weights
        .is_empty());

    let file = service_config(
        dir.path(),
        "  tenant_weights:\n    alice: 3\n    team-b: 1\n",
    );
    let weights = load_service_file(&file).unwrap().serve.tenant_weights;
    assert_eq!(
        weights.into_iter().collect::<Vec<_>>(),
        [("alice".to_owned(), 3), ("team-b".to_owned(), 1)]
    );

    let file = service_config(
        dir.path(),
        "  tenant_weights:\n    alice: 0\n    bob: lots\n    carol: 5000\n",
    );
    let errors: Vec<String> = match load_service_file(&file) {
        Ok(c) => panic!("accepted: {:?}", c.serve.tenant_weights),
        Err(e) => e.errors.iter().map(ToString::to_string).collect(),
    };
    let all = errors.join("\n");
    for field in [
        "serve.tenant_weights.alice",
        "serve.tenant_weights.bob",
        "serve.tenant_weights.carol",
    ] {
        assert!(all.contains(field), "no error for {field}: {all}");
    }
}
