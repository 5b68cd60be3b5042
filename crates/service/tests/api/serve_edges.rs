//! The API's edges served in process: oversized ids, file names and form fields, and which
//! `Authorization` schemes carry a key.

use crate::support::*;
use dispatcher_sim::GatewayConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_ids_filenames_and_form_fields_are_refused() {
    let (_env, _service, a) =
        one_tenant("  max_id_bytes: 64\n  max_filename_bytes: 100\n  max_form_field_bytes: 1KiB\n")
            .await;
    let (input, _) = input_jsonl("edge", 2, "llama-3");

    let long_id = format!("file-{}", "x".repeat(60));
    let error = a
        .get(&format!("/v1/files/{long_id}"))
        .await
        .expect_error(400);
    assert_eq!(error["param"], "id", "{error}");
    a.get(&format!("/v1/batches/batch_{}", "y".repeat(100)))
        .await
        .expect_error(400);
    // At the limit, an unknown id is just not found.
    a.get(&format!("/v1/files/file-{}", "x".repeat(59)))
        .await
        .expect_error(404);

    let long_name = format!("{}.jsonl", "n".repeat(100));
    let error = a
        .upload(&long_name, input.as_bytes(), None)
        .await
        .expect_error(400);
    assert_eq!(error["param"], "file", "{error}");
    let name = format!("{}.jsonl", "n".repeat(94));
    let ok = a.upload(&name, input.as_bytes(), None).await.expect(200);
    assert_eq!(ok["filename"], name.as_str());

    let big_field = vec![b'b'; 1025];
    let error = a
        .post_multipart(
            "/v1/files",
            &[
                ("purpose", None, &big_field),
                ("file", Some("x.jsonl"), input.as_bytes()),
            ],
        )
        .await
        .expect_error(400);
    assert_eq!(error["param"], "purpose", "{error}");
    assert_eq!(a.list_all("/v1/files", "", 100).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_a_bearer_scheme_in_any_case_carries_a_key() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = async_service(&env, ONE_TENANT, "", "");
    let service = Service::start(&config).await;
    let anonymous = service.client(None);
    let with = |value: String| {
        let anonymous = anonymous.clone();
        async move {
            anonymous
                .send(
                    hyper::Method::GET,
                    "/v1/batches",
                    &[("authorization", &value)],
                    bytes::Bytes::new(),
                )
                .await
        }
    };
    for accepted in [
        format!("Bearer {KEY_A}"),
        format!("bearer {KEY_A}"),
        format!("BEARER {KEY_A}"),
    ] {
        with(accepted.clone()).await.expect(200);
    }
    for refused in [
        KEY_A.to_owned(),
        format!("Basic {KEY_A}"),
        format!("Bearer{KEY_A}"),
        "Bearer ".to_owned(),
    ] {
        let error = with(refused).await.expect_error(401);
        assert!(
            error["message"].as_str().unwrap().contains("Bearer"),
            "{error}"
        );
    }
}
