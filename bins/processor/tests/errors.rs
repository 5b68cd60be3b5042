//! The text of the common failures of `processor run`: each error printed once, each level of
//! its chain adding context (the file, the key, the job) and never repeating its cause.

use std::path::Path;
use std::process::Command;

/// `processor run` with no `PROCESSOR_…` or `RUST_LOG` variable inherited from whoever runs
/// the tests; stderr is a pipe, so no bars and info logs.
fn run(config: &Path, input: &Path, out: &Path, extra: &[&str]) -> (i32, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_processor"));
    command
        .arg("run")
        .arg("--config")
        .arg(config)
        .arg("--input")
        .arg(input)
        .arg("--output-dir")
        .arg(out)
        .args(extra)
        .env_remove("RUST_LOG");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("PROCESSOR_") {
            command.env_remove(name);
        }
    }
    let output = command.output().expect("the processor binary runs");
    (
        output.status.code().expect("exited normally"),
        String::from_utf8(output.stderr).unwrap(),
    )
}

/// The lines of `stderr` that are not log lines.
fn messages(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| !l.contains(" INFO ") && !l.contains(" WARN ") && !l.contains(" ERROR "))
        .collect()
}

/// A sync config whose only model points at a closed loopback port; lines naming another
/// model fail at once with `model_not_found`, so no request is ever sent.
fn sync_config(dir: &Path) -> std::path::PathBuf {
    let port = batch_testkit::free_port();
    let path = dir.join("sync.yaml");
    std::fs::write(
        &path,
        format!(
            "dispatch_mode: sync\nwork_dir: {}\nmodel_gateways:\n  m:\n    url: http://127.0.0.1:{port}\n",
            dir.join("work").display()
        ),
    )
    .unwrap();
    path
}

fn line(custom_id: &str, method: &str, model: &str) -> String {
    format!(
        r#"{{"custom_id":"{custom_id}","method":"{method}","url":"/v1/chat/completions","body":{{"model":"{model}"}}}}"#
    )
}

#[test]
fn a_missing_input_names_the_file_and_its_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("nonexistent.jsonl");
    let (code, stderr) = run(
        &sync_config(dir.path()),
        &input,
        &dir.path().join("out"),
        &[],
    );
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(
        messages(&stderr),
        [format!(
            "processor: preparing the job: reading the input file {}: No such file or directory (os error 2)",
            input.display()
        )],
        "{stderr}"
    );
}

#[test]
fn an_output_dir_that_is_a_file_is_named_once() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, line("a", "POST", "m") + "\n").unwrap();
    let out = dir.path().join("a-file");
    std::fs::write(&out, "").unwrap();
    let (code, stderr) = run(&sync_config(dir.path()), &input, &out, &[]);
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(
        messages(&stderr),
        [format!(
            "processor: preparing the job: {}: File exists (os error 17)",
            out.display()
        )],
        "{stderr}"
    );
}

#[test]
fn an_unreadable_config_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let out = dir.path().join("out");
    for (config, cause) in [
        (
            dir.path().join("missing.yaml"),
            "No such file or directory (os error 2)",
        ),
        // A directory cannot be read as a file, even by root.
        (dir.path().to_owned(), "Is a directory (os error 21)"),
    ] {
        let (code, stderr) = run(&config, &input, &out, &[]);
        assert_eq!(code, 2, "{stderr}");
        assert_eq!(
            messages(&stderr),
            [
                format!("{}: cannot read the config file: {cause}", config.display()),
                "processor: invalid configuration (1 problem)".to_owned(),
            ],
            "{stderr}"
        );
    }
}

#[test]
fn an_invalid_config_lists_each_problem_with_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("bad.yaml");
    std::fs::write(
        &config,
        "dispatch_mode: sync\nmodel_gateways:\n  m:\n    url: 12\n",
    )
    .unwrap();
    let (code, stderr) = run(
        &config,
        &dir.path().join("in.jsonl"),
        &dir.path().join("out"),
        &[],
    );
    assert_eq!(code, 2, "{stderr}");
    assert_eq!(
        messages(&stderr),
        [
            format!(
                "{}: model_gateways.m.url: expected an http:// or https:// URL",
                config.display()
            ),
            "processor: invalid configuration (1 problem)".to_owned(),
        ],
        "{stderr}"
    );
}

#[test]
fn an_invalid_input_fails_the_job_listing_each_bad_line() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let lines = [
        line("a", "POST", "m"),
        "{not json".into(),
        line("c", "GET", "m"),
    ];
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let out = dir.path().join("out");
    let (code, stderr) = run(
        &sync_config(dir.path()),
        &input,
        &out,
        &["--job-id", "job-1"],
    );
    assert_eq!(code, 3, "{stderr}");
    assert_eq!(
        messages(&stderr),
        [
            "job job-1: failed".to_owned(),
            "  0 requests: 0 completed, 0 failed".to_owned(),
            format!("  results in {}", out.display()),
            "  line 2: the line is not a JSON object of the batch format: key must be a string at line 1 column 2 (invalid_json_line)".to_owned(),
            "  line 3: method must be POST, got \"GET\" (invalid_method)".to_owned(),
        ],
        "{stderr}"
    );
}

#[test]
fn unreachable_redis_names_the_redacted_url_and_the_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let port = batch_testkit::free_port();
    let url_file = dir.path().join("redis-url");
    std::fs::write(&url_file, format!("redis://:sekret@127.0.0.1:{port}\n")).unwrap();
    let config = dir.path().join("async.yaml");
    std::fs::write(
        &config,
        format!(
            "dispatch_mode: async\nredis_url_file: {}\nwork_dir: {}\nmodel_gateways:\n  m:\n    inference_pool_name: pool-a\n",
            url_file.display(),
            dir.path().join("work").display()
        ),
    )
    .unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, line("a", "POST", "m") + "\n").unwrap();
    // The old bound: without it a run waits for Redis until the job's deadline.
    let (code, stderr) = run(
        &config,
        &input,
        &dir.path().join("out"),
        &["--redis-attempts", "6"],
    );
    assert_eq!(code, 1, "{stderr}");
    let messages = messages(&stderr);
    assert_eq!(messages.len(), 1, "{stderr}");
    // The cause's wording is the Redis client's; ours is pinned, and the cause comes once.
    let prefix =
        format!("processor: cannot reach Redis at redis://***@127.0.0.1:{port} after 6 attempts: ");
    assert!(messages[0].starts_with(&prefix), "{stderr}");
    assert_eq!(messages[0].matches("refused").count(), 1, "{stderr}");
    assert!(!stderr.contains("sekret"), "{stderr}");
}
