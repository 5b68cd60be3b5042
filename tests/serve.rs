//! `processor serve` end to end: its OpenAI-style HTTP API as the binary serves it (errors, live
//! counts, cancel, expiry), `kill -9`, SIGTERM and SIGINT in the middle of jobs (every line
//! exactly once after a restart, every file and batch listed as before), a Redis outage, trusted
//! tenant headers, pass-through headers, webhooks, traces and TLS. Real redis-server, the
//! simulated dispatcher and gateway in-process, the `processor` binary. The API's tests that
//! need no process of its own (routes, pages, tenants, quotas) run the service in process:
//! `crates/service/tests/api/serve.rs`.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use dispatcher_sim::GatewayConfig;
use serde_json::{json, Value};
use support::batches::*;
use support::serve::*;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_requests_get_openai_errors_with_their_statuses() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = async_service(
        &env,
        TWO_TENANTS,
        "",
        "input:\n  max_file_bytes: 4000\n  max_requests: 10\n",
    );
    let service = Service::start(&config);
    let a = service.client(Some(KEY_A));
    let b = service.client(Some(KEY_B));
    let (small, _) = input_jsonl("ok", 10, "llama-3");
    assert!(small.len() < 4000);

    // 401: no key, a wrong key, another scheme.
    for client in [
        service.client(None),
        service.client(Some("sk-wrong")),
        Api::new(&service.base, Some("")),
    ] {
        let resp = client.get("/v1/files").await;
        has_request_id(&resp);
        resp.expect_error(401);
        client.get("/v1/batches").await.expect_error(401);
        client
            .upload("x.jsonl", small.as_bytes(), None)
            .await
            .expect_error(401);
    }
    let basic = service
        .client(None)
        .send(
            hyper::Method::GET,
            "/v1/files",
            &[("authorization", &format!("Basic {KEY_A}"))],
            Default::default(),
        )
        .await;
    basic.expect_error(401);
    // Health needs no key.
    let health = service.client(None).get("/health").await;
    assert_eq!(health.status, 200);
    has_request_id(&health);
    assert_eq!(service.client(None).get("/ready").await.status, 200);

    // 413: too many bytes, too many lines; at the limits it is fine.
    let big_line = json!({
        "custom_id": "big", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "llama-3", "messages": [{"role": "user", "content": "x".repeat(5000)}]}
    })
    .to_string()
        + "\n";
    a.upload("big.jsonl", big_line.as_bytes(), None)
        .await
        .expect_error(413);
    let (eleven, _) = input_jsonl("many", 11, "llama-3");
    assert!(eleven.len() < 4000);
    a.upload("many.jsonl", eleven.as_bytes(), None)
        .await
        .expect_error(413);
    let ok = a.upload_ok("ok.jsonl", small.as_bytes()).await;
    assert!(
        a.list_all("/v1/files", "", 100).await.len() == 1,
        "a refused upload was kept"
    );

    // 400: malformed uploads.
    a.post_multipart("/v1/files", &[("purpose", None, b"batch")])
        .await
        .expect_error(400);
    a.post_multipart("/v1/files", &[("file", Some("x.jsonl"), small.as_bytes())])
        .await
        .expect_error(400);
    a.post_multipart(
        "/v1/files",
        &[
            ("purpose", None, b"no-such-purpose"),
            ("file", Some("x.jsonl"), small.as_bytes()),
        ],
    )
    .await
    .expect_error(400);

    // 400: malformed batches.
    let good = json!({"input_file_id": ok, "endpoint": "/v1/chat/completions", "completion_window": "24h"});
    let with = |key: &str, value: Value| {
        let mut body = good.clone();
        body[key] = value;
        body
    };
    let without = |key: &str| {
        let mut body = good.clone();
        body.as_object_mut().unwrap().remove(key);
        body
    };
    for body in [
        without("input_file_id"),
        without("endpoint"),
        without("completion_window"),
        with("endpoint", json!("/v1/no-such-endpoint")),
        with("completion_window", json!("whenever")),
        with("metadata", json!(5)),
    ] {
        let resp = a.post_json("/v1/batches", &body).await;
        assert_eq!(resp.status, 400, "{body} got {}", resp.text());
        resp.expect_error(400);
    }
    a.send(
        hyper::Method::POST,
        "/v1/batches",
        &[("content-type", "application/json")],
        bytes::Bytes::from_static(b"{not json"),
    )
    .await
    .expect_error(400);
    // An empty, unknown or another tenant's input file is a bad value in the body: 400, naming
    // the parameter, with the words the batch gateway uses.
    let error = a.create_batch("", "24h").await.expect_error(400);
    assert_eq!(error["param"], "input_file_id", "{error}");
    for (client, file) in [(&a, "file-doesnotexist"), (&b, ok.as_str())] {
        let error = client.create_batch(file, "24h").await.expect_error(400);
        assert_eq!(error["type"], "invalid_request_error", "{error}");
        assert_eq!(error["param"], "input_file_id", "{error}");
        assert_eq!(
            error["message"],
            format!("Input file with ID '{file}' not found"),
            "{error}"
        );
    }
    assert!(a.list_all("/v1/batches", "", 100).await.is_empty());
    assert!(b.list_all("/v1/batches", "", 100).await.is_empty());
    a.get("/v1/batches?limit=0").await.expect_error(400);
    a.get("/v1/batches?limit=101").await.expect_error(400);
    a.get("/v1/files?limit=10001").await.expect_error(400);

    // 404: unknown batches.
    a.get("/v1/batches/batch_doesnotexist")
        .await
        .expect_error(404);
    a.post_empty("/v1/batches/batch_doesnotexist/cancel")
        .await
        .expect_error(404);
    a.get("/v1/batches/batch_doesnotexist/output")
        .await
        .expect_error(404);
    a.get("/v1/batches/batch_doesnotexist/errors")
        .await
        .expect_error(404);

    // The metrics count the answers by route and status.
    let metrics = service.client(None).get("/metrics").await;
    assert_eq!(metrics.status, 200);
    let text = metrics.text();
    assert!(text.contains("batch_service_api_requests_total{"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("batch_service_api_requests_total") && l.contains("\"413\"")),
        "no 413 counted:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_shows_live_counts_and_partial_output_then_completes() {
    let (env, service, a) = two_tenants(GatewayConfig::default(), "").await;
    let sim = gated_dispatcher(&env).await;
    let b = service.client(Some(KEY_B));
    let (text, lines) = input_jsonl("live", 200, "llama-3");
    let file = a.upload_ok("live.jsonl", text.as_bytes()).await;
    let created = a
        .post_json(
            "/v1/batches",
            &json!({
                "input_file_id": file, "endpoint": "/v1/chat/completions",
                "completion_window": "24h", "metadata": {"run": "live-1"}
            }),
        )
        .await
        .expect(200);
    let id = id_of(&created);
    assert!(id.starts_with("batch_"), "{created}");
    assert_eq!(created["object"], "batch");
    assert_eq!(created["input_file_id"], file);
    assert_eq!(created["endpoint"], "/v1/chat/completions");
    assert_eq!(created["completion_window"], "24h");
    assert_eq!(created["metadata"], json!({"run": "live-1"}));
    assert!(created["created_at"].as_u64().is_some());
    assert!(
        matches!(
            created["status"].as_str(),
            Some("validating" | "in_progress")
        ),
        "{created}"
    );

    // The gate is closed: the job waits in in_progress with nothing done.
    let waiting = a
        .wait_batch(&id, FINISH, "in_progress", |b| b["status"] == "in_progress")
        .await;
    assert_eq!(count(&waiting, "total"), 200, "{waiting}");
    assert_eq!(count(&waiting, "completed"), 0, "{waiting}");
    assert!(waiting["in_progress_at"].as_u64().is_some(), "{waiting}");

    // Opened a while, then closed again: the counts and the partial output agree.
    let_through(&env, &a, &id, 20).await;
    let mut last = a.batch(&id).await;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = a.batch(&id).await;
        if now["request_counts"] == last["request_counts"] {
            break;
        }
        last = now;
    }
    assert_eq!(last["status"], "in_progress", "{last}");
    let done = count(&last, "completed");
    assert!((20..200).contains(&done), "{last}");
    assert_eq!(count(&last, "failed"), 0, "{last}");
    assert_eq!(x_count(&last, "succeeded"), done, "{last}");
    assert_eq!(x_count(&last, "processing"), 200 - done, "{last}");
    let partial = a.get(&format!("/v1/batches/{id}/output")).await;
    assert_eq!(partial.status, 200, "{}", partial.text());
    assert_eq!(partial.jsonl().len() as u64, done);
    let errors = a.get(&format!("/v1/batches/{id}/errors")).await;
    assert_eq!(errors.status, 200, "{}", errors.text());
    assert!(errors.jsonl().is_empty(), "{}", errors.text());
    // The other tenant sees none of it.
    b.get(&format!("/v1/batches/{id}")).await.expect_error(404);
    b.get(&format!("/v1/batches/{id}/output"))
        .await
        .expect_error(404);
    b.get(&format!("/v1/batches/{id}/errors"))
        .await
        .expect_error(404);
    b.post_empty(&format!("/v1/batches/{id}/cancel"))
        .await
        .expect_error(404);

    gate(&env, true);
    let batch = a.wait_final(&id, FINISH).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    assert_eq!(count(&batch, "total"), 200);
    assert_eq!(count(&batch, "completed"), 200);
    assert_eq!(count(&batch, "failed"), 0);
    assert_eq!(x_count(&batch, "succeeded"), 200);
    assert_eq!(x_count(&batch, "processing"), 0);
    for field in ["in_progress_at", "finalizing_at", "completed_at"] {
        assert!(batch[field].as_u64().is_some(), "{field}: {batch}");
    }
    assert!(batch["error_file_id"].is_null(), "no error lines: {batch}");
    // Every line names one model, so the batch does too.
    assert_eq!(batch["model"], "llama-3", "{batch}");
    let results = a.results(&batch).await;
    results.assert_answered(&lines);
    let output = a
        .get(&format!(
            "/v1/files/{}",
            batch["output_file_id"].as_str().unwrap()
        ))
        .await
        .expect(200);
    assert_eq!(output["purpose"], "batch_output", "{output}");
    assert_eq!(
        ids(&a.list_all("/v1/files", "purpose=batch_output", 10).await),
        vec![id_of(&output)]
    );
    b.get(&format!("/v1/files/{}", id_of(&output)))
        .await
        .expect_error(404);
    let all_output = a.get(&format!("/v1/batches/{id}/output")).await;
    assert_eq!(all_output.jsonl(), results.output);
    // The metrics count the jobs by status.
    let metrics = service.client(None).get("/metrics").await.text();
    assert!(
        metrics.lines().any(|l| l.starts_with("batch_service_jobs{")
            && l.contains("\"completed\"")
            && l.ends_with(" 1")),
        "no completed job counted:\n{metrics}"
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_is_idempotent_and_keeps_the_partial_results() {
    let (env, service, a) = two_tenants(GatewayConfig::default(), "").await;
    let sim = gated_dispatcher(&env).await;
    let (_, id, lines) = submit(&a, "cancel", 200).await;
    let_through(&env, &a, &id, 10).await;

    let first = a
        .post_empty(&format!("/v1/batches/{id}/cancel"))
        .await
        .expect(200);
    assert!(
        matches!(first["status"].as_str(), Some("cancelling" | "cancelled")),
        "{first}"
    );
    let second = a
        .post_empty(&format!("/v1/batches/{id}/cancel"))
        .await
        .expect(200);
    assert!(
        matches!(second["status"].as_str(), Some("cancelling" | "cancelled")),
        "{second}"
    );
    let batch = a.wait_final(&id, FINISH).await;
    assert_eq!(batch["status"], "cancelled", "{batch}");
    assert!(batch["cancelling_at"].as_u64().is_some(), "{batch}");
    assert!(batch["cancelled_at"].as_u64().is_some(), "{batch}");
    let done = count(&batch, "completed");
    assert!((10..200).contains(&done), "{batch}");
    assert_eq!(count(&batch, "total"), 200);
    assert_eq!(x_count(&batch, "succeeded"), done, "{batch}");
    assert_eq!(x_count(&batch, "cancelled"), 200 - done, "{batch}");
    assert_eq!(x_count(&batch, "processing"), 0, "{batch}");
    let results = a.results(&batch).await;
    results.assert_each_once_with_errors(&lines, "batch_cancelled", 200 - done);
    assert_eq!(results.output.len() as u64, done);
    // Cancelling a cancelled batch changes nothing.
    let third = a
        .post_empty(&format!("/v1/batches/{id}/cancel"))
        .await
        .expect(200);
    assert_eq!(third["status"], "cancelled", "{third}");
    assert_eq!(third["request_counts"], batch["request_counts"]);
    // The cancelled requests are no longer counted in flight.
    service.expect_idle_gauges(Duration::from_secs(5)).await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_past_its_window_expires_keeping_its_partial_results() {
    let (env, service, a) = two_tenants(GatewayConfig::default(), "").await;
    let sim = gated_dispatcher(&env).await;
    let (_, id, lines) = submit_within(&a, "late", 100, "6s").await;
    let_through(&env, &a, &id, 10).await;
    let batch = a.wait_final(&id, FINISH).await;
    assert_eq!(batch["status"], "expired", "{batch}");
    assert!(batch["expired_at"].as_u64().is_some(), "{batch}");
    let done = count(&batch, "completed");
    assert!((10..100).contains(&done), "{batch}");
    assert_eq!(x_count(&batch, "succeeded"), done, "{batch}");
    assert_eq!(x_count(&batch, "expired"), 100 - done, "{batch}");
    let results = a.results(&batch).await;
    results.assert_each_once_with_errors(&lines, "batch_expired", 100 - done);
    service.expect_idle_gauges(Duration::from_secs(5)).await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_interrupted_by_kill_9_ends_cancelled_after_a_restart() {
    let (env, mut service, a) = two_tenants(GatewayConfig::default(), "").await;
    let sim = gated_dispatcher(&env).await;
    let (_, id, lines) = submit(&a, "cut", 100).await;
    let_through(&env, &a, &id, 10).await;
    a.post_empty(&format!("/v1/batches/{id}/cancel"))
        .await
        .expect(200);
    service.kill9();
    service.restart();
    let a = service.client(Some(KEY_A));
    let batch = a.wait_final(&id, FINISH).await;
    assert_eq!(batch["status"], "cancelled", "{batch}");
    let done = count(&batch, "completed");
    let results = a.results(&batch).await;
    results.assert_each_once_with_errors(&lines, "batch_cancelled", 100 - done);
    service.expect_idle_gauges(Duration::from_secs(5)).await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_mid_job_and_a_restart_resume_every_line_once() {
    // One job at a time: the last batch is still queued when the service is killed.
    let (env, mut service, a) = two_tenants(slow_gateway(), "  max_active_jobs: 1\n").await;
    let sim = gated_dispatcher(&env).await;
    let (text, lines) = input_jsonl("kill", 300, "llama-3");
    let (other_text, other_lines) = input_jsonl("other", 5, "llama-3");
    let file = a.upload_ok("kill.jsonl", text.as_bytes()).await;
    let other_file = a.upload_ok("other.jsonl", other_text.as_bytes()).await;
    let other = id_of(&a.create_batch_ok(&other_file).await);
    let id = id_of(&a.create_batch_ok(&file).await);
    let (_, queued, queued_lines) = submit(&a, "queued", 5).await;
    gate(&env, true);
    // The small batch goes first (its deadline is earlier) and finishes before the kill.
    let other = a.wait_final(&other, FINISH).await;
    assert_eq!(other["status"], "completed", "{other}");
    a.wait_batch(&id, FINISH, "30 lines done", |b| {
        count(b, "completed") >= 30
    })
    .await;
    let before = inventory(&a).await;
    let mid = a.batch(&id).await;
    assert_eq!(mid["status"], "in_progress", "{mid}");
    assert!(count(&mid, "completed") < 300, "{mid}");
    let waiting = a.batch(&queued).await;
    assert_eq!(count(&waiting, "completed"), 0, "{waiting}");
    service.kill9();

    service.restart();
    let a = service.client(Some(KEY_A));
    assert_kept(&before, &inventory(&a).await);
    let batch = a.wait_final(&id, FINISH).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    assert_eq!(count(&batch, "completed"), 300, "{batch}");
    let results = a.results(&batch).await;
    results.assert_answered(&lines);
    a.results(&other).await.assert_each_once(&other_lines);
    let queued = a.wait_final(&queued, FINISH).await;
    assert_eq!(queued["status"], "completed", "{queued}");
    a.results(&queued).await.assert_each_once(&queued_lines);
    assert_kept(&before, &inventory(&a).await);
    // Results of requests sent before the kill are not taken off a gauge that never counted
    // them (it would go below 0).
    service.expect_idle_gauges(Duration::from_secs(5)).await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_kills_across_six_batches_lose_and_double_nothing() {
    let (env, mut service, a) = two_tenants(slow_gateway(), "  max_active_jobs: 2\n").await;
    let sim = gated_dispatcher(&env).await;
    let mut batches = Vec::new();
    for i in 0..6 {
        let (text, lines) = input_jsonl(&format!("k{i}"), 50, "llama-3");
        let file = a.upload_ok(&format!("k{i}.jsonl"), text.as_bytes()).await;
        batches.push((id_of(&a.create_batch_ok(&file).await), lines));
    }
    let done_total = |api: Api, ids: Vec<String>| async move {
        let mut n = 0;
        for id in &ids {
            n += count(&api.batch(id).await, "completed");
        }
        n
    };
    let ids: Vec<String> = batches.iter().map(|(id, _)| id.clone()).collect();
    gate(&env, true);
    for target in [60, 140, 220] {
        let deadline = Instant::now() + FINISH;
        let a = service.client(Some(KEY_A));
        while done_total(a.clone(), ids.clone()).await < target {
            assert!(Instant::now() < deadline, "fewer than {target} lines done");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let before = inventory(&a).await;
        service.kill9();
        service.restart();
        assert_kept(&before, &inventory(&service.client(Some(KEY_A))).await);
    }
    let a = service.client(Some(KEY_A));
    for (id, lines) in &batches {
        let batch = a.wait_final(id, FINISH).await;
        assert_eq!(batch["status"], "completed", "{batch}");
        assert_eq!(count(&batch, "completed"), 50, "{batch}");
        a.results(&batch).await.assert_each_once(lines);
    }
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_sync_mode_kill_9_mid_job_and_a_restart_resume_every_line_once() {
    let env = Env::start(slow_gateway()).await;
    let config = sync_service(&env, 4, "");
    let mut service = Service::start(&config);
    let a = service.client(Some(KEY_A));
    let (_, id, lines) = submit(&a, "sync-kill", 200).await;
    let mid = a
        .wait_batch(&id, FINISH, "30 lines done", |b| {
            count(b, "completed") >= 30
        })
        .await;
    assert!(count(&mid, "completed") < 200, "{mid}");
    service.kill9();
    service.restart();
    let a = service.client(Some(KEY_A));
    let batch = a.wait_final(&id, FINISH).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    assert_eq!(count(&batch, "completed"), 200, "{batch}");
    let results = a.results(&batch).await;
    results.assert_answered(&lines);
    service.expect_idle_gauges(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_sync_mode_cancel_and_expiry_take_their_requests_off_the_gauges() {
    let env = Env::start(slow_gateway()).await;
    let config = sync_service(&env, 4, "");
    let service = Service::start(&config);
    let a = service.client(Some(KEY_A));
    // Cancelled and expired with requests at the gateway (200 ms each, 4 at once).
    let (_, cancelled, lines) = submit(&a, "sync-cancel", 200).await;
    a.wait_batch(&cancelled, FINISH, "10 lines done", |b| {
        count(b, "completed") >= 10
    })
    .await;
    a.post_empty(&format!("/v1/batches/{cancelled}/cancel"))
        .await
        .expect(200);
    let batch = a.wait_final(&cancelled, FINISH).await;
    assert_eq!(batch["status"], "cancelled", "{batch}");
    let done = count(&batch, "completed");
    a.results(&batch)
        .await
        .assert_each_once_with_errors(&lines, "batch_cancelled", 200 - done);
    service.expect_idle_gauges(Duration::from_secs(5)).await;

    let (_, expired, lines) = submit_within(&a, "sync-late", 200, "3s").await;
    let batch = a.wait_final(&expired, FINISH).await;
    assert_eq!(batch["status"], "expired", "{batch}");
    let done = count(&batch, "completed");
    assert!(done < 200, "{batch}");
    a.results(&batch)
        .await
        .assert_each_once_with_errors(&lines, "batch_expired", 200 - done);
    service.expect_idle_gauges(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn observability_addr_serves_the_probes_and_metrics_without_a_key() {
    let env = Env::start(GatewayConfig::default()).await;
    let port = batch_testkit::free_port();
    let config = async_service(
        &env,
        TWO_TENANTS,
        "",
        &format!("observability:\n  addr: 127.0.0.1:{port}\n"),
    );
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let service = Service::start(&config);
    let a = service.client(Some(KEY_A));
    let (_, id, _) = submit(&a, "probed", 5).await;
    assert_eq!(a.wait_final(&id, FINISH).await["status"], "completed");
    let probes = Api::new(&format!("http://127.0.0.1:{port}"), None);
    let health = probes.get("/health").await;
    assert_eq!((health.status, health.text()), (200, "ok\n".to_owned()));
    let ready = probes.get("/ready").await;
    assert_eq!(ready.status, 200, "{}", ready.text());
    let metrics = probes.get("/metrics").await;
    assert_eq!(metrics.status, 200);
    assert!(
        metrics
            .text()
            .lines()
            .any(|l| l.starts_with("batch_service_jobs{")
                && l.contains("\"completed\"")
                && l.ends_with(" 1")),
        "{}",
        metrics.text()
    );
    // Only the probes: the API stays on its own port.
    probes.get("/v1/batches").await.expect_error(404);
    a.get("/v1/batches").await.expect(200);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_window_that_passes_while_the_service_is_stopped_expires_the_batch_on_restart() {
    let (env, mut service, a) = two_tenants(GatewayConfig::default(), "").await;
    let sim = gated_dispatcher(&env).await;
    let (_, id, lines) = submit_within(&a, "stale", 100, "8s").await;
    let_through(&env, &a, &id, 10).await;
    let (status, _) = service.signal_and_wait(libc::SIGTERM, Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "{}", service.stderr_text());
    tokio::time::sleep(Duration::from_secs(9)).await;
    service.restart();
    let a = service.client(Some(KEY_A));
    let batch = a.wait_final(&id, FINISH).await;
    assert_eq!(batch["status"], "expired", "{batch}");
    let done = count(&batch, "completed");
    assert!(done >= 10, "{batch}");
    let results = a.results(&batch).await;
    results.assert_each_once_with_errors(&lines, "batch_expired", 100 - done);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn while_redis_is_down_ready_says_503_and_the_job_waits_it_out() {
    let mut env = Env::start(GatewayConfig::default()).await;
    // Persistence, so that the state survives the outage.
    env.redis = batch_testkit::RedisServer::builder().aof(true).start();
    env.redis_url_file = env.redis.write_url_file(env.dir.path());
    // The dispatcher loses the results it cannot push while Redis is down, as the real one does;
    // the executor sends those lines again once they are nowhere for this long.
    let config = env.async_config(&[("llama-3", "pool-a")], "  lost_request_timeout: 3s\n");
    add_serve_section(&config, &env.path("storage"), TWO_TENANTS, "", "");
    let sim = gated_dispatcher(&env).await;
    let service = Service::start(&config);
    let a = service.client(Some(KEY_A));
    let anon = service.client(None);
    let (_, id, lines) = submit(&a, "outage", 100).await;
    gate(&env, true);
    a.wait_batch(&id, FINISH, "10 lines done", |b| {
        count(b, "completed") >= 10
    })
    .await;

    env.redis.kill();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = anon.get("/ready").await;
        if ready.status == 503 {
            break;
        }
        assert_eq!(ready.status, 200, "{}", ready.text());
        assert!(
            Instant::now() < deadline,
            "/ready stayed 200 with Redis down"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(anon.get("/health").await.status, 200);
    // The API answers (an error), it does not hang.
    let listed = a.get("/v1/batches").await;
    assert!(listed.status >= 500, "{} {}", listed.status, listed.text());
    listed.expect_error(listed.status);

    env.redis.restart();
    let deadline = Instant::now() + Duration::from_secs(60);
    while anon.get("/ready").await.status != 200 {
        assert!(
            Instant::now() < deadline,
            "/ready not 200 after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let batch = a.wait_final(&id, FINISH).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    a.results(&batch).await.assert_each_once(&lines);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_mid_job_pauses_it_and_a_restart_completes_it() {
    signal_mid_job_pauses_it(libc::SIGTERM).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigint_mid_job_pauses_it_too() {
    signal_mid_job_pauses_it(libc::SIGINT).await;
}

/// `signal` mid-job: the service exits 0 within 10 s, the job is paused (its requests stay
/// queued, nothing is closed), and a restart completes it with every line once.
async fn signal_mid_job_pauses_it(signal: i32) {
    let (env, mut service, a) = two_tenants(slow_gateway(), "").await;
    let sim = gated_dispatcher(&env).await;
    let (_, id, lines) = submit(&a, "term", 300).await;
    gate(&env, true);
    a.wait_batch(&id, FINISH, "30 lines done", |b| {
        count(b, "completed") >= 30
    })
    .await;
    let before = inventory(&a).await;
    // Requests in flight now are answered while the service stops; no new ones start.
    gate(&env, false);
    let (status, took) = service.signal_and_wait(signal, Duration::from_secs(30));
    let stderr = service.stderr_text();
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?} to stop");
    assert_ne!(
        env.redis.command(&["ZCARD", "llm-d-async:requests:pool-a"]),
        ":0",
        "the pending requests were withdrawn"
    );

    service.restart();
    let a = service.client(Some(KEY_A));
    assert_kept(&before, &inventory(&a).await);
    // Paused, not cancelled: with the gate still closed it waits in in_progress.
    let paused = a.batch(&id).await;
    assert_eq!(paused["status"], "in_progress", "{paused}");
    assert!(paused["cancelling_at"].is_null(), "{paused}");
    assert_eq!(x_count(&paused, "cancelled"), 0, "{paused}");
    let errors = a.get(&format!("/v1/batches/{id}/errors")).await;
    assert!(
        errors.jsonl().is_empty(),
        "lines were closed: {}",
        errors.text()
    );
    gate(&env, true);
    let batch = a.wait_final(&id, FINISH).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    assert_eq!(count(&batch, "completed"), 300, "{batch}");
    let results = a.results(&batch).await;
    results.assert_each_once(&lines);
    assert!(results.error.is_empty());
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_file_that_expires_while_the_service_is_down_is_deleted_after_a_restart() {
    let (env, mut service, a) = two_tenants(GatewayConfig::default(), "").await;
    let storage = env.path("storage");
    let (text, _) = input_jsonl("down", 3, "llama-3");
    let id = id_of(
        &a.upload("down.jsonl", text.as_bytes(), Some(2))
            .await
            .expect(200),
    );
    assert!(!stored_copies(&storage, text.as_bytes()).is_empty());
    service.kill9();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !stored_copies(&storage, text.as_bytes()).is_empty(),
        "deleted with no service running?"
    );
    service.restart();
    let a = service.client(Some(KEY_A));
    eventually(
        "the expired object leaves storage",
        Duration::from_secs(30),
        || stored_copies(&storage, text.as_bytes()).is_empty(),
    )
    .await;
    a.get(&format!("/v1/files/{id}")).await.expect_error(404);
    assert!(a.list_all("/v1/files", "", 100).await.is_empty());
}

/// The header an authenticating proxy sets in the tests of `serve.tenant_header`.
const USER_HEADER: &str = "X-MaaS-Username";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tenants_from_a_trusted_header_stay_apart_and_the_last_value_wins() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = async_service(&env, &[], "  tenant_header: X-MaaS-Username\n", "");
    let service = Service::start(&config);
    assert!(
        service
            .stderr_text()
            .contains("must only be reachable through the authenticating proxy"),
        "{}",
        service.stderr_tail(20)
    );
    let anon = service.client(None);
    let alice = anon.with_header(USER_HEADER, "alice");
    let bob = anon.with_header(USER_HEADER, "bob@example.com");

    let (text, _) = input_jsonl("hdr", 2, "llama-3");
    let file = alice.upload_ok("alice.jsonl", text.as_bytes()).await;
    let batch = id_of(&alice.create_batch_ok(&file).await);
    // Another tenant sees none of it.
    bob.get(&format!("/v1/files/{file}"))
        .await
        .expect_error(404);
    bob.get(&format!("/v1/batches/{batch}"))
        .await
        .expect_error(404);
    bob.delete(&format!("/v1/files/{file}"))
        .await
        .expect_error(404);
    assert!(bob.list_all("/v1/files", "", 10).await.is_empty());
    assert!(bob.list_all("/v1/batches", "", 10).await.is_empty());
    let bobs = bob.upload_ok("bob.jsonl", text.as_bytes()).await;
    assert_eq!(
        ids(&alice.list_all("/v1/files", "", 10).await),
        vec![file.clone()]
    );
    assert_eq!(
        ids(&bob.list_all("/v1/files", "", 10).await),
        vec![bobs.clone()]
    );

    // No header: 401; an empty one as well; a bad value: 400, without echoing it.
    let e = anon.get("/v1/files").await.expect_error(401);
    assert!(
        e["message"].as_str().unwrap().contains("x-maas-username"),
        "{e}"
    );
    anon.with_header(USER_HEADER, " ")
        .get("/v1/files")
        .await
        .expect_error(401);
    for bad in ["a b", "../etc", "x*", &"u".repeat(65)] {
        let e = anon
            .with_header(USER_HEADER, bad)
            .get("/v1/files")
            .await
            .expect_error(400);
        assert!(!e["message"].as_str().unwrap().contains(bad), "{e}");
    }

    // The proxy appends the user it checked after what the client sent: a spoofed first value
    // (as another line, or before a comma) is ignored, the last one counts.
    let spoofing = anon
        .with_header(USER_HEADER, "bob@example.com")
        .with_header(USER_HEADER, "alice");
    spoofing.get(&format!("/v1/files/{file}")).await.expect(200);
    spoofing
        .get(&format!("/v1/files/{bobs}"))
        .await
        .expect_error(404);
    assert_eq!(
        ids(&spoofing.list_all("/v1/files", "", 10).await),
        vec![file.clone()]
    );
    let joined = anon.with_header(USER_HEADER, "alice, bob@example.com");
    joined.get(&format!("/v1/files/{bobs}")).await.expect(200);
    joined
        .get(&format!("/v1/files/{file}"))
        .await
        .expect_error(404);
    // A bearer key means nothing in this mode.
    service
        .client(Some(KEY_A))
        .get("/v1/files")
        .await
        .expect_error(401);
}

/// The pass-through headers of the tests, as `serve.pass_through_headers` lists them.
const PASS_THROUGH: &str = "  pass_through_headers: [x-gateway-inference-fairness-id, Baggage]\n";

/// Runs batch A created with pass-through headers and batch B created without, kills the
/// service with SIGKILL once A is under way and restarts it; then every inference request the
/// gateway saw carries both of A's headers (A's, before and after the restart) or neither (B's).
async fn pass_through_survives_a_restart(
    env: &Env,
    service: &mut Service,
    mid_job: u64,
    gate: impl Fn(bool),
) {
    let a = service.client(Some(KEY_A));
    let (text_a, lines_a) = input_jsonl("pass-a", 150, "llama-3");
    let (text_b, lines_b) = input_jsonl("pass-b", 40, "llama-3");
    let file_a = a.upload_ok("a.jsonl", text_a.as_bytes()).await;
    let file_b = a.upload_ok("b.jsonl", text_b.as_bytes()).await;
    let with_headers = a
        .with_header("x-gateway-inference-fairness-id", "spoofed")
        .with_header("x-gateway-inference-fairness-id", "team-a")
        .with_header("baggage", "run=7")
        .with_header("x-not-listed", "dropped");
    let id_a = id_of(&with_headers.create_batch_ok(&file_a).await);
    let id_b = id_of(&a.create_batch_ok(&file_b).await);
    gate(true);
    let mid = a
        .wait_batch(&id_a, FINISH, "lines of A done", |b| {
            count(b, "completed") >= mid_job
        })
        .await;
    gate(false);
    assert!(count(&mid, "completed") < 150, "{mid}");
    service.kill9();
    service.restart();
    gate(true);
    let a = service.client(Some(KEY_A));
    for (id, lines) in [(&id_a, &lines_a), (&id_b, &lines_b)] {
        let batch = a.wait_final(id, FINISH).await;
        assert_eq!(batch["status"], "completed", "{batch}");
        a.results(&batch).await.assert_each_once(lines);
    }
    let seen = env.gateway.recent_requests();
    let (mut tagged, mut plain) = (0, 0);
    for r in &seen {
        assert_eq!(r.header("x-not-listed"), None);
        match (
            r.header("x-gateway-inference-fairness-id"),
            r.header("baggage"),
        ) {
            (Some("team-a"), Some("run=7")) => tagged += 1,
            (None, None) => plain += 1,
            other => panic!("a request with {other:?}"),
        }
    }
    // At least once each: a line sent again after the kill counts twice.
    assert!(
        tagged >= lines_a.len(),
        "{tagged} requests of A with its headers"
    );
    assert!(plain >= lines_b.len(), "{plain} requests of B without");
    assert!(
        tagged + plain < 1000,
        "the gateway's memory of requests overflowed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pass_through_headers_reach_every_request_of_their_batch_in_async_mode() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = async_service(&env, TWO_TENANTS, PASS_THROUGH, "");
    let sim = gated_dispatcher(&env).await;
    let mut service = Service::start(&config);
    pass_through_survives_a_restart(&env, &mut service, 20, |open| gate(&env, open)).await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pass_through_headers_reach_every_request_of_their_batch_in_sync_mode() {
    let env = Env::start(slow_gateway()).await;
    let config = sync_service(&env, 4, PASS_THROUGH);
    let mut service = Service::start(&config);
    pass_through_survives_a_restart(&env, &mut service, 20, |_| {}).await;
}

/// One webhook delivery a [`Receiver`] got.
#[derive(Debug, Clone)]
struct Delivered {
    /// The request's path and query.
    target: String,
    headers: hyper::HeaderMap,
    body: String,
    /// The status the receiver answered.
    status: u16,
}

/// A webhook receiver: a real HTTP server on 127.0.0.1 recording every request, answering 500
/// to the first `fail_first` and while `down` is set, 200 otherwise.
struct Receiver {
    url: String,
    seen: std::sync::Arc<std::sync::Mutex<Vec<Delivered>>>,
    down: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    async fn start(fail_first: usize) -> Receiver {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Delivered>::new()));
        let down = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (seen2, down2) = (seen.clone(), down.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (seen, down) = (seen2.clone(), down2.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(
                        move |req: hyper::Request<hyper::body::Incoming>| {
                            let (seen, down) = (seen.clone(), down.clone());
                            async move {
                                use http_body_util::BodyExt;
                                let (parts, body) = req.into_parts();
                                let body = body.collect().await.unwrap().to_bytes();
                                let mut seen = seen.lock().unwrap();
                                let status =
                                    if seen.len() < fail_first || down.load(Ordering::SeqCst) {
                                        500
                                    } else {
                                        200
                                    };
                                seen.push(Delivered {
                                    target: parts
                                        .uri
                                        .path_and_query()
                                        .map(|p| p.to_string())
                                        .unwrap_or_default(),
                                    headers: parts.headers,
                                    body: String::from_utf8_lossy(&body).into_owned(),
                                    status,
                                });
                                Ok::<_, std::convert::Infallible>(
                                    hyper::Response::builder()
                                        .status(status)
                                        .body(http_body_util::Full::new(bytes::Bytes::new()))
                                        .unwrap(),
                                )
                            }
                        },
                    );
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await;
                });
            }
        });
        Receiver {
            url,
            seen,
            down,
            task,
        }
    }

    fn seen(&self) -> Vec<Delivered> {
        self.seen.lock().unwrap().clone()
    }

    async fn wait_for(&self, what: &str, n: usize) -> Vec<Delivered> {
        eventually(what, Duration::from_secs(60), || self.seen().len() >= n).await;
        self.seen()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Checks a delivery as a Standard Webhooks receiver does: the `v1` HMAC-SHA256 of
/// `<webhook-id>.<webhook-timestamp>.<body>` keyed with the base64 part of `secret`.
fn verify(d: &Delivered, secret: &str) -> bool {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let h = |n: &str| d.headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or("");
    let key = b64.decode(secret.strip_prefix("whsec_").unwrap()).unwrap();
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key);
    let signed = format!("{}.{}.{}", h("webhook-id"), h("webhook-timestamp"), d.body);
    h("webhook-signature").split(' ').any(|s| {
        s.strip_prefix("v1,")
            .and_then(|sig| b64.decode(sig).ok())
            .is_some_and(|sig| ring::hmac::verify(&key, signed.as_bytes(), &sig).is_ok())
    })
}

/// The `serve.webhooks` section of the tests: loopback receivers over plain http, fast retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn webhook_endpoints_are_capped_per_tenant_even_when_created_at_once() {
    let env = Env::start(GatewayConfig::default()).await;
    let extra = format!("{WEBHOOKS}    max_endpoints_per_tenant: 3\n");
    let config = async_service(&env, TWO_TENANTS, &extra, "");
    let service = Service::start(&config);
    let a = service.client(Some(KEY_A));
    let b = service.client(Some(KEY_B));
    let body = json!({"url": "http://127.0.0.1:8080/hook"});

    // Ten creates at once: three are kept, seven refused with a 429 naming the quota.
    let answers =
        futures::future::join_all((0..10).map(|_| a.post_json("/v1/webhook_endpoints", &body)))
            .await;
    let kept: Vec<String> = answers
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| id_of(&r.json()))
        .collect();
    assert_eq!(
        kept.len(),
        3,
        "{:?}",
        answers.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    for refused in answers.iter().filter(|r| r.status != 200) {
        let e = refused.expect_error(429);
        assert_eq!(e["code"], "insufficient_quota", "{e}");
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains("max_endpoints_per_tenant"),
            "{e}"
        );
    }
    let listed = a.list_all("/v1/webhook_endpoints", "", 10).await;
    assert_eq!(listed.len(), 3, "refused endpoints were listed: {listed:?}");

    // The other tenant's cap is its own; a deleted endpoint makes room.
    for _ in 0..3 {
        b.post_json("/v1/webhook_endpoints", &body)
            .await
            .expect(200);
    }
    b.post_json("/v1/webhook_endpoints", &body)
        .await
        .expect_error(429);
    a.delete(&format!("/v1/webhook_endpoints/{}", kept[0]))
        .await
        .expect(200);
    a.post_json("/v1/webhook_endpoints", &body)
        .await
        .expect(200);
}

/// A webhook receiver that takes connections and never answers; how many it holds.
async fn silent_receiver() -> (
    String,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
    tokio::task::JoinHandle<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/silent", listener.local_addr().unwrap());
    let held = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = held.clone();
    let task = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            open.push(stream);
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    (url, held, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_tenants_unanswered_webhooks_do_not_hold_up_another_tenants() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = async_service(
        &env,
        TWO_TENANTS,
        &format!("{WEBHOOKS}    timeout: 2s\n"),
        "",
    );
    let _sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let service = Service::start(&config);
    let a = service.client(Some(KEY_A));
    let b = service.client(Some(KEY_B));
    let (silent, held, silent_task) = silent_receiver().await;
    let steady = Receiver::start(0).await;

    // Tenant A: 16 endpoints that never answer, and 8 batches ending: 128 deliveries, each
    // attempt holding one of a replica's 16 senders for the 2 s timeout, retried.
    for i in 0..16 {
        a.post_json(
            "/v1/webhook_endpoints",
            &json!({"url": format!("{silent}/{i}")}),
        )
        .await
        .expect(200);
    }
    b.post_json("/v1/webhook_endpoints", &json!({"url": steady.url}))
        .await
        .expect(200);
    let mut ends = Vec::new();
    for i in 0..8 {
        ends.push(submit(&a, &format!("a{i}"), 1).await.1);
    }
    for id in &ends {
        assert_eq!(a.wait_final(id, FINISH).await["status"], "completed");
    }
    eventually(
        "A's deliveries fill the senders",
        Duration::from_secs(10),
        || held.load(std::sync::atomic::Ordering::SeqCst) >= 16,
    )
    .await;

    // Tenant B's batch ends: its one delivery waits for a sender, not for A's backlog.
    let (_, batch, _) = submit(&b, "b", 1).await;
    assert_eq!(b.wait_final(&batch, FINISH).await["status"], "completed");
    let ended = Instant::now();
    steady.wait_for("B's event", 1).await;
    let waited = ended.elapsed();
    println!(
        "B's webhook came {waited:?} after its batch ended, beside A's 128 unanswered deliveries"
    );
    assert!(
        waited < Duration::from_millis(3500),
        "B's webhook waited {waited:?} behind A's deliveries (one attempt lasts 2 s)"
    );
    silent_task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_host_name_is_called_only_at_addresses_the_rules_allow_and_ports_are_listed() {
    let env = Env::start(GatewayConfig::default()).await;
    let receiver = Receiver::start(0).await;
    let port = receiver
        .url
        .split(':')
        .nth(2)
        .unwrap()
        .split('/')
        .next()
        .unwrap();
    let named = format!("http://localhost:{port}/hook");
    let try_named = |extra_hosts: &'static str| {
        let config = async_service(
            &env,
            ONE_TENANT,
            &format!(
                "  webhooks:\n    allowed_hosts: [localhost{extra_hosts}]\n    \
                 allowed_ports: [{port}]\n    allow_http: true\n"
            ),
            "",
        );
        let named = named.clone();
        async move {
            let service = Service::start(&config);
            let a = service.client(Some(KEY_A));
            // A port not listed is refused when the endpoint is created.
            let e = a
                .post_json(
                    "/v1/webhook_endpoints",
                    &json!({"url": "http://localhost:6379/hook"}),
                )
                .await
                .expect_error(400);
            assert!(
                e["message"].as_str().unwrap().contains("allowed_ports"),
                "{e}"
            );
            // The name is allowed; what it resolves to is judged when connecting.
            let created = a
                .post_json("/v1/webhook_endpoints", &json!({"url": named}))
                .await
                .expect(200);
            a.post_json(
                &format!("/v1/webhook_endpoints/{}/test", id_of(&created)),
                &json!({}),
            )
            .await
            .expect(200)
        }
    };

    // `localhost` resolves to loopback, which no rule opens by address: nothing is sent, as
    // when a listed name is pointed at an internal address after it was checked.
    let tested = try_named("").await;
    assert_eq!(tested["success"], json!(false), "{tested}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(receiver.seen().is_empty(), "a refused address was called");

    // Opened by a CIDR, the same name is called.
    let tested = try_named(", 127.0.0.0/8").await;
    assert_eq!(tested["success"], json!(true), "{tested}");
    assert_eq!(receiver.wait_for("the test event", 1).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_webhook_is_sent_to_exactly_the_url_that_was_checked() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = async_service(&env, ONE_TENANT, WEBHOOKS, "");
    let service = Service::start(&config);
    let a = service.client(Some(KEY_A));
    let receiver = Receiver::start(0).await;

    // A URL the checker accepts but that is no HTTP request target as written (a space, a
    // non-ASCII letter): stored and sent in the form the checker normalised it to.
    let raw = format!("{}/a b?x=\u{fc}", receiver.url);
    let created = a
        .post_json("/v1/webhook_endpoints", &json!({"url": raw}))
        .await
        .expect(200);
    let sent = format!("{}/a%20b?x=%C3%BC", receiver.url);
    assert_eq!(created["url"], json!(sent), "{created}");
    let tested = a
        .post_json(
            &format!("/v1/webhook_endpoints/{}/test", id_of(&created)),
            &json!({}),
        )
        .await
        .expect(200);
    assert_eq!(tested["success"], json!(true), "{tested}");
    let seen = receiver.wait_for("the test event", 1).await;
    assert_eq!(seen[0].target, "/hook/a%20b?x=%C3%BC");
}

/// The receivers listen on loopback ports the system picks: those are allowed.
const WEBHOOKS: &str = "  webhooks:\n    allowed_hosts: [127.0.0.1, hooks.example.com]\n    allowed_ports: ['1024-65535']\n    allow_http: true\n    retry_initial_backoff: 200ms\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn webhook_endpoints_are_per_tenant_signed_retried_with_one_id_and_allow_listed() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = async_service(&env, TWO_TENANTS, WEBHOOKS, "");
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let service = Service::start(&config);
    let a = service.client(Some(KEY_A));
    let b = service.client(Some(KEY_B));
    let flaky = Receiver::start(3).await;
    let steady = Receiver::start(0).await;

    // Refused URLs name the rule.
    for (url, rule) in [
        ("http://10.1.2.3/hook", "allowed_hosts"),
        ("https://evil.example.org/hook", "allowed_hosts"),
        ("http://127.0.0.2/hook", "allowed_hosts"),
        ("ftp://127.0.0.1/hook", "scheme"),
        ("not a url", "not a URL"),
    ] {
        let e = a
            .post_json("/v1/webhook_endpoints", &json!({"url": url}))
            .await
            .expect_error(400);
        assert_eq!(e["param"], "url", "{e}");
        assert!(e["message"].as_str().unwrap().contains(rule), "{url}: {e}");
    }

    let created = a
        .post_json(
            "/v1/webhook_endpoints",
            &json!({"url": flaky.url, "name": "ends", "event_types": ["batch.completed", "batch.failed"]}),
        )
        .await
        .expect(200);
    let we = id_of(&created);
    assert!(we.starts_with("we_"), "{created}");
    assert_eq!(created["object"], "webhook_endpoint");
    assert_eq!(created["status"], "enabled");
    let secret = created["signing_secret"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("whsec_"), "{created}");
    let hint = created["signing_secret_hint"].as_str().unwrap();
    assert!(!hint.contains(&secret[6..16]), "{hint}");
    // The secret is shown only then: not by retrieve, list or update, nor in the log.
    for shown in [
        a.get(&format!("/v1/webhook_endpoints/{we}")).await.text(),
        a.get("/v1/webhook_endpoints").await.text(),
        a.post_json(
            &format!("/v1/webhook_endpoints/{we}"),
            &json!({"name": "renamed"}),
        )
        .await
        .text(),
    ] {
        assert!(!shown.contains(&secret[6..]), "{shown}");
        assert!(shown.contains(&we), "{shown}");
    }
    // Another tenant sees none of it, and cannot page after it.
    assert!(b.list_all("/v1/webhook_endpoints", "", 10).await.is_empty());
    let e = b
        .get(&format!("/v1/webhook_endpoints?after={we}"))
        .await
        .expect_error(400);
    assert_eq!(e["param"], "after", "{e}");
    let page = a.get("/v1/webhook_endpoints?after=0").await.expect(200);
    assert_eq!(
        (&page["first_id"], &page["has_more"]),
        (&json!(we), &json!(false))
    );
    let page = a.get("/v1/webhook_endpoints?after=1").await.expect(200);
    assert_eq!(page["data"], json!([]), "{page}");
    b.get(&format!("/v1/webhook_endpoints/{we}"))
        .await
        .expect_error(404);
    b.delete(&format!("/v1/webhook_endpoints/{we}"))
        .await
        .expect_error(404);
    b.post_empty(&format!("/v1/webhook_endpoints/{we}/rotate_secret"))
        .await
        .expect_error(404);

    // A batch that ends: the receiver fails three times, gets it the fourth, one id throughout.
    let (_, batch, _) = submit(&a, "hooked", 3).await;
    assert_eq!(a.wait_final(&batch, FINISH).await["status"], "completed");
    let got = flaky.wait_for("four attempts", 4).await;
    let statuses: Vec<u16> = got.iter().map(|d| d.status).collect();
    assert_eq!(statuses, [500, 500, 500, 200]);
    let ids: BTreeSet<&str> = got
        .iter()
        .map(|d| d.headers["webhook-id"].to_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 1, "{ids:?}");
    for d in &got {
        assert!(verify(d, &secret), "a bad signature: {d:?}");
        let event: Value = serde_json::from_str(&d.body).unwrap();
        assert_eq!(event["object"], "event");
        assert_eq!(event["type"], "batch.completed");
        assert_eq!(event["data"]["id"], batch.as_str());
        assert_eq!(event["id"], *ids.iter().next().unwrap());
    }
    // Delivered: nothing more comes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(flaky.seen().len(), 4);
    let metrics = a.get("/metrics").await.text();
    assert!(
        metrics.contains("batch_service_webhook_deliveries_total{result=\"retried\"} 3"),
        "{metrics}"
    );

    // Rotation: a new secret, which the next deliveries use; then a test delivery.
    a.post_json(
        &format!("/v1/webhook_endpoints/{we}"),
        &json!({"url": steady.url}),
    )
    .await
    .expect(200);
    let rotated = a
        .post_empty(&format!("/v1/webhook_endpoints/{we}/rotate_secret"))
        .await
        .expect(200);
    let new_secret = rotated["signing_secret"].as_str().unwrap().to_owned();
    assert_ne!(new_secret, secret);
    let test = a
        .post_json(
            &format!("/v1/webhook_endpoints/{we}/test"),
            &json!({"event_type": "batch.failed"}),
        )
        .await
        .expect(200);
    assert_eq!(
        test,
        json!({"object": "webhook_endpoint.test", "webhook_endpoint_id": we, "event_type": "batch.failed", "status_code": 200, "success": true})
    );
    let sample = &steady.wait_for("the test delivery", 1).await[0];
    assert!(verify(sample, &new_secret) && !verify(sample, &secret));
    assert_eq!(
        serde_json::from_str::<Value>(&sample.body).unwrap()["type"],
        "batch.failed"
    );

    let deleted = a
        .delete(&format!("/v1/webhook_endpoints/{we}"))
        .await
        .expect(200);
    assert_eq!(deleted["deleted"], true);
    assert!(a.list_all("/v1/webhook_endpoints", "", 10).await.is_empty());
    assert!(!service.all_stderr().contains(&secret[6..]));
    assert!(!service.all_stderr().contains(&new_secret[6..]));
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_webhook_survives_the_death_of_the_replica_that_ended_the_batch() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = async_service(&env, TWO_TENANTS, WEBHOOKS, "");
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let mut service = Service::start(&config);
    let a = service.client(Some(KEY_A));
    let receiver = Receiver::start(0).await;
    receiver
        .down
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let created = a
        .post_json("/v1/webhook_endpoints", &json!({"url": receiver.url}))
        .await
        .expect(200);
    let secret = created["signing_secret"].as_str().unwrap().to_owned();
    let (_, batch, _) = submit(&a, "survive", 3).await;
    assert_eq!(a.wait_final(&batch, FINISH).await["status"], "completed");
    let first = receiver.wait_for("a failed attempt", 1).await[0].clone();
    service.kill9();
    receiver
        .down
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let tried = receiver.seen().len();
    service.restart();
    eventually(
        "a delivery after the restart",
        Duration::from_secs(60),
        || receiver.seen().iter().any(|d| d.status == 200),
    )
    .await;
    let got = receiver.seen();
    assert!(got.len() > tried);
    let last = got.last().unwrap();
    assert_eq!(last.status, 200);
    assert_eq!(last.headers["webhook-id"], first.headers["webhook-id"]);
    assert!(verify(last, &secret));
    sim.shutdown().await;
}

/// The trace id a client's `traceparent` names in [`traces_reach_the_gateway`]: its bytes are
/// the ASCII `ABCDEFGHIJKLMNOP`, so they show as such in the exported protobuf.
const CLIENT_TRACE: &str = "4142434445464748494a4b4c4d4e4f50";

/// The trace id of a `traceparent` (`00-<trace>-<span>-<flags>`), checking its shape.
fn trace_of(traceparent: &str) -> String {
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert!(
        parts.len() == 4
            && parts[0] == "00"
            && parts[1].len() == 32
            && parts[2].len() == 16
            && parts[3] == "01"
            && parts[1..3]
                .iter()
                .all(|p| p.bytes().all(|b| b.is_ascii_hexdigit())),
        "not a sampled W3C traceparent: {traceparent}"
    );
    parts[1].to_owned()
}

/// Batch A, created under a client's trace, and batch B, created without one, both complete;
/// every request the gateway saw carries a `traceparent` of its batch's trace (A's is the
/// client's), and the spans of A's trace (the API call, the batch's run, its steps) reached
/// the collector (an OTLP receiver in the test).
async fn traces_reach_the_gateway(env: &Env, config: &std::path::Path, steps: &[&str]) {
    let collector = Receiver::start(0).await;
    let service = traced(config, &collector);
    let a = service.client(Some(KEY_A));
    let (text_a, lines_a) = input_jsonl("traced-a", 30, "llama-3");
    let (text_b, lines_b) = input_jsonl("traced-b", 10, "llama-3");
    let file_a = a.upload_ok("a.jsonl", text_a.as_bytes()).await;
    let file_b = a.upload_ok("b.jsonl", text_b.as_bytes()).await;
    let client_span = format!("00-{CLIENT_TRACE}-0102030405060708-01");
    let id_a = id_of(
        &a.with_header("traceparent", &client_span)
            .create_batch_ok(&file_a)
            .await,
    );
    let id_b = id_of(&a.create_batch_ok(&file_b).await);
    for (id, lines) in [(&id_a, &lines_a), (&id_b, &lines_b)] {
        let batch = a.wait_final(id, FINISH).await;
        assert_eq!(batch["status"], "completed", "{batch}");
        a.results(&batch).await.assert_each_once(lines);
    }
    let mut by_trace: BTreeMap<String, usize> = BTreeMap::new();
    for r in env.gateway.recent_requests() {
        let traceparent = r
            .header("traceparent")
            .unwrap_or_else(|| panic!("a request without a traceparent: {r:?}"));
        *by_trace.entry(trace_of(traceparent)).or_default() += 1;
    }
    assert_eq!(by_trace.len(), 2, "one trace per batch: {by_trace:?}");
    assert_eq!(
        by_trace.remove(CLIENT_TRACE),
        Some(lines_a.len()),
        "{by_trace:?}"
    );
    assert_eq!(by_trace.into_values().next(), Some(lines_b.len()));
    // The exporter sends within a second or so (OTEL_BSP_SCHEDULE_DELAY).
    eventually(
        "the batch's spans at the collector",
        Duration::from_secs(30),
        || {
            let all: String = collector.seen().iter().map(|d| d.body.as_str()).collect();
            all.contains("ABCDEFGHIJKLMNOP")
                && all.contains("POST /v1/batches")
                && all.contains(&format!("batch {id_a}"))
                && steps.iter().all(|s| all.contains(s))
        },
    )
    .await;
}

/// `observability.otlp_endpoint` at `collector`, spans sent every 200 ms.
fn traced(config: &std::path::Path, collector: &Receiver) -> Service {
    let base = collector.url.trim_end_matches("/hook");
    let mut yaml = std::fs::read_to_string(config).unwrap();
    yaml.push_str(&format!("observability:\n  otlp_endpoint: {base}\n"));
    std::fs::write(config, yaml).unwrap();
    Launch::new(config)
        .env("OTEL_BSP_SCHEDULE_DELAY", "200")
        .env("OTEL_SERVICE_NAME", "batch-processor-test")
        .start()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_async_mode_every_request_carries_its_batchs_traceparent() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = async_service(&env, TWO_TENANTS, "", "");
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let steps = ["validate", "enqueue", "dispatch", "finalize"];
    traces_reach_the_gateway(&env, &config, &steps).await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_sync_mode_every_request_carries_its_batchs_traceparent() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = sync_service(&env, 4, "");
    // Line 0 of each batch has an inference span of its own.
    let steps = ["validate", "dispatch", "inference", "finalize"];
    traces_reach_the_gateway(&env, &config, &steps).await;
}

/// One HTTPS GET of `path` at `addr` (`127.0.0.1:port`) with `key`, trusting only the CA in
/// `ca`: the status, or the error (a refused handshake).
async fn https_get(addr: &str, ca: &std::path::Path, key: &str, path: &str) -> Result<u16, String> {
    use rustls::pki_types::pem::PemObject;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut tls = connector
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {key}\r\nconnection: close\r\n\r\n"
    );
    tls.write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    tls.read_to_end(&mut answer)
        .await
        .map_err(|e| e.to_string())?;
    let head = String::from_utf8_lossy(&answer);
    head.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer: {head}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serve_tls_serves_https_and_takes_a_renewed_certificate_without_a_restart() {
    let env = Env::start(GatewayConfig::default()).await;
    let (first, second) = (env.path("pki-1"), env.path("pki-2"));
    for dir in [&first, &second] {
        std::fs::create_dir_all(dir).unwrap();
    }
    let (old, new) = (
        batch_testkit::TestPki::generate(&first),
        batch_testkit::TestPki::generate(&second),
    );
    // The mounted secret's files, as the service reads them.
    let (cert, key) = (env.path("tls.crt"), env.path("tls.key"));
    std::fs::copy(&old.server_cert, &cert).unwrap();
    std::fs::copy(&old.server_key, &key).unwrap();
    let config = async_service(
        &env,
        TWO_TENANTS,
        &format!(
            "  tls:\n    cert_file: {}\n    key_file: {}\n",
            cert.display(),
            key.display()
        ),
        "",
    );
    let service = Service::start(&config);
    assert!(service.base.starts_with("https://"), "{}", service.base);
    let addr = service.base.trim_start_matches("https://").to_owned();
    assert_eq!(https_get(&addr, &old.ca, KEY_A, "/v1/files").await, Ok(200));
    assert_eq!(
        https_get(&addr, &old.ca, "wrong", "/v1/files").await,
        Ok(401)
    );
    // Not another CA's, and not plain HTTP.
    let refused = https_get(&addr, &new.ca, KEY_A, "/v1/files").await;
    assert!(refused.is_err(), "{refused:?}");
    let plain = tokio::time::timeout(Duration::from_secs(10), async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let request = format!(
            "GET /v1/files HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {KEY_A}\r\n\r\n"
        );
        let _ = tcp.write_all(request.as_bytes()).await;
        let mut answer = Vec::new();
        let _ = tcp.read_to_end(&mut answer).await;
        answer
    })
    .await
    .expect("the plain connection is closed");
    assert!(
        !String::from_utf8_lossy(&plain).contains("HTTP/1.1 200"),
        "plain HTTP answered"
    );

    // A half-written update is not served: the certificate in use stays.
    std::fs::write(&cert, "not a certificate").unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(https_get(&addr, &old.ca, KEY_A, "/v1/files").await, Ok(200));
    // The renewed pair is served within a few seconds, with no restart.
    std::fs::copy(&new.server_key, &key).unwrap();
    std::fs::copy(&new.server_cert, &cert).unwrap();
    let since = Instant::now();
    while https_get(&addr, &new.ca, KEY_A, "/v1/files").await != Ok(200) {
        assert!(
            since.elapsed() < Duration::from_secs(15),
            "the renewed certificate is not served"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let refused = https_get(&addr, &old.ca, KEY_A, "/v1/files").await;
    assert!(refused.is_err(), "{refused:?}");
    assert!(
        service
            .stderr_text()
            .contains("serve.tls: serving the new certificate"),
        "{}",
        service.stderr_text()
    );
}
