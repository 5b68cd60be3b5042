//! TLS against real TLS-only redis-servers with certificates made in the test.

use std::time::{Duration, Instant};

use batch_redis::{connect, ConnectError, ConnectOptions, RedisTls};
use batch_testkit::{ClientAuth, RedisServer, TestPki, TlsRedis};
use fred::prelude::*;

fn options(tls: RedisTls) -> ConnectOptions {
    ConnectOptions {
        attempts: 3,
        initial_backoff: Duration::from_millis(50),
        connect_timeout: Duration::from_secs(5),
        tls: Some(tls),
        ..ConnectOptions::default()
    }
}

fn trusting(redis: &TlsRedis) -> RedisTls {
    RedisTls {
        ca_file: Some(redis.pki().ca.clone()),
        ..RedisTls::default()
    }
}

fn with_client_cert(redis: &TlsRedis) -> RedisTls {
    RedisTls {
        cert_file: Some(redis.pki().client_cert.clone()),
        key_file: Some(redis.pki().client_key.clone()),
        ..trusting(redis)
    }
}

async fn set_get(client: &Client) {
    let _: () = client
        .set("tls-key", "over tls", None, None, false)
        .await
        .unwrap();
    let value: String = client.get("tls-key").await.unwrap();
    assert_eq!(value, "over tls");
}

#[tokio::test]
async fn tls_with_the_ca_file_works() {
    let redis = TlsRedis::start(ClientAuth::Optional);
    let client = connect(&redis.url(), &options(trusting(&redis)))
        .await
        .unwrap();
    set_get(&client).await;
    // The write went through the TLS server (redis-cli reads it back).
    assert_eq!(redis.command(&["GET", "tls-key"]), "over tls");
}

#[tokio::test]
async fn mutual_tls_works_and_fails_without_a_client_certificate() {
    let redis = TlsRedis::start(ClientAuth::Required);
    let client = connect(&redis.url(), &options(with_client_cert(&redis)))
        .await
        .unwrap();
    set_get(&client).await;

    let started = Instant::now();
    let err = connect(&redis.url(), &options(trusting(&redis)))
        .await
        .unwrap_err();
    let text = err.to_string();
    eprintln!("{text}");
    assert!(matches!(err, ConnectError::Tls { .. }), "{text}");
    assert!(text.contains("client certificate"), "{text}");
    assert!(
        text.contains(&format!("127.0.0.1:{}", redis.port())),
        "{text}"
    );
    assert!(started.elapsed() < Duration::from_secs(20), "{text}");
}

#[tokio::test]
async fn a_server_name_override_is_what_gets_verified() {
    let redis = TlsRedis::start(ClientAuth::Optional);
    // The certificate carries 127.0.0.1 and localhost.
    let good = RedisTls {
        server_name: Some("localhost".into()),
        ..trusting(&redis)
    };
    let client = connect(&redis.url(), &options(good)).await.unwrap();
    set_get(&client).await;

    let wrong = RedisTls {
        server_name: Some("redis.elsewhere.example".into()),
        ..trusting(&redis)
    };
    let err = connect(&redis.url(), &options(wrong)).await.unwrap_err();
    let text = err.to_string();
    eprintln!("{text}");
    assert!(matches!(err, ConnectError::Tls { .. }), "{text}");
    assert!(text.contains("not valid for"), "{text}");
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_refused() {
    let redis = TlsRedis::start(ClientAuth::Optional);
    let other = batch_testkit::tempdir().unwrap();
    let other = TestPki::generate(other.path());
    let tls = RedisTls {
        ca_file: Some(other.ca.clone()),
        ..RedisTls::default()
    };
    let started = Instant::now();
    let err = connect(&redis.url(), &options(tls)).await.unwrap_err();
    let text = err.to_string();
    eprintln!("{text}");
    assert!(matches!(err, ConnectError::Tls { .. }), "{text}");
    assert!(
        text.contains(&format!(
            "not trusted by the CA in ca_file {}",
            other.ca.display()
        )),
        "{text}"
    );
    // Refused at the first attempt: retrying cannot help.
    assert!(started.elapsed() < Duration::from_secs(10), "{text}");
}

#[tokio::test]
async fn without_a_ca_file_the_system_roots_do_not_trust_a_private_ca() {
    let redis = TlsRedis::start(ClientAuth::Optional);
    // No redis_tls at all: rediss:// still means TLS, verified against the system's roots.
    let options = ConnectOptions {
        attempts: 2,
        ..ConnectOptions::default()
    };
    let err = connect(&redis.url(), &options).await.unwrap_err();
    let text = err.to_string();
    eprintln!("{text}");
    match &err {
        // A machine without any system roots says so; either way nothing connects.
        ConnectError::Tls { .. } => assert!(text.contains("system's root certificates"), "{text}"),
        ConnectError::TlsSetup { .. } => {
            assert!(text.contains("no system root certificate"), "{text}")
        }
        other => panic!("unexpected: {other}"),
    }
}

#[tokio::test]
async fn rediss_to_a_plaintext_server_fails_quickly_without_the_password() {
    let plain = RedisServer::start();
    let url = format!("rediss://batch:hunter2@127.0.0.1:{}", plain.port());
    let dir = batch_testkit::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    let tls = RedisTls {
        ca_file: Some(pki.ca.clone()),
        ..RedisTls::default()
    };
    let started = Instant::now();
    let err = connect(&url, &options(tls)).await.unwrap_err();
    let text = err.to_string();
    eprintln!("{text}");
    assert!(!text.contains("hunter2"), "{text}");
    assert!(
        text.contains(&format!("127.0.0.1:{}", plain.port())),
        "{text}"
    );
    assert!(text.contains("does the server speak TLS"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(30), "{text}");
    // Nothing was written in plaintext: the server saw no command it understood.
    assert_eq!(plain.command(&["DBSIZE"]), ":0");
}

#[tokio::test]
async fn a_plaintext_url_never_uses_tls_and_refuses_tls_settings() {
    let redis = TlsRedis::start(ClientAuth::Optional);
    let plain_url = format!("redis://127.0.0.1:{}", redis.port());
    let err = connect(&plain_url, &options(trusting(&redis)))
        .await
        .unwrap_err();
    assert!(matches!(err, ConnectError::BadUrl { .. }), "{err}");
    assert!(err.to_string().contains("not rediss://"), "{err}");

    // Plaintext to the TLS port does not get through.
    let quick = ConnectOptions {
        attempts: 1,
        connect_timeout: Duration::from_secs(2),
        ..ConnectOptions::default()
    };
    assert!(connect(&plain_url, &quick).await.is_err());
}

#[tokio::test]
async fn unusable_tls_files_are_named() {
    let redis = TlsRedis::start(ClientAuth::Optional);
    let missing = redis.dir().join("no-such-ca.pem");
    let tls = RedisTls {
        ca_file: Some(missing.clone()),
        ..RedisTls::default()
    };
    let err = connect(&redis.url(), &options(tls)).await.unwrap_err();
    let text = err.to_string();
    eprintln!("{text}");
    assert!(matches!(err, ConnectError::TlsSetup { .. }), "{text}");
    assert!(
        text.contains(&format!("ca_file {}", missing.display())),
        "{text}"
    );

    // A key file that holds a certificate instead of a key.
    let tls = RedisTls {
        cert_file: Some(redis.pki().client_cert.clone()),
        key_file: Some(redis.pki().client_cert.clone()),
        ..trusting(&redis)
    };
    let err = connect(&redis.url(), &options(tls)).await.unwrap_err();
    assert!(err.to_string().contains("key_file"), "{err}");

    let tls = RedisTls {
        cert_file: Some(redis.pki().client_cert.clone()),
        ..trusting(&redis)
    };
    let err = connect(&redis.url(), &options(tls)).await.unwrap_err();
    assert!(err.to_string().contains("without key_file"), "{err}");
}
