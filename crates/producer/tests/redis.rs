//! The producer against a real redis-server.

use std::collections::BTreeMap;

use batch_producer::{request_token, JobMessages, Producer, ProducerOptions, Request, StreamError};
use batch_testkit::RedisServer;
use batch_wire::Envelope;

fn job(id: &str) -> JobMessages {
    JobMessages {
        job_id: id.into(),
        created: 1_900_000_000,
        deadline: 1_900_086_400,
        request_queue: "llm-d-async:requests:pool-a".into(),
        result_queue: "llm-d-async:results:pool-a:$batch".into(),
        headers: BTreeMap::new(),
    }
}

fn line(i: u64) -> Vec<u8> {
    format!(r#"{{"custom_id":"c{i}","method":"POST","url":"/v1/completions","body":{{"model":"m","prompt":"{i}"}}}}"#)
        .into_bytes()
}

async fn producer(redis: &RedisServer, chunk: usize) -> Producer {
    let client = batch_redis::connect(&redis.url(), &Default::default())
        .await
        .unwrap();
    Producer::new(
        client,
        ProducerOptions {
            chunk,
            ..ProducerOptions::default()
        },
    )
}

#[tokio::test]
async fn enqueue_is_chunked_and_idempotent() {
    let redis = RedisServer::start();
    let producer = producer(&redis, 300).await;
    let job = job("batch_a");
    let members: Vec<_> = (0..1000)
        .map(|i| job.member(i, &line(i)).unwrap())
        .collect();
    let added = producer
        .enqueue(&job.request_queue, job.score(), members.clone())
        .await
        .unwrap();
    assert_eq!(added, 1000);
    assert_eq!(redis.command(&["ZCARD", &job.request_queue]), ":1000");

    // Building the members again and enqueueing them changes nothing.
    let rebuilt: Vec<_> = (0..1000)
        .map(|i| job.member(i, &line(i)).unwrap())
        .collect();
    let again = producer
        .enqueue(&job.request_queue, job.score(), rebuilt)
        .await
        .unwrap();
    assert_eq!(again, 0);
    assert_eq!(redis.command(&["ZCARD", &job.request_queue]), ":1000");

    // What is in the set is what the dispatcher reads, at the deadline score.
    let first = redis.command(&["ZRANGE", &job.request_queue, "0", "0"]);
    let envelope = Envelope::parse(&first).unwrap();
    assert_eq!(envelope.data.deadline, 1_900_086_400);
    assert_eq!(
        redis.command(&["ZSCORE", &job.request_queue, &first]),
        "1900086400"
    );
}

#[tokio::test]
async fn remove_takes_out_pending_members_and_marks_taken_ones() {
    let redis = RedisServer::start();
    let producer = producer(&redis, 64).await;
    let mine = job("batch_mine");
    let other = job("batch_other");
    let queue = mine.request_queue.clone();
    let mut all = Vec::new();
    for i in 0..200 {
        all.push(mine.member(i, &line(i)).unwrap());
        all.push(other.member(i, &line(i)).unwrap());
    }
    producer.enqueue(&queue, mine.score(), all).await.unwrap();
    // The dispatcher has taken line 5 of my job.
    let taken = mine.member(5, &line(5)).unwrap();
    assert_eq!(redis.command(&["ZREM", &queue, &taken]), ":1");

    let pending: Vec<_> = (0..200)
        .map(|i| mine.pending(i, &line(i)).unwrap())
        .collect();
    let report = producer.remove(&queue, &pending).await.unwrap();
    assert_eq!((report.removed, report.marked), (199, 1));
    assert_eq!(
        redis.command(&["ZCARD", &queue]),
        ":200",
        "the other job is untouched"
    );
    let left = producer
        .queued(
            &queue,
            &(0..200)
                .map(|i| other.member(i, &line(i)).unwrap())
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap();
    assert!(left.iter().all(|&q| q));

    // The taken one got the marker the dispatcher checks, with its token and a TTL.
    let key = format!("request-cancel:{}", batch_wire::request_id("batch_mine", 5));
    assert_eq!(
        redis.command(&["GET", &key]),
        request_token("batch_mine", 1_900_000_000, 5)
    );
    let ttl: i64 = redis.command(&["TTL", &key])[1..].parse().unwrap();
    assert!(ttl > 6 * 24 * 3600, "ttl {ttl}");
    let no_marker = format!("request-cancel:{}", batch_wire::request_id("batch_mine", 6));
    assert_eq!(redis.command(&["EXISTS", &no_marker]), ":0");
}

#[tokio::test]
async fn queued_tells_members_apart() {
    let redis = RedisServer::start();
    let producer = producer(&redis, 2).await;
    let job = job("batch_q");
    let members: Vec<_> = (0..5).map(|i| job.member(i, &line(i)).unwrap()).collect();
    producer
        .enqueue(&job.request_queue, job.score(), members[..3].to_vec())
        .await
        .unwrap();
    let found = producer.queued(&job.request_queue, &members).await.unwrap();
    assert_eq!(found, [true, true, true, false, false]);
}

fn requests(job: &JobMessages, lines: std::ops::Range<u64>) -> Vec<Result<Request, String>> {
    lines
        .map(|i| {
            Ok(Request {
                index: i,
                score: job.score_at(i),
                line: line(i),
            })
        })
        .collect()
}

#[tokio::test]
async fn a_stream_of_lines_is_enqueued_whole_and_its_source_error_comes_back() {
    let redis = RedisServer::start();
    let producer = producer(&redis, 7).await;
    let job = job("batch_s");
    let done = producer
        .enqueue_requests(&job, requests(&job, 0..100))
        .await
        .unwrap();
    assert_eq!((done.sent, done.added), (100, 100));
    assert_eq!(redis.command(&["ZCARD", &job.request_queue]), ":100");
    // In plan order: line 0 first.
    let first = redis.command_list(&["ZRANGE", &job.request_queue, "0", "0"]);
    assert_eq!(first, [job.member(0, &line(0)).unwrap()]);
    let again = producer
        .enqueue_requests(&job, requests(&job, 0..100))
        .await
        .unwrap();
    assert_eq!((again.sent, again.added), (100, 0));

    let mut broken = requests(&job, 100..120);
    broken.push(Err("disk gone".to_owned()));
    broken.extend(requests(&job, 120..130));
    match producer.enqueue_requests(&job, broken).await {
        Err(StreamError::Source(e)) => assert_eq!(e, "disk gone"),
        other => panic!("{other:?}"),
    }
}

/// Lines `0..n` of two jobs, `mine` and another, in the request set.
async fn two_jobs(producer: &Producer, mine: &str, n: u64) -> JobMessages {
    let (mine, other) = (job(mine), job("batch_other"));
    for j in [&mine, &other] {
        producer
            .enqueue_requests(j, requests(j, 0..n))
            .await
            .unwrap();
    }
    mine
}

/// Line `i` of `job` as the dispatcher puts it into its retry set: re-serialised.
fn retried(redis: &RedisServer, job: &JobMessages, i: u64) {
    let mut member: serde_json::Value =
        serde_json::from_str(&job.member(i, &line(i)).unwrap()).unwrap();
    member["retry_count"] = 1.into();
    redis.command(&["ZADD", "retry-sortedset", "1", &member.to_string()]);
}

#[tokio::test]
async fn held_lines_are_found_by_id_wherever_the_dispatcher_keeps_them() {
    let redis = RedisServer::start();
    let producer = producer(&redis, 50).await;
    let mine = two_jobs(&producer, "batch h/1", 3).await;
    // Line 3 re-written by the dispatcher into its retry set; line 4 claimed (v0.10).
    retried(&redis, &mine, 3);
    let claimed = batch_keys::claimed_key(&mine.request_queue);
    let field = format!("{}\0tok", batch_wire::request_id(&mine.job_id, 4));
    redis.command(&["HSET", &claimed, &field, "x"]);
    let mut held: Vec<u64> = producer
        .held_lines(&mine.job_id, &[&mine.request_queue], "retry-sortedset")
        .await
        .unwrap()
        .into_iter()
        .collect();
    held.sort_unstable();
    assert_eq!(held, [0, 1, 2, 3, 4]);
}

#[tokio::test]
async fn withdraw_removes_a_jobs_members_in_any_bytes_and_marks_the_taken() {
    let redis = RedisServer::start();
    let producer = producer(&redis, 4).await;
    let mine = two_jobs(&producer, "batch_w", 10).await;
    // The dispatcher took line 0 and put line 1 back re-serialised, in the retry set.
    for i in [0, 1] {
        let member = mine.member(i, &line(i)).unwrap();
        redis.command(&["ZREM", &mine.request_queue, &member]);
    }
    retried(&redis, &mine, 1);
    let lines: Vec<Result<(u64, Vec<u8>), String>> = (2..10).map(|i| Ok((i, line(i)))).collect();
    let report = producer
        .withdraw(&mine, lines, "retry-sortedset")
        .await
        .unwrap();
    assert_eq!((report.removed, report.marked), (9, 0));
    let lines: Vec<Result<(u64, Vec<u8>), String>> = vec![Ok((0, line(0)))];
    let report = producer
        .withdraw(&mine, lines, "retry-sortedset")
        .await
        .unwrap();
    assert_eq!((report.removed, report.marked), (0, 1));
    assert_eq!(redis.command(&["ZCARD", "retry-sortedset"]), ":0");
    assert_eq!(redis.command(&["ZCARD", &mine.request_queue]), ":10");
}
