//! The sink on real files: exactly once per index, across reopenings and torn writes.

use std::io::Write;

use batch_sink::{JobSink, SinkError, Written, ERROR_FILE, OUTPUT_FILE};
use batch_testkit::tempdir;
use batch_wire::Outcome;

const OK: Outcome<'static> = Outcome::Http {
    status: 200,
    body: r#"{"ok":true}"#,
};
const BUSY: Outcome<'static> = Outcome::Http {
    status: 429,
    body: r#"{"error":"busy"}"#,
};
const EXPIRED: Outcome<'static> = Outcome::Failed {
    code: "batch_expired",
    message: "late",
};

fn lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn each_index_gets_exactly_one_line_in_the_right_file() {
    let dir = tempdir().unwrap();
    let mut sink = JobSink::open(dir.path(), "job", 4).unwrap();
    assert!(matches!(
        sink.record(0, "a", &OK).unwrap(),
        Written::Output { status: 200, .. }
    ));
    assert!(matches!(
        sink.record(1, "b", &BUSY).unwrap(),
        Written::Output { status: 429, .. }
    ));
    assert_eq!(sink.record(2, "c", &EXPIRED).unwrap(), Written::Error);
    assert_eq!(sink.record(1, "b", &OK).unwrap(), Written::Duplicate);
    assert_eq!(sink.record(2, "c", &OK).unwrap(), Written::Duplicate);
    assert!(matches!(
        sink.record(4, "x", &OK),
        Err(SinkError::OutOfRange { index: 4, .. })
    ));
    sink.flush().unwrap();
    assert_eq!(sink.unresolved().collect::<Vec<_>>(), [3]);
    let c = sink.counts();
    assert_eq!((c.total, c.completed, c.failed), (4, 1, 2));

    let out = lines(&dir.path().join(OUTPUT_FILE));
    let err = lines(&dir.path().join(ERROR_FILE));
    assert_eq!(out.len(), 2);
    assert_eq!(err.len(), 1);
    assert_eq!(out[0]["custom_id"], "a");
    assert_eq!(out[0]["id"], "batch_req_job_0");
    assert_eq!(out[1]["response"]["status_code"], 429);
    assert_eq!(err[0]["error"]["code"], "batch_expired");
    assert!(err[0]["response"].is_null() && out[0]["error"].is_null());
}

#[test]
fn reopening_resumes_counts_and_cuts_a_torn_line() {
    let dir = tempdir().unwrap();
    {
        let mut sink = JobSink::open(dir.path(), "job", 3).unwrap();
        sink.record(0, "a", &OK).unwrap();
        sink.record(2, "c", &EXPIRED).unwrap();
        sink.flush().unwrap();
    }
    // A crash in the middle of writing line 1.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.path().join(OUTPUT_FILE))
        .unwrap();
    f.write_all(br#"{"id":"batch_req_job_1","custom_id":"b","respo"#)
        .unwrap();
    drop(f);

    let mut sink = JobSink::open(dir.path(), "job", 3).unwrap();
    assert!(sink.is_done(0) && !sink.is_done(1) && sink.is_done(2));
    let c = sink.counts();
    assert_eq!((c.completed, c.failed), (1, 1));
    assert_eq!(sink.record(0, "a", &OK).unwrap(), Written::Duplicate);
    sink.record(1, "b", &OK).unwrap();
    sink.flush().unwrap();
    let out = lines(&dir.path().join(OUTPUT_FILE));
    assert_eq!(out.len(), 2, "torn line removed, new one whole");
    assert_eq!(out[1]["custom_id"], "b");
    assert_eq!(sink.remaining(), 0);
}

#[test]
fn refuses_files_of_another_job() {
    let dir = tempdir().unwrap();
    {
        let mut sink = JobSink::open(dir.path(), "job-a", 2).unwrap();
        sink.record(0, "a", &OK).unwrap();
        sink.flush().unwrap();
    }
    let err = JobSink::open(dir.path(), "job-b", 2).unwrap_err();
    assert!(matches!(err, SinkError::Foreign { line: 1, .. }), "{err}");
}

/// Outcomes of every kind the totals tell apart.
fn mixed() -> Vec<Outcome<'static>> {
    vec![
        Outcome::Http {
            status: 200,
            body: r#"{"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7,"prompt_tokens_details":{"cached_tokens":1}}}"#,
        },
        Outcome::Http {
            status: 200,
            body: r#"{"usage":{"input_tokens":10,"output_tokens":5,"output_tokens_details":{"reasoning_tokens":2}}}"#,
        },
        // Not a success: its usage does not count.
        Outcome::Http {
            status: 400,
            body: r#"{"usage":{"prompt_tokens":100}}"#,
        },
        Outcome::Failed {
            code: "batch_cancelled",
            message: "x",
        },
        EXPIRED,
        Outcome::Failed {
            code: "server_error",
            message: "x",
        },
        // A 2xx without a body: a `server_error` line.
        Outcome::Http {
            status: 200,
            body: "",
        },
        Outcome::Http {
            status: 201,
            body: r#"{"usage":{"prompt_tokens":1,"completion_tokens":1}}"#,
        },
    ]
}

#[test]
fn totals_are_counted_as_written_and_a_resume_from_a_checkpoint_counts_the_same() {
    let outcomes = mixed();
    let n = outcomes.len() as u64;
    let whole = tempdir().unwrap();
    let mut sink = JobSink::open(whole.path(), "job", n).unwrap();
    for (i, o) in outcomes.iter().enumerate() {
        sink.record(i as u64, "c", o).unwrap();
    }
    sink.flush().unwrap();
    let (totals, counts) = (sink.totals(), sink.counts());
    assert_eq!((totals.output_lines, totals.error_lines), (4, 4));
    assert_eq!((totals.cancelled, totals.expired), (1, 1));
    let u = totals.usage;
    assert_eq!(
        (u.input_tokens, u.output_tokens, u.total_tokens),
        (14, 10, 24)
    );
    assert_eq!(u.input_tokens_details.cached_tokens, 1);
    assert_eq!(u.output_tokens_details.reasoning_tokens, 2);

    // The same job checkpointed after four lines (two more written, but not flushed, are
    // lost) and resumed elsewhere from the checkpoint's prefixes.
    let first = tempdir().unwrap();
    let mut sink = JobSink::open(first.path(), "job", n).unwrap();
    for (i, o) in outcomes.iter().enumerate().take(4) {
        sink.record(i as u64, "c", o).unwrap();
    }
    sink.flush().unwrap();
    let (output_len, error_len) = sink.committed_lengths();
    sink.record(5, "c", &outcomes[5]).unwrap();
    sink.record(4, "c", &outcomes[4]).unwrap();
    let resumed = tempdir().unwrap();
    for (file, len) in [(OUTPUT_FILE, output_len), (ERROR_FILE, error_len)] {
        let bytes = std::fs::read(first.path().join(file)).unwrap();
        std::fs::write(resumed.path().join(file), &bytes[..len as usize]).unwrap();
    }
    drop(sink);
    let mut sink = JobSink::open(resumed.path(), "job", n).unwrap();
    let open: Vec<u64> = sink.unresolved().collect();
    assert_eq!(open, [4, 5, 6, 7]);
    for i in open {
        sink.record(i, "c", &outcomes[i as usize]).unwrap();
    }
    sink.flush().unwrap();
    assert_eq!(sink.totals(), totals);
    assert_eq!(sink.counts(), counts);
}
