//! Starts the Batch API service in this process and runs one batch through it, as an OpenAI
//! client would: upload the input file, create the batch, wait for it to complete, download
//! its output file.
//!
//! The service keeps its records in Redis (a `redis-server` from `PATH`, started on a free
//! loopback port by `batch-testkit`), its files in a local directory, and runs jobs in sync mode
//! against the gateway simulator of `tools/gateway-sim`. It listens on a free loopback port and
//! has no API keys, so every caller is the tenant `default` (allowed on loopback only).
//!
//! ```text
//! cargo run -p batch-service --example serve
//! ```

use std::time::{Duration, Instant};

use batch_config::figment::providers::{Format, Yaml};
use batch_config::figment::Figment;
use batch_config::ProcessorConfig;
use batch_service::{Service, ServiceOptions};
use batch_testkit::http::{get, post};
use gateway_sim::{Gateway, GatewayConfig};
use serde_json::Value;

type Error = Box<dyn std::error::Error>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let redis = batch_testkit::RedisServer::start();
    let gateway = Gateway::start("127.0.0.1:0".parse()?, GatewayConfig::default()).await?;
    let dir = batch_testkit::tempdir()?;

    // `processor serve`'s configuration: the Redis URL is a secret, read from a file.
    let yaml = format!(
        "dispatch_mode: sync\nredis_url_file: {}\nwork_dir: {}\n\
         model_gateways:\n  llama-3:\n    url: {url}\n  mistral:\n    url: {url}\n\
         serve:\n  storage: file://{}\n",
        redis.write_url_file(dir.path()).display(),
        dir.path().join("work").display(),
        dir.path().join("storage").display(),
        url = gateway.base_url(),
    );
    let config = ProcessorConfig::service_from_figment(Figment::from(Yaml::string(&yaml)))?;
    let options = ServiceOptions {
        listen: Some("127.0.0.1:0".parse()?),
        ..ServiceOptions::default()
    };
    let service = Service::start(config, options).await?;
    let base = format!("http://{}/v1", service.local_addr());
    println!("serving on {base}");

    // The demo's input (40 chat requests to `llama-3` and `mistral`), as `scripts/demo.sh`
    // sends it with curl.
    let input = std::fs::read_to_string(batch_testkit::demo_input())?;
    let result = one_batch(&base, &input).await;
    service.shutdown().await;
    gateway.shutdown().await;
    let output = result?;
    println!("output file: {} lines", output.lines().count());
    if output.lines().count() != input.lines().count() {
        return Err(format!("expected a line per request:\n{output}").into());
    }
    Ok(())
}

/// Uploads `input` as a batch input file, creates its batch, waits for it and returns its
/// output file.
async fn one_batch(base: &str, input: &str) -> Result<String, Error> {
    let boundary = "example-boundary";
    let upload = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"batch.jsonl\"\r\n\
         Content-Type: application/jsonl\r\n\r\n{input}\r\n--{boundary}--\r\n",
    );
    let content_type = format!("multipart/form-data; boundary={boundary}");
    let file = answer(
        post(
            &format!("{base}/files"),
            &upload,
            &[("content-type", &content_type)],
        )
        .await,
    )?;
    println!("uploaded {}", file["id"]);

    let create = serde_json::json!({
        "input_file_id": file["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    });
    let json = [("content-type", "application/json")];
    let mut batch = answer(post(&format!("{base}/batches"), &create.to_string(), &json).await)?;
    let id = batch["id"]
        .as_str()
        .ok_or("a batch without an id")?
        .to_owned();
    println!("created {id}");

    let until = Instant::now() + Duration::from_secs(30);
    while batch["status"] != "completed" {
        if ["failed", "expired", "cancelled"].contains(&batch["status"].as_str().unwrap_or("")) {
            return Err(format!("the batch ended as {batch}").into());
        }
        if Instant::now() > until {
            return Err(format!("the batch did not complete in 30 s: {batch}").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (status, body) = get(&format!("{base}/batches/{id}")).await;
        batch = answer(Ok((status, Default::default(), body)))?;
    }
    println!("{id}: {}", batch["request_counts"]);

    let output = batch["output_file_id"].as_str().ok_or("no output file")?;
    let (status, content) = get(&format!("{base}/files/{output}/content")).await;
    match status {
        200 => Ok(content),
        _ => Err(format!("downloading {output}: {status} {content}").into()),
    }
}

/// The JSON body of a 200 answer; an error naming the status otherwise.
fn answer(response: Result<(u16, hyper::HeaderMap, String), String>) -> Result<Value, Error> {
    match response? {
        (200, _, body) => Ok(serde_json::from_str(&body)?),
        (status, _, body) => Err(format!("{status}: {body}").into()),
    }
}
