//! The `processor` binary, run as a child process on real files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/config")
}

/// The binary with no `PROCESSOR_…` variable inherited from whoever runs the tests.
fn processor(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_processor"));
    command.args(args);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("PROCESSOR_") {
            command.env_remove(name);
        }
    }
    command
}

fn run(command: &mut Command) -> (i32, String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = command.output().expect("the processor binary runs");
    (
        status.code().expect("exited normally"),
        String::from_utf8(stdout).unwrap(),
        String::from_utf8(stderr).unwrap(),
    )
}

fn path_arg(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn check_config_accepts_both_examples() {
    for (name, mode) in [("sync.yaml", "sync"), ("async.yaml", "async")] {
        let file = examples().join(name);
        let (code, stdout, stderr) = run(&mut processor(&[
            "check-config",
            "--config",
            path_arg(&file),
        ]));
        assert_eq!(code, 0, "{name}: {stderr}");
        assert!(
            stdout.contains(&format!("dispatch_mode: {mode}")),
            "{stdout}"
        );
        assert!(stdout.contains("model_gateways:"), "{stdout}");
    }
}

#[test]
fn check_config_redacts_the_redis_url() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("redis-url");
    std::fs::write(&secret, "redis://:s3cret-pw@127.0.0.1:7001\n").unwrap();
    let file = examples().join("async.yaml");
    let (code, stdout, stderr) = run(processor(&["check-config", "--config", path_arg(&file)])
        .env("PROCESSOR_REDIS_URL_FILE", &secret));
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("redis_url: '[redacted]'"), "{stdout}");
    assert!(
        stdout.contains(&format!("redis_url_file: {}", secret.display())),
        "{stdout}"
    );
    assert!(!stdout.contains("s3cret-pw") && !stderr.contains("s3cret-pw"));
}

#[test]
fn check_config_lists_every_problem_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("broken.yaml");
    std::fs::write(
        &file,
        "dispatch_mode: async\n\
         redis_url_file: nowhere/redis-url\n\
         async_dispatch: {result_poll_timeout: 0s}\n\
         model_gateways:\n  llama-3: {url: 'http://127.0.0.1:8000'}\n  mistral: {inference_pool_name: 'a:b'}\n\
         concurency: {global: 3}\n",
    )
    .unwrap();
    let (code, stdout, stderr) = run(&mut processor(&[
        "check-config",
        "--config",
        path_arg(&file),
    ]));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stdout.is_empty(),
        "nothing on stdout when invalid: {stdout}"
    );
    let f = file.display();
    for expected in [
        format!("{f}: concurency: unknown key (did you mean concurrency?)"),
        format!("{f}: async_dispatch.result_poll_timeout: must be greater than 0"),
        format!("{f}: model_gateways.llama-3.inference_pool_name: missing"),
        format!("{f}: model_gateways.mistral.inference_pool_name: pool name \"a:b\" contains ':'"),
        format!("{f}: redis_url_file: cannot read secret file"),
    ] {
        assert!(
            stderr.lines().any(|l| l.starts_with(&expected)),
            "{expected:?} not in:\n{stderr}"
        );
    }
    assert!(
        stderr.contains("invalid configuration (5 problems)"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn an_environment_override_is_named_in_the_error() {
    let file = examples().join("async.yaml");
    let (code, _, stderr) = run(processor(&["check-config", "--config", path_arg(&file)])
        .env("PROCESSOR_DISPATCH_MODE", "turbo"));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("PROCESSOR_DISPATCH_MODE: dispatch_mode: unknown dispatch mode \"turbo\""),
        "{stderr}"
    );
}

#[test]
fn a_missing_config_file_exits_2() {
    let (code, _, stderr) = run(&mut processor(&[
        "check-config",
        "--config",
        "/nonexistent/processor.yaml",
    ]));
    assert_eq!(code, 2);
    assert!(
        stderr.contains("/nonexistent/processor.yaml: cannot read the config file"),
        "{stderr}"
    );
}

#[test]
fn queues_prints_each_pools_queue_names() {
    let file = examples().join("async.yaml");
    let (code, stdout, stderr) = run(&mut processor(&["queues", "--config", path_arg(&file)]));
    assert_eq!(code, 0, "{stderr}");
    for expected in [
        "llm-d-async:requests:pool-a",
        "llm-d-async:results:pool-a:$batch",
        "llm-d-async:requests:pool-b",
        "llm-d-async:results:pool-b:$batch",
        "llama-3, llama-3-instruct",
        "--redis.ss.result-queue-name",
        "\"gate_type\": \"prometheus-budget\"",
        "--transport-config-file",
        "\"retry_queue_name\": \"retry-sortedset\"",
        // The gate sized from the config's max_num_seqs 16 and headroom 0.25, two pools.
        "\"max_concurrency\": \"16\"",
        "\"baseline\": \"0.25\"",
        "the gate closes once 12 requests run on a pod",
        "--concurrency 24",
        "--prometheus-cache-ttl 1s",
        "inference_pool_ready_pods{name=\"P\"}",
    ] {
        assert!(stdout.contains(expected), "{expected:?} not in:\n{stdout}");
    }
    assert!(!stderr.contains("warning"), "{stderr}");
}

/// A gate that can never close (it closes at 30 running on servers that run 16) is warned of,
/// naming the settings; without `max_num_seqs` the unsized gate is warned of too.
#[test]
fn queues_warn_of_a_gate_that_never_closes() {
    let file = examples().join("async.yaml");
    let (code, _, stderr) = run(
        processor(&["queues", "--json", "--config", path_arg(&file)])
            .env(
                "PROCESSOR_ASYNC_DISPATCH__DISPATCHER__MAX_CONCURRENCY",
                "40",
            )
            .env("PROCESSOR_ASYNC_DISPATCH__DISPATCHER__BASELINE", "0.25"),
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains("warning: pool pool-a: the gate can never close")
            && stderr.contains("warning: pool pool-b: the gate can never close")
            && stderr.contains("max_num_seqs = 16"),
        "{stderr}"
    );
    assert!(stderr.contains("inference_pool_ready_pods"), "{stderr}");
}

/// A pool's own facts (`async_dispatch.dispatcher.pools`) size its gate, and the printed summary
/// says each pool's; a pool no model serves is refused, naming the field and the file.
#[test]
fn queues_size_each_pool_from_its_own_facts() {
    let file = examples().join("async.yaml");
    let (code, stdout, stderr) = run(processor(&["queues", "--config", path_arg(&file)])
        .env(
            "PROCESSOR_ASYNC_DISPATCH__DISPATCHER__POOLS__pool-b__MAX_NUM_SEQS",
            "64",
        )
        .env(
            "PROCESSOR_ASYNC_DISPATCH__DISPATCHER__POOLS__pool-b__PODS",
            "2",
        ));
    assert_eq!(code, 0, "{stderr}");
    for expected in [
        "pool-a:               1 pod(s), max_concurrency 16 per pod, baseline 0.25: the gate closes once 12 requests run on a pod",
        "pool-b:               2 pod(s), max_concurrency 64 per pod, baseline 0.25: the gate closes once 48 requests run on a pod",
        "\"max_concurrency\": \"64\"",
        // 1 × 12 + 2 × 48 workers; a poll brings at most pool-a's 16.
        "--concurrency 108",
        "--redis.ss.batch-size 16",
    ] {
        assert!(stdout.contains(expected), "{expected:?} not in:\n{stdout}");
    }
    assert!(!stderr.contains("warning"), "{stderr}");

    let (code, stdout, stderr) = run(processor(&["queues", "--config", path_arg(&file)]).env(
        "PROCESSOR_ASYNC_DISPATCH__DISPATCHER__POOLS__pool-c__PODS",
        "2",
    ));
    assert_eq!(code, 2, "{stdout}");
    assert!(
        stderr.contains(
            "PROCESSOR_ASYNC_DISPATCH__DISPATCHER__POOLS__POOL-C: async_dispatch.dispatcher.pools.pool-c: no model has inference_pool_name pool-c"
        ),
        "{stderr}"
    );
}

#[test]
fn queues_json_is_the_dispatcher_array() {
    let file = examples().join("async.yaml");
    let (code, stdout, stderr) = run(&mut processor(&[
        "queues",
        "--json",
        "--config",
        path_arg(&file),
    ]));
    assert_eq!(code, 0, "{stderr}");
    let json: serde_json::Value = serde_json::from_str(&stdout).expect("stdout is only JSON");
    let entries = json.as_array().expect("a JSON array");
    let names: Vec<&str> = entries
        .iter()
        .map(|e| e["queue_name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["llm-d-async:requests:pool-a", "llm-d-async:requests:pool-b"]
    );
    assert_eq!(entries[0]["igw_base_url"], "http://127.0.0.1:8000");
    assert_eq!(entries[1]["gate_params"]["pool"], "pool-b");
    // A queue-level result list would override the one each envelope names.
    assert!(entries.iter().all(|e| e.get("result_queue_name").is_none()));
}

#[test]
fn queues_transport_config_is_the_v0_10_object_without_the_redis_url() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("redis-url");
    std::fs::write(&secret, "redis://:s3cret-pw@127.0.0.1:7001\n").unwrap();
    let file = examples().join("async.yaml");
    let (code, stdout, stderr) =
        run(
            processor(&["queues", "--transport-config", "--config", path_arg(&file)])
                .env("PROCESSOR_REDIS_URL_FILE", &secret),
        );
    assert_eq!(code, 0, "{stderr}");
    let json: serde_json::Value = serde_json::from_str(&stdout).expect("stdout is only JSON");
    assert_eq!(json["retry_queue_name"], "retry-sortedset");
    assert_eq!(
        json["result_queue_name"],
        "llm-d-async:results:pool-a:$batch"
    );
    // The pacing of the config's `async_dispatch.dispatcher`: one pod of 16 slots.
    assert_eq!(json["poll_interval_ms"], 200);
    assert_eq!(json["batch_size"], 16);
    assert_eq!(json["enable_tracing"], false);
    let queues = json["queues"].as_array().unwrap();
    assert_eq!(queues.len(), 2);
    assert_eq!(queues[1]["queue_name"], "llm-d-async:requests:pool-b");
    assert!(queues.iter().all(|e| e.get("result_queue_name").is_none()));
    // No URL, said so on stderr; the password appears nowhere.
    assert!(json.get("url").is_none(), "{stdout}");
    assert!(stderr.contains("`url` is left out"), "{stderr}");
    assert!(stderr.contains(&secret.display().to_string()), "{stderr}");
    assert!(!stdout.contains("s3cret") && !stderr.contains("s3cret"));
    assert!(!stdout.contains("7001") && !stderr.contains("7001"));

    // The dispatcher (simulator) takes the file as it is.
    let mut sim = dispatcher_sim::DispatcherConfig::new("redis://127.0.0.1:1", vec![]);
    dispatcher_sim::TransportConfig::parse(&stdout)
        .expect("the simulator reads it")
        .apply(&mut sim);
    assert_eq!(sim.queues.len(), 2);
    assert_eq!(sim.queues[0].queue_name, "llm-d-async:requests:pool-a");
    assert_eq!(sim.batch_size, 16);
    assert_eq!(sim.redis_url, "redis://127.0.0.1:1", "the flag's URL stays");

    // Both forms at once make no sense.
    let (code, _, _) = run(&mut processor(&[
        "queues",
        "--json",
        "--transport-config",
        "--config",
        path_arg(&file),
    ]));
    assert_eq!(code, 2);
}

#[test]
fn queues_follow_the_consumer_id_override() {
    let file = examples().join("async.yaml");
    let (code, stdout, stderr) = run(processor(&["queues", "--config", path_arg(&file)])
        .env("PROCESSOR_ASYNC_DISPATCH__CONSUMER_ID", "replica-2"));
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("llm-d-async:results:pool-a:replica-2"),
        "{stdout}"
    );
    assert!(!stdout.contains("$batch"), "{stdout}");
}

#[test]
fn queues_without_any_pool_exits_2() {
    let file = examples().join("sync.yaml");
    let (code, stdout, stderr) = run(&mut processor(&["queues", "--config", path_arg(&file)]));
    assert_eq!(code, 2);
    assert!(stdout.is_empty(), "{stdout}");
    assert!(stderr.contains("has an inference_pool_name"), "{stderr}");
}

#[test]
fn help_documents_the_exit_codes() {
    for args in [
        &["--help"][..],
        &["check-config", "--help"],
        &["queues", "--help"],
    ] {
        let (code, stdout, _) = run(&mut processor(args));
        assert_eq!(code, 0);
        assert!(
            stdout.contains("Exit codes:") && stdout.contains("2  invalid configuration"),
            "{stdout}"
        );
    }
}
