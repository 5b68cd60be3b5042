//! `processor serve` end to end: its OpenAI-style HTTP API (files, batches, pagination, errors,
//! tenants, live counts, cancel, expiry of batches and files), `kill -9`, SIGTERM and SIGINT in
//! the middle of jobs (every line exactly once after a restart, every file and batch listed as
//! before), a Redis outage, and 200 batches at once from five tenants. Real redis-server, the
//! simulated dispatcher and gateway in-process, the `processor` binary; two tests in sync mode.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use dispatcher_sim::GatewayConfig;
use serde_json::{json, Value};
use support::batches::*;
use support::serve::*;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn file_routes_paginate_and_keep_tenants_apart() {
    let (_env, service, a) = two_tenants(GatewayConfig::default(), "").await;
    let b = service.client(Some(KEY_B));

    let mut uploaded = Vec::new();
    for i in 0..6 {
        let (text, _) = input_jsonl(&format!("f{i}"), 2 + i, "llama-3");
        let name = format!("in-{i}.jsonl");
        let expires = (i == 5).then_some(3600);
        let resp = a.upload(&name, text.as_bytes(), expires).await;
        has_request_id(&resp);
        let file = resp.expect(200);
        assert!(id_of(&file).starts_with("file-"), "{file}");
        assert_eq!(file["object"], "file");
        assert_eq!(file["bytes"], text.len());
        assert_eq!(file["filename"], name);
        assert_eq!(file["purpose"], "batch");
        let created = file["created_at"].as_u64().expect("created_at");
        if i == 5 {
            assert_eq!(file["expires_at"], created + 3600, "{file}");
        }
        let again = a
            .get(&format!("/v1/files/{}", id_of(&file)))
            .await
            .expect(200);
        assert_eq!(file_identity(&again), file_identity(&file));
        let content = a.get(&format!("/v1/files/{}/content", id_of(&file))).await;
        assert_eq!(content.status, 200, "{}", content.text());
        assert_eq!(
            content.text(),
            text,
            "the content is the upload, byte for byte"
        );
        uploaded.push(id_of(&file));
    }
    let (b_text, _) = input_jsonl("b", 3, "llama-3");
    let b_file = b.upload_ok("b.jsonl", b_text.as_bytes()).await;
    let mut newest_first = uploaded.clone();
    newest_first.reverse();

    // Whole lists, one item per page and all at once, both orders; the default is desc.
    assert_eq!(
        ids(&a.list_all("/v1/files", "order=asc", 1).await),
        uploaded
    );
    assert_eq!(
        ids(&a.list_all("/v1/files", "order=asc", 4).await),
        uploaded
    );
    assert_eq!(
        ids(&a.list_all("/v1/files", "order=desc", 2).await),
        newest_first
    );
    assert_eq!(ids(&a.list_all("/v1/files", "", 100).await), newest_first);
    assert_eq!(
        ids(&b.list_all("/v1/files", "", 100).await),
        vec![b_file.clone()]
    );

    // One page: the cursor fields.
    let page = a.get("/v1/files?order=asc&limit=2").await.expect(200);
    assert_eq!(page["object"], "list");
    assert_eq!(ids(page["data"].as_array().unwrap()), uploaded[..2]);
    assert_eq!(page["has_more"], true);
    assert_eq!(page["first_id"], uploaded[0]);
    assert_eq!(page["last_id"], uploaded[1]);
    let page = a
        .get(&format!(
            "/v1/files?order=asc&limit=2&after={}",
            uploaded[1]
        ))
        .await
        .expect(200);
    assert_eq!(ids(page["data"].as_array().unwrap()), uploaded[2..4]);
    assert_eq!(page["has_more"], true);
    // A page that holds exactly the rest says there is no more.
    let page = a
        .get(&format!(
            "/v1/files?order=asc&limit=2&after={}",
            uploaded[3]
        ))
        .await
        .expect(200);
    assert_eq!(ids(page["data"].as_array().unwrap()), uploaded[4..]);
    assert_eq!(page["has_more"], false, "{page}");
    let page = a.get("/v1/files?limit=6").await.expect(200);
    assert_eq!(page["data"].as_array().unwrap().len(), 6);
    assert_eq!(page["has_more"], false, "{page}");
    // After the last one: an empty last page.
    let page = a
        .get(&format!("/v1/files?order=asc&after={}", uploaded[5]))
        .await
        .expect(200);
    assert_eq!(page["data"], json!([]), "{page}");
    assert_eq!(page["has_more"], false, "{page}");
    // `after` as a number of files to skip (the batch gateway's form), with the same cursor fields.
    a.expect_page("/v1/files?order=asc&limit=2&after=2", &uploaded[2..4], true)
        .await;
    a.expect_page("/v1/files?limit=4&after=2", &newest_first[2..], false)
        .await;
    a.expect_page("/v1/files?after=6", &[], false).await;
    // An id that names no file of this listing is refused, named, not a page that starts over.
    for cursor in ["file-doesnotexist", b_file.as_str(), "-1"] {
        a.expect_unknown_cursor("/v1/files", cursor).await;
    }
    // Purpose filter: no batch has run, so no output files.
    assert_eq!(a.list_all("/v1/files", "purpose=batch", 100).await.len(), 6);
    assert!(a
        .list_all("/v1/files", "purpose=batch_output", 100)
        .await
        .is_empty());
    // Bad list parameters.
    a.get("/v1/files?limit=0").await.expect_error(400);
    a.get("/v1/files?order=sideways").await.expect_error(400);

    // Another tenant's file does not exist for this one.
    let theirs = &uploaded[2];
    for resp in [
        b.get(&format!("/v1/files/{theirs}")).await,
        b.get(&format!("/v1/files/{theirs}/content")).await,
        b.delete(&format!("/v1/files/{theirs}")).await,
        a.get(&format!("/v1/files/{b_file}")).await,
        a.get("/v1/files/file-doesnotexist").await,
    ] {
        has_request_id(&resp);
        resp.expect_error(404);
    }
    a.get(&format!("/v1/files/{theirs}")).await.expect(200);

    // Delete.
    let gone = &uploaded[0];
    let deleted = a.delete(&format!("/v1/files/{gone}")).await.expect(200);
    assert_eq!(
        deleted,
        json!({"id": gone, "object": "file", "deleted": true})
    );
    a.get(&format!("/v1/files/{gone}")).await.expect_error(404);
    a.get(&format!("/v1/files/{gone}/content"))
        .await
        .expect_error(404);
    a.delete(&format!("/v1/files/{gone}"))
        .await
        .expect_error(404);
    assert_eq!(
        ids(&a.list_all("/v1/files", "order=asc", 2).await),
        uploaded[1..]
    );

    // x-request-id is echoed when sent.
    let resp = a
        .send(
            hyper::Method::GET,
            "/v1/files",
            &[("x-request-id", "servetests-echo-42")],
            Default::default(),
        )
        .await;
    assert_eq!(resp.headers["x-request-id"], "servetests-echo-42");
}

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

/// Requests the web framework itself refuses (not a form, not a number) get the same error
/// shape as the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn malformed_forms_and_queries_get_openai_errors_too() {
    let (_env, _service, a) = two_tenants(GatewayConfig::default(), "").await;
    let mut wrong = Vec::new();
    for (what, resp) in [
        (
            "POST /v1/files with a JSON body",
            a.post_json("/v1/files", &json!({"purpose": "batch"})).await,
        ),
        (
            "GET /v1/files?limit=many",
            a.get("/v1/files?limit=many").await,
        ),
        (
            "GET /v1/batches?limit=many",
            a.get("/v1/batches?limit=many").await,
        ),
    ] {
        let shaped = serde_json::from_slice::<Value>(&resp.body)
            .is_ok_and(|b| b["error"]["message"].is_string() && b["error"]["type"].is_string());
        if resp.status != 400 || !shaped {
            wrong.push(format!("{what}: {} {}", resp.status, resp.text()));
        }
    }
    assert!(
        wrong.is_empty(),
        "not a 400 with an error object:\n{}",
        wrong.join("\n")
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
async fn a_batch_cancelled_while_queued_never_runs() {
    // One job at a time, and the first waits at the closed gate: the second stays queued.
    let (env, _service, a) = two_tenants(GatewayConfig::default(), "  max_active_jobs: 1\n").await;
    let sim = gated_dispatcher(&env).await;
    let (text, lines) = input_jsonl("first", 20, "llama-3");
    let (queued_text, _) = input_jsonl("queued", 20, "llama-3");
    let file = a.upload_ok("first.jsonl", text.as_bytes()).await;
    let queued_file = a.upload_ok("queued.jsonl", queued_text.as_bytes()).await;
    let first = id_of(&a.create_batch_ok(&file).await);
    a.wait_batch(&first, FINISH, "in_progress", |b| {
        b["status"] == "in_progress"
    })
    .await;
    let queued = id_of(&a.create_batch_ok(&queued_file).await);
    a.post_empty(&format!("/v1/batches/{queued}/cancel"))
        .await
        .expect(200);
    let cancelled = a.wait_final(&queued, FINISH).await;
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    assert!(cancelled["cancelled_at"].as_u64().is_some(), "{cancelled}");
    assert_eq!(count(&cancelled, "completed"), 0, "{cancelled}");
    assert!(cancelled["output_file_id"].is_null(), "{cancelled}");
    // The first one was not disturbed, and completes.
    assert_eq!(a.batch(&first).await["status"], "in_progress");
    gate(&env, true);
    let done = a.wait_final(&first, FINISH).await;
    assert_eq!(done["status"], "completed", "{done}");
    a.results(&done).await.assert_each_once(&lines);
    // Nothing of the cancelled batch reached the gateway.
    assert_eq!(env.gateway.stats().total, 20);
    assert_eq!(a.batch(&queued).await["status"], "cancelled");
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
async fn an_invalid_input_fails_the_batch_naming_every_bad_line() {
    let (env, _service, a) = two_tenants(GatewayConfig::default(), "").await;
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let line = |custom_id: Option<&str>, method: &str| {
        let mut l = json!({
            "method": method, "url": "/v1/chat/completions",
            "body": {"model": "llama-3", "messages": [{"role": "user", "content": "hi"}]}
        });
        if let Some(c) = custom_id {
            l["custom_id"] = json!(c);
        }
        l.to_string()
    };
    let text = [
        line(Some("a"), "POST"),
        line(None, "POST"), // 2: no custom_id
        line(Some("b"), "POST"),
        line(Some("b"), "POST"),       // 4: a duplicate custom_id
        line(Some("c"), "GET"),        // 5: not POST
        "this is not json".to_owned(), // 6
        line(Some("d"), "POST"),
        // 8: an allowed url, but not the batch's endpoint
        line(Some("e"), "POST").replace("/v1/chat/completions", "/v1/completions"),
    ]
    .join("\n")
        + "\n";
    let file = a.upload_ok("invalid.jsonl", text.as_bytes()).await;
    let id = id_of(&a.create_batch_ok(&file).await);
    let batch = a.wait_final(&id, FINISH).await;
    assert_eq!(batch["status"], "failed", "{batch}");
    assert!(batch["failed_at"].as_u64().is_some(), "{batch}");
    let errors = batch["errors"]["data"].as_array().expect("errors.data");
    let bad: BTreeSet<u64> = errors
        .iter()
        .map(|e| {
            assert!(e["code"].is_string() && e["message"].is_string(), "{e}");
            e["line"].as_u64().unwrap_or_else(|| panic!("no line: {e}"))
        })
        .collect();
    assert_eq!(bad, BTreeSet::from([2, 4, 5, 6, 8]), "{batch}");
    let mismatch = errors.iter().find(|e| e["line"] == 8).unwrap();
    assert_eq!(mismatch["code"], "url_mismatch", "{mismatch}");
    assert_eq!(mismatch["param"], "url", "{mismatch}");
    assert!(batch["output_file_id"].is_null(), "{batch}");
    // Nothing was sent.
    assert_eq!(env.gateway.stats().total, 0);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_list_newest_first_page_by_page_per_tenant() {
    let (env, service, a) = two_tenants(GatewayConfig::default(), "").await;
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let b = service.client(Some(KEY_B));
    // One line of the first batch names a model no gateway serves.
    let (mut first_text, mut first_lines) = input_jsonl("first", 4, "llama-3");
    let (ghost_text, ghost_lines) = input_jsonl("ghost", 1, "ghost");
    first_text.push_str(&ghost_text);
    first_lines.extend(ghost_lines);
    let (text, _) = input_jsonl("list", 3, "llama-3");
    let first_file = a.upload_ok("first.jsonl", first_text.as_bytes()).await;
    let file = a.upload_ok("list.jsonl", text.as_bytes()).await;
    let mut created = vec![id_of(&a.create_batch_ok(&first_file).await)];
    for _ in 1..5 {
        created.push(id_of(&a.create_batch_ok(&file).await));
    }
    let mut newest_first = created.clone();
    newest_first.reverse();

    let page = a.get("/v1/batches?limit=2").await.expect(200);
    assert_eq!(page["object"], "list");
    assert_eq!(ids(page["data"].as_array().unwrap()), newest_first[..2]);
    assert_eq!(page["has_more"], true);
    assert_eq!(page["first_id"], newest_first[0]);
    assert_eq!(page["last_id"], newest_first[1]);
    let page = a
        .get(&format!("/v1/batches?limit=2&after={}", newest_first[1]))
        .await
        .expect(200);
    assert_eq!(ids(page["data"].as_array().unwrap()), newest_first[2..4]);
    assert_eq!(page["has_more"], true);
    let page = a
        .get(&format!("/v1/batches?limit=2&after={}", newest_first[3]))
        .await
        .expect(200);
    assert_eq!(ids(page["data"].as_array().unwrap()), newest_first[4..]);
    assert_eq!(page["has_more"], false, "{page}");
    let page = a.get("/v1/batches?limit=5").await.expect(200);
    assert_eq!(ids(page["data"].as_array().unwrap()), newest_first);
    assert_eq!(page["has_more"], false, "{page}");
    let page = a
        .get(&format!("/v1/batches?after={}", newest_first[4]))
        .await
        .expect(200);
    assert_eq!(page["data"], json!([]), "{page}");
    assert_eq!(page["has_more"], false, "{page}");
    // The same pages by offset.
    a.expect_page("/v1/batches?limit=2&after=2", &newest_first[2..4], true)
        .await;
    a.expect_page("/v1/batches?limit=2&after=3", &newest_first[3..], false)
        .await;
    a.expect_page("/v1/batches?after=5", &[], false).await;
    // Another tenant's batch, or none, is no cursor.
    b.expect_unknown_cursor("/v1/batches", &newest_first[0])
        .await;
    a.expect_unknown_cursor("/v1/batches", "batch_doesnotexist")
        .await;
    assert_eq!(ids(&a.list_all("/v1/batches", "", 1).await), newest_first);
    assert_eq!(ids(&a.list_all("/v1/batches", "", 20).await), newest_first);
    assert!(b.list_all("/v1/batches", "", 20).await.is_empty());

    for id in &created {
        let batch = a.wait_final(id, FINISH).await;
        assert_eq!(batch["status"], "completed", "{batch}");
        b.get(&format!("/v1/batches/{id}")).await.expect_error(404);
    }
    // The first batch's unserved line is its error file's only line.
    let first = a.batch(&created[0]).await;
    assert_eq!(count(&first, "completed"), 4, "{first}");
    assert_eq!(count(&first, "failed"), 1, "{first}");
    assert_eq!(x_count(&first, "errored"), 1, "{first}");
    let results = a.results(&first).await;
    results.assert_each_once_with_errors(&first_lines, "model_not_found", 1);
    assert_eq!(results.error[0]["custom_id"], "ghost-0");
    let errors = a.get(&format!("/v1/batches/{}/errors", created[0])).await;
    assert_eq!(errors.jsonl(), results.error);
    // Every completed batch has its output file, listed among the tenant's files.
    let outputs = ids(&a.list_all("/v1/files", "purpose=batch_output", 3).await);
    assert_eq!(
        outputs.len(),
        6,
        "5 output files and 1 error file: {outputs:?}"
    );
    assert!(b
        .list_all("/v1/files", "purpose=batch_output", 3)
        .await
        .is_empty());
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
async fn expired_files_are_deleted_and_their_batches_stay_listed() {
    let (env, _service, a) = two_tenants(GatewayConfig::default(), "").await;
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let storage = env.path("storage");
    let (short_text, short_lines) = input_jsonl("short-lived", 3, "llama-3");
    let (kept_text, kept_lines) = input_jsonl("kept", 3, "llama-3");
    let short = a
        .upload("short.jsonl", short_text.as_bytes(), Some(1))
        .await
        .expect(200);
    let short_id = id_of(&short);
    assert_eq!(
        short["expires_at"],
        short["created_at"].as_u64().unwrap() + 1,
        "{short}"
    );
    let batch = id_of(&a.create_batch_ok(&short_id).await);
    let kept = a.upload_ok("kept.jsonl", kept_text.as_bytes()).await;
    // The output of this one expires a second after the batch was created.
    let outlived = a
        .post_json(
            "/v1/batches",
            &json!({
                "input_file_id": kept, "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "output_expires_after": {"anchor": "created_at", "seconds": 1}
            }),
        )
        .await
        .expect(200);
    let outlived = id_of(&outlived);
    assert!(
        !stored_copies(&storage, kept_text.as_bytes()).is_empty(),
        "the storage directory holds no copy of the upload"
    );

    let done = a.wait_final(&batch, FINISH).await;
    assert_eq!(done["status"], "completed", "{done}");
    a.results(&done).await.assert_each_once(&short_lines);
    let done_outlived = a.wait_final(&outlived, FINISH).await;
    assert_eq!(done_outlived["status"], "completed", "{done_outlived}");
    let output_id = done_outlived["output_file_id"].as_str().unwrap().to_owned();

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let input_gone = a.get(&format!("/v1/files/{short_id}")).await.status == 404;
        let output_gone = a.get(&format!("/v1/files/{output_id}")).await.status == 404;
        if input_gone && output_gone {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not expired within 60 s: input {input_gone}, output {output_gone}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    a.get(&format!("/v1/files/{short_id}/content"))
        .await
        .expect_error(404);
    a.get(&format!("/v1/files/{output_id}/content"))
        .await
        .expect_error(404);
    eventually(
        "the expired object leaves storage",
        Duration::from_secs(30),
        || stored_copies(&storage, short_text.as_bytes()).is_empty(),
    )
    .await;
    let listed = ids(&a.list_all("/v1/files", "", 100).await);
    assert!(
        !listed.contains(&short_id) && !listed.contains(&output_id),
        "{listed:?}"
    );
    assert!(listed.contains(&kept), "{listed:?}");
    // The file without an expiry stays, whole.
    let content = a.get(&format!("/v1/files/{kept}/content")).await;
    assert_eq!(content.text(), kept_text);
    assert!(!stored_copies(&storage, kept_text.as_bytes()).is_empty());
    // The batches stay.
    assert_eq!(
        ids(&a.list_all("/v1/batches", "", 100).await),
        vec![outlived.clone(), batch.clone()]
    );
    assert_eq!(a.batch(&batch).await["status"], "completed");
    assert_eq!(a.batch(&outlived).await["status"], "completed");
    let _ = kept_lines;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_batches_at_once_from_five_tenants_all_complete() {
    const TENANTS: usize = 5;
    const PER_TENANT: usize = 40;
    let env = Env::start(GatewayConfig::default()).await;
    let keys: Vec<(String, String)> = (0..TENANTS)
        .map(|t| (format!("sk-tenant-{t}-key"), format!("tenant-{t}")))
        .collect();
    let key_refs: Vec<(&str, &str)> = keys.iter().map(|(k, t)| (k.as_str(), t.as_str())).collect();
    let config = async_service(&env, &key_refs, "", "");
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let service = Service::start(&config);
    let clients: Vec<Api> = keys.iter().map(|(k, _)| service.client(Some(k))).collect();

    let mut tasks = Vec::new();
    for (t, client) in clients.iter().enumerate() {
        for j in 0..PER_TENANT {
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                let prefix = format!("t{t}-b{j}");
                let (text, lines) = input_jsonl(&prefix, 5, "llama-3");
                let file = client
                    .upload_ok(&format!("{prefix}.jsonl"), text.as_bytes())
                    .await;
                let batch = id_of(&client.create_batch_ok(&file).await);
                (t, batch, lines)
            }));
        }
    }
    let mut created: Vec<BTreeMap<String, Vec<String>>> = vec![BTreeMap::new(); TENANTS];
    for task in tasks {
        let (t, batch, lines) = task.await.unwrap();
        created[t].insert(batch, lines);
    }

    let deadline = Instant::now() + Duration::from_secs(300);
    for (t, client) in clients.iter().enumerate() {
        loop {
            let listed = client.list_all("/v1/batches", "", 100).await;
            let listed_ids: BTreeSet<String> = ids(&listed).into_iter().collect();
            let own: BTreeSet<String> = created[t].keys().cloned().collect();
            assert_eq!(
                listed_ids, own,
                "tenant {t} lists other batches than its own"
            );
            let unfinished = listed.iter().filter(|b| b["status"] != "completed").count();
            if unfinished == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "tenant {t}: {unfinished} batches not completed within 300 s"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    for (t, client) in clients.iter().enumerate() {
        for (id, lines) in &created[t] {
            let batch = client.batch(id).await;
            assert_eq!(count(&batch, "completed"), 5, "{batch}");
            client.results(&batch).await.assert_each_once(lines);
        }
        // The default page is 20 batches.
        let page = client.get("/v1/batches").await.expect(200);
        assert_eq!(page["data"].as_array().unwrap().len(), 20, "{page}");
        assert_eq!(page["has_more"], true);
        // Its files: its 40 inputs and their 40 outputs, nobody else's.
        let inputs = client.list_all("/v1/files", "purpose=batch", 100).await;
        let outputs = client
            .list_all("/v1/files", "purpose=batch_output", 100)
            .await;
        assert_eq!((inputs.len(), outputs.len()), (PER_TENANT, PER_TENANT));
        for f in &inputs {
            let name = f["filename"].as_str().unwrap();
            assert!(name.starts_with(&format!("t{t}-")), "tenant {t} lists {f}");
        }
    }
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_sync_mode_without_keys_a_batch_completes_for_the_default_tenant() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = env.sync_config(
        &["llama-3"],
        "",
        &format!("redis_url_file: {}\n", env.redis_url_file.display()),
    );
    let storage = env.path("storage");
    std::fs::create_dir_all(&storage).unwrap();
    add_serve_section(&config, &storage, &[], "", "");
    let service = Service::start(&config);
    let api = service.client(None);
    let (_, id, lines) = submit(&api, "sync", 50).await;
    let batch = api.wait_final(&id, FINISH).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    assert_eq!(count(&batch, "completed"), 50);
    let results = api.results(&batch).await;
    results.assert_answered(&lines);
    assert!(env.gateway.stats().total >= 50);
    // A last line without its newline is a line.
    let (text, lines) = input_jsonl("unterminated", 3, "llama-3");
    let file = api
        .upload_ok("unterminated.jsonl", text.trim_end().as_bytes())
        .await;
    let id2 = id_of(&api.create_batch_ok(&file).await);
    let batch = api.wait_final(&id2, FINISH).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    api.results(&batch).await.assert_each_once(&lines);
    // A key is ignored, not refused: every request is the default tenant's.
    let keyed = service.client(Some("sk-anything"));
    assert_eq!(
        ids(&keyed.list_all("/v1/batches", "", 10).await),
        vec![id2, id]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_over_its_quotas_is_refused_while_another_tenants_batch_starts() {
    let env = Env::start(GatewayConfig::default()).await;
    let (small, _) = input_jsonl("small", 10, "llama-3");
    let (big, _) = input_jsonl("big", 60, "llama-3");
    let bytes_quota = small.len() + big.len() - 1;
    let config = async_service(
        &env,
        TWO_TENANTS,
        &format!(
            "  max_active_jobs: 2\n  tenant_max_running_batches: 1\n  tenant_max_batches: 3\n  tenant_max_files: 2\n  tenant_max_stored_bytes: {bytes_quota}\n"
        ),
        "",
    );
    let sim = gated_dispatcher(&env).await;
    let service = Service::start(&config);
    let a = service.client(Some(KEY_A));
    let b = service.client(Some(KEY_B));
    let says = |error: &Value, quota: &str| {
        assert!(
            error["message"].as_str().unwrap().contains(quota),
            "{error}"
        );
        assert_eq!(error["code"], "insufficient_quota", "{error}");
    };

    // Files: two, then a 429 naming the quota.
    let file = a.upload_ok("a1.jsonl", small.as_bytes()).await;
    a.upload_ok("a2.jsonl", small.as_bytes()).await;
    let over = a.upload("a3.jsonl", small.as_bytes(), None).await;
    says(&over.expect_error(429), "tenant_max_files");
    // Stored bytes: B's second file would pass them.
    let b_file = b.upload_ok("b1.jsonl", small.as_bytes()).await;
    let over = b.upload("b2.jsonl", big.as_bytes(), None).await;
    says(&over.expect_error(429), "tenant_max_stored_bytes");
    assert_eq!(b.list_all("/v1/files", "", 100).await.len(), 1);

    // Batches: A runs two (no other tenant waits), queues a third, and is refused a fourth.
    let a1 = id_of(&a.create_batch_ok(&file).await);
    let a2 = id_of(&a.create_batch_ok(&file).await);
    for id in [&a1, &a2] {
        a.wait_batch(id, FINISH, "in_progress", |b| b["status"] == "in_progress")
            .await;
    }
    let a3 = id_of(&a.create_batch_ok(&file).await);
    let over = a.create_batch(&file, "24h").await;
    says(&over.expect_error(429), "tenant_max_batches");

    // B's batch, queued after A's third, takes the next free slot: A already runs its share.
    let b1 = id_of(&b.create_batch_ok(&b_file).await);
    a.cancel(&a1).await;
    b.wait_batch(&b1, FINISH, "in_progress", |b| b["status"] == "in_progress")
        .await;
    assert_ne!(a.batch(&a3).await["status"], "in_progress");

    // Ended batches leave the quota: A may create again.
    gate(&env, true);
    for id in [&a2, &a3] {
        assert_eq!(a.wait_final(id, FINISH).await["status"], "completed");
    }
    assert_eq!(b.wait_final(&b1, FINISH).await["status"], "completed");
    let again = id_of(&a.create_batch_ok(&file).await);
    assert_eq!(a.wait_final(&again, FINISH).await["status"], "completed");
    sim.shutdown().await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn downloads_are_named_as_the_batch_gateway_names_them_and_cancel_follows_openai() {
    let (env, service, a) = two_tenants(GatewayConfig::default(), "").await;
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let (mut text, _) = input_jsonl("named", 3, "llama-3");
    text.push_str(&input_jsonl("ghost", 1, "ghost").0);
    let upload = a
        .upload("named input.jsonl", text.as_bytes(), None)
        .await
        .expect(200);
    // A new upload is `processed`: it was checked line by line before the answer.
    assert_eq!(upload["status"], "processed", "{upload}");
    let file = id_of(&upload);
    let content = a.get(&format!("/v1/files/{file}/content")).await;
    assert_eq!(content.status, 200);
    assert_eq!(
        content.headers["content-disposition"],
        "attachment; filename=\"named input.jsonl\""
    );

    let id = id_of(&a.create_batch_ok(&file).await);
    let batch = a.wait_final(&id, FINISH).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    for (field, name) in [
        ("output_file_id", format!("batch_output_{id}.jsonl")),
        ("error_file_id", format!("batch_error_{id}.jsonl")),
    ] {
        let fid = batch[field].as_str().expect(field);
        let meta = a.get(&format!("/v1/files/{fid}")).await.expect(200);
        assert_eq!(meta["filename"], name.as_str(), "{meta}");
        assert_eq!(meta["status"], "processed", "{meta}");
        let content = a.get(&format!("/v1/files/{fid}/content")).await;
        assert_eq!(content.status, 200);
        assert_eq!(
            content.headers["content-disposition"],
            format!("attachment; filename=\"{name}\"").as_str()
        );
    }

    // A batch that already ended cannot be cancelled: OpenAI's 400.
    let e = a
        .post_empty(&format!("/v1/batches/{id}/cancel"))
        .await
        .expect_error(400);
    assert_eq!(e["type"], "invalid_request_error", "{e}");
    assert!(e["message"].as_str().unwrap().contains("completed"), "{e}");
    // Another tenant's batch is a 404, not a 400.
    service
        .client(Some(KEY_B))
        .post_empty(&format!("/v1/batches/{id}/cancel"))
        .await
        .expect_error(404);
    sim.shutdown().await;
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

/// `serve.tenant_max_requests_in_flight` in sync mode: one tenant's two batches have at most that
/// many requests at the gateway together, and another tenant's batch runs beside them with its
/// own share.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenants_requests_in_flight_are_capped_while_another_tenant_runs() {
    let env = Env::start(slow_gateway()).await;
    let config = sync_service(&env, 32, "  tenant_max_requests_in_flight: 3\n");
    let service = Service::start(&config);
    let (a, b) = (service.client(Some(KEY_A)), service.client(Some(KEY_B)));
    let mut alone = Vec::new();
    for name in ["a1", "a2"] {
        alone.push(submit(&a, name, 24).await);
    }
    for (_, id, lines) in &alone {
        let batch = a.wait_final(id, FINISH).await;
        assert_eq!(batch["status"], "completed", "{batch}");
        a.results(&batch).await.assert_each_once(lines);
    }
    // Without the cap the two batches would have had up to 32 at once.
    assert_eq!(env.gateway.stats().max_in_flight_seen, 3);

    let (_, with_a, a_lines) = submit(&a, "a3", 24).await;
    let (_, with_b, b_lines) = submit(&b, "b1", 24).await;
    for (api, id, lines) in [(&a, &with_a, &a_lines), (&b, &with_b, &b_lines)] {
        let batch = api.wait_final(id, FINISH).await;
        assert_eq!(batch["status"], "completed", "{batch}");
        api.results(&batch).await.assert_each_once(lines);
    }
    let most = env.gateway.stats().max_in_flight_seen;
    assert!(
        (4..=6).contains(&most),
        "{most} at once: tenant B did not run beside tenant A with a share of its own"
    );
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
