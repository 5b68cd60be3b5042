//! A job run through the executor in dry-run mode: every line is answered once, locally, and
//! lines no model serves still get their error line.

use std::collections::BTreeMap;
use std::path::Path;

use batch_config::figment::providers::{Format, Yaml};
use batch_config::figment::Figment;
use batch_config::ProcessorConfig;
use batch_executor::{DryRun, Executor, JobSpec, SyncMode};
use batch_wire::{BatchStatus, OutputLine};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

fn config(dir: &Path) -> ProcessorConfig {
    let path = dir.join("processor.yaml");
    // No url and no pool: a dry run reaches no gateway and no Redis.
    let yaml = format!(
        "dispatch_mode: dry_run\nwork_dir: {}\nmodel_gateways:\n  m-a: {{}}\n  m-b: {{}}\n",
        dir.join("work").display()
    );
    std::fs::write(&path, yaml).unwrap();
    // The file alone: no PROCESSOR_ variable of the environment interferes.
    ProcessorConfig::from_figment(Figment::from(Yaml::file_exact(&path)))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Writes the input (its lines' models in order) and returns custom_id → model.
fn write_input(path: &Path, models: &[&str]) -> BTreeMap<String, String> {
    let mut text = String::new();
    let mut expected = BTreeMap::new();
    for (i, model) in models.iter().enumerate() {
        let custom_id = format!("req-{i}");
        let line = json!({
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]},
        });
        text.push_str(&line.to_string());
        text.push('\n');
        expected.insert(custom_id, (*model).to_owned());
    }
    std::fs::write(path, text).unwrap();
    expected
}

/// custom_id → the line of a result file, failing on a custom_id seen twice.
fn read_lines(path: &Path) -> BTreeMap<String, Value> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = BTreeMap::new();
    for line in text.lines() {
        let parsed: OutputLine<'_> = serde_json::from_str(line).unwrap();
        let value: Value = serde_json::from_str(line).unwrap();
        let custom_id = parsed.custom_id.into_owned();
        assert!(lines.insert(custom_id, value).is_none(), "twice: {line}");
    }
    lines
}

#[tokio::test]
async fn every_line_is_answered_once_and_unserved_models_still_fail() {
    let dir = tempfile::tempdir().unwrap();
    let mut models = vec!["m-a"; 1500];
    models.extend(["m-b"; 700]);
    // Lines of a model the config does not serve, spread among the others.
    for i in [3, 900, 2000] {
        models[i] = "unknown-model";
    }
    let input = dir.path().join("input.jsonl");
    let expected = write_input(&input, &models);
    let out = dir.path().join("out");

    let executor = Executor::new(config(dir.path())).await.unwrap();
    assert!(executor.mode::<DryRun>().is_some());
    assert!(executor.mode::<SyncMode>().is_none(), "one mode, not two");
    let batch = executor
        .run(JobSpec::new(&input, &out), CancellationToken::new())
        .await
        .unwrap();

    assert_eq!(batch.status, BatchStatus::Completed);
    assert_eq!(batch.request_counts.total, 2200);
    assert_eq!(batch.request_counts.completed, 2197);
    assert_eq!(batch.request_counts.failed, 3);

    let output = read_lines(&out.join("output.jsonl"));
    let errors = read_lines(&out.join("error.jsonl"));
    assert_eq!(output.len(), 2197);
    assert_eq!(errors.len(), 3);
    for (custom_id, model) in &expected {
        match (output.get(custom_id), errors.get(custom_id)) {
            (Some(line), None) => {
                assert_eq!(line["response"]["status_code"], 200, "{line}");
                assert_eq!(
                    line["response"]["body"],
                    json!({"object": "dry_run", "custom_id": custom_id, "model": model}),
                );
                assert_eq!(line["error"], Value::Null);
            }
            (None, Some(line)) => {
                assert_eq!(model, "unknown-model", "{line}");
                assert_eq!(line["error"]["code"], "model_not_found", "{line}");
            }
            other => panic!("{custom_id}: {other:?}"),
        }
    }

    // Run again on the same directory: the job is done, nothing is answered twice.
    let again = executor
        .run(JobSpec::new(&input, &out), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(again.status, BatchStatus::Completed);
    assert_eq!(read_lines(&out.join("output.jsonl")).len(), 2197);
    executor.shutdown().await;
}
