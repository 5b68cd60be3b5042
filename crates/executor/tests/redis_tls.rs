//! The executor connects with the config's `redis_tls`.

use batch_config::figment::providers::{Format, Yaml};
use batch_config::figment::Figment;
use batch_config::ProcessorConfig;
use batch_executor::{AsyncError, ExecError, Executor};
use batch_testkit::{ClientAuth, TlsRedis};

fn config(redis: &TlsRedis, redis_tls: &str) -> ProcessorConfig {
    let dir = redis.dir();
    std::fs::write(dir.join("redis-url"), format!("{}\n", redis.url())).unwrap();
    let path = dir.join("processor.yaml");
    std::fs::write(
        &path,
        format!(
            "dispatch_mode: async\nredis_url_file: redis-url\nwork_dir: work\n\
             model_gateways:\n  m: {{inference_pool_name: pool-a}}\n{redis_tls}"
        ),
    )
    .unwrap();
    // The file alone: no PROCESSOR_ variable of the environment interferes.
    ProcessorConfig::from_figment(Figment::from(Yaml::file_exact(&path)))
        .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test]
async fn async_mode_connects_over_mutual_tls_with_the_configured_files() {
    let redis = TlsRedis::start(ClientAuth::Required);
    let pki = redis.pki();
    let tls = format!(
        "redis_tls:\n  ca_file: {}\n  cert_file: {}\n  key_file: {}\n",
        pki.ca.display(),
        pki.client_cert.display(),
        pki.client_key.display()
    );
    let executor = Executor::new(config(&redis, &tls)).await;
    assert!(executor.is_ok(), "{:?}", executor.err());

    // Without redis_tls the system's roots do not trust the test CA: nothing connects.
    match Executor::new(config(&redis, "")).await {
        Err(ExecError::Async(AsyncError::Connect(e))) => {
            assert!(e.to_string().contains("TLS"), "{e}")
        }
        Err(other) => panic!("unexpected error: {other}"),
        Ok(_) => panic!("connected without the configured CA"),
    }
}
