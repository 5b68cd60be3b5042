//! The Files and Batches API served in process: routes, pages and tenants kept apart, errors in
//! OpenAI's shape, cancels, expiry, quotas, sync mode without keys.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::support::*;
use dispatcher_sim::GatewayConfig;
use serde_json::{json, Value};

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
    let service = Service::start(&config).await;
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
    let service = Service::start(&config).await;
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
    let service = Service::start(&config).await;
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

/// `serve.tenant_max_requests_in_flight` in sync mode: one tenant's two batches have at most that
/// many requests at the gateway together, and another tenant's batch runs beside them with its
/// own share.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenants_requests_in_flight_are_capped_while_another_tenant_runs() {
    let env = Env::start(slow_gateway()).await;
    let config = sync_service(&env, 32, "  tenant_max_requests_in_flight: 3\n");
    let service = Service::start(&config).await;
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
