//! The simulator reaches Redis the processor's ways: here mutual TLS (`--redis.tls-*`).

mod common;

use std::time::Duration;

use batch_redis::{ConnectOptions, RedisTls};
use batch_testkit::{ClientAuth, TlsRedis};
use common::*;
use dispatcher_sim::{Dispatcher, Gateway, GatewayConfig};

const RESULTS: &str = "llm-d-async:results:pool-a:$batch";

#[tokio::test]
async fn the_simulator_serves_a_queue_over_mutual_tls() {
    let redis = TlsRedis::start(ClientAuth::Required);
    let tls = RedisTls {
        ca_file: Some(redis.pki().ca.clone()),
        cert_file: Some(redis.pki().client_cert.clone()),
        key_file: Some(redis.pki().client_key.clone()),
        server_name: None,
    };
    let options = ConnectOptions {
        tls: Some(tls.clone()),
        ..ConnectOptions::default()
    };
    let client = batch_redis::connect(&redis.url(), &options).await.unwrap();
    let gw = Gateway::start("127.0.0.1:0".parse().unwrap(), GatewayConfig::default())
        .await
        .unwrap();
    enqueue(
        &client,
        QUEUE,
        "req-tls",
        now() + 3600,
        &chat("over tls"),
        &format!(r#"{{"request_token":"t","result_queue_name":"{RESULTS}"}}"#),
    )
    .await;

    let mut config = fast(&redis.url(), vec![entry(QUEUE, &gw.base_url())]);
    config.redis_tls = Some(tls);
    let dispatcher = Dispatcher::start(config, None).await.unwrap();
    let results = results(&client, RESULTS, 1, Duration::from_secs(30)).await;
    assert_eq!(results[0].id, "req-tls");
    dispatcher.shutdown().await;
}

#[tokio::test]
async fn the_simulator_refuses_a_url_the_processor_refuses() {
    let config = fast(
        "redis-sentinel://127.0.0.1:26379",
        vec![entry(QUEUE, "http://127.0.0.1:9")],
    );
    let err = match Dispatcher::start(config, None).await {
        Ok(_) => panic!("a sentinel URL without sentinelServiceName was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("sentinelServiceName"), "{err}");
}
