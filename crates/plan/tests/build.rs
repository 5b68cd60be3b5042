//! Planning real files: validation across lines, ordering, limits, positioned reads.

use std::path::Path;

use batch_plan::{Limits, Plan, PlanError, NO_PREFIX};
use batch_testkit::tempdir;

fn line(custom_id: &str, model: &str, system: Option<&str>) -> String {
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    messages.push(serde_json::json!({"role": "user", "content": format!("question {custom_id}")}));
    serde_json::json!({
        "custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "messages": messages}
    })
    .to_string()
}

fn write(dir: &Path, lines: &[String], trailing_newline: bool) -> std::path::PathBuf {
    let path = dir.join("input.jsonl");
    let mut text = lines.join("\n");
    if trailing_newline {
        text.push('\n');
    }
    std::fs::write(&path, text).unwrap();
    path
}

fn invalid(result: Result<Plan, PlanError>) -> Vec<(Option<u64>, String)> {
    match result {
        Err(PlanError::Invalid(errors)) => errors.into_iter().map(|e| (e.line, e.code)).collect(),
        other => panic!("expected validation errors, got {other:?}"),
    }
}

#[test]
fn plans_per_model_grouped_by_prompt_and_stable() {
    let dir = tempdir().unwrap();
    let lines = vec![
        line("a", "zeta", Some("P2")),
        line("b", "alpha", None),
        line("c", "zeta", Some("P1")),
        line("d", "zeta", Some("P2")),
        line("e", "zeta", Some("P1")),
        line("f", "alpha", Some("P1")),
    ];
    let input = write(dir.path(), &lines, true);
    let plan = Plan::build(&input, &dir.path().join("plan"), Limits::default()).unwrap();
    assert_eq!(plan.total(), 6);
    assert_eq!(plan.endpoint(), Some("/v1/chat/completions"));
    let names: Vec<_> = plan.models().iter().map(|m| m.model.as_str()).collect();
    assert_eq!(names, ["alpha", "zeta"], "models in name order");

    let zeta = &plan.models()[1];
    let records: Vec<_> = plan.records(zeta).unwrap().map(Result::unwrap).collect();
    let h1 = batch_wire::hash::fnv1a_32(b"P1");
    let h2 = batch_wire::hash::fnv1a_32(b"P2");
    let mut expected = vec![(h1, 2), (h1, 4), (h2, 0), (h2, 3)];
    expected.sort();
    let got: Vec<_> = records.iter().map(|r| (r.prefix_hash, r.line)).collect();
    assert_eq!(got, expected, "sorted by hash, then input order");

    let alpha: Vec<_> = plan
        .records(&plan.models()[0])
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(alpha.iter().any(|r| r.prefix_hash == NO_PREFIX));

    // Positioned reads give back each line exactly.
    let input_file = plan.open_input().unwrap();
    for r in records.iter().chain(&alpha) {
        let bytes = input_file.read(r).unwrap();
        assert_eq!(String::from_utf8(bytes).unwrap(), lines[r.line as usize]);
        assert_eq!(
            plan.custom_ids().get(r.line as usize).unwrap(),
            ["a", "b", "c", "d", "e", "f"][r.line as usize]
        );
    }

    // A second run plans the same order.
    let again = Plan::build(&input, &dir.path().join("plan2"), Limits::default()).unwrap();
    let again: Vec<_> = again
        .records(&again.models()[1])
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(again, records);
}

#[test]
fn names_every_bad_line() {
    let dir = tempdir().unwrap();
    let lines = vec![
        line("a", "m", None),
        "not json".to_owned(),
        line("a", "m", None),
        r#"{"custom_id":"x","method":"GET","url":"/v1/chat/completions","body":{"model":"m"}}"#
            .to_owned(),
        r#"{"custom_id":"y","method":"POST","url":"/v1/chat/completions","body":{"model":"m","stream":true}}"#
            .to_owned(),
        String::new(),
        line("z", "m", None),
    ];
    let input = write(dir.path(), &lines, true);
    let errors = invalid(Plan::build(
        &input,
        &dir.path().join("plan"),
        Limits::default(),
    ));
    assert_eq!(
        errors,
        [
            (Some(2), "invalid_json_line".to_owned()),
            (Some(3), "duplicate_custom_id".to_owned()),
            (Some(4), "invalid_method".to_owned()),
            (Some(5), "invalid_request".to_owned()),
            (Some(6), "invalid_json_line".to_owned()),
        ]
    );
    assert!(!dir.path().join("plan").exists(), "nothing planned");
}

#[test]
fn one_trailing_newline_adds_nothing_and_crlf_is_fine() {
    let dir = tempdir().unwrap();
    let input = dir.path().join("crlf.jsonl");
    std::fs::write(
        &input,
        format!("{}\r\n{}\r\n", line("a", "m", None), line("b", "m", None)),
    )
    .unwrap();
    let plan = Plan::build(&input, &dir.path().join("plan"), Limits::default()).unwrap();
    assert_eq!(plan.total(), 2);
    let input_no_newline = write(dir.path(), &[line("a", "m", None)], false);
    assert_eq!(
        Plan::build(&input_no_newline, &dir.path().join("p2"), Limits::default())
            .unwrap()
            .total(),
        1
    );
}

#[test]
fn enforces_limits_and_refuses_empty_files() {
    let dir = tempdir().unwrap();
    let lines: Vec<_> = (0..5).map(|i| line(&format!("r{i}"), "m", None)).collect();
    let input = write(dir.path(), &lines, true);
    let few = Limits {
        max_requests: 3,
        ..Limits::default()
    };
    assert_eq!(
        invalid(Plan::build(&input, &dir.path().join("p"), few)),
        [(Some(4), "too_many_requests_in_file".to_owned())]
    );
    let small = Limits {
        max_file_bytes: 10,
        ..Limits::default()
    };
    assert_eq!(
        invalid(Plan::build(&input, &dir.path().join("p"), small)),
        [(None, "file_too_large".to_owned())]
    );
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    assert_eq!(
        invalid(Plan::build(
            &empty,
            &dir.path().join("p"),
            Limits::default()
        )),
        [(None, "empty_file".to_owned())]
    );
}

#[test]
fn missing_input_is_an_io_error_naming_the_file() {
    let dir = tempdir().unwrap();
    let err = Plan::build(
        &dir.path().join("nope.jsonl"),
        dir.path(),
        Limits::default(),
    )
    .unwrap_err();
    assert!(matches!(err, PlanError::Io { .. }));
    let path = dir.path().join("nope.jsonl");
    assert_eq!(
        err.to_string(),
        format!(
            "reading the input file {}: No such file or directory (os error 2)",
            path.display()
        )
    );
    // The I/O error is in the message once, not again as a source.
    assert!(std::error::Error::source(&err).is_none());
}

#[test]
fn with_an_endpoint_every_line_must_name_it() {
    let dir = tempdir().unwrap();
    let other = line("b", "m", None).replace("/v1/chat/completions", "/v1/embeddings");
    let lines = vec![line("a", "m", None), other, line("c", "m", None)];
    let input = write(dir.path(), &lines, true);
    let chat = Limits {
        endpoint: Some("/v1/chat/completions"),
        ..Limits::default()
    };
    assert_eq!(
        invalid(Plan::build(&input, &dir.path().join("p1"), chat)),
        [(Some(2), "url_mismatch".to_owned())]
    );
    // Without one, each line names its own.
    let plan = Plan::build(&input, &dir.path().join("p2"), Limits::default()).unwrap();
    assert_eq!(plan.total(), 3);
}
