//! The consumer against a real redis-server: order, batching, bad messages, crash recovery,
//! handler failures and a Redis restart.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use batch_consumer::{
    ConsumerHandle, ConsumerOptions, HandlerError, ResultConsumer, ResultHandler, Routed,
    WriteReport,
};
use batch_keys::ListKeys;
use batch_testkit::RedisServer;
use batch_wire::{request_id, ResultMessage};
use tokio_util::sync::CancellationToken;

const RESULTS: &str = "llm-d-async:results:pool-a:$batch";
const INFLIGHT: &str = "{llm-d-async:results:pool-a:$batch}:inflight";

/// Keeps what it is given; knows a fixed set of jobs; can be told to fail a few times.
#[derive(Default)]
struct Recorder {
    jobs: HashSet<String>,
    seen: Mutex<Vec<Routed>>,
    written: Mutex<HashSet<(String, u64)>>,
    batches: Mutex<Vec<usize>>,
    fail_next: AtomicU32,
}

impl Recorder {
    fn for_jobs(jobs: &[&str]) -> Arc<Self> {
        Arc::new(Self {
            jobs: jobs.iter().map(|j| j.to_string()).collect(),
            ..Self::default()
        })
    }
    fn indexes(&self) -> Vec<u64> {
        self.seen.lock().unwrap().iter().map(|r| r.index).collect()
    }
}

impl ResultHandler for Recorder {
    fn write(&self, results: &[Routed]) -> Result<WriteReport, HandlerError> {
        if self
            .fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(HandlerError("disk full".into()));
        }
        self.batches.lock().unwrap().push(results.len());
        let mut report = WriteReport::default();
        let mut seen = self.seen.lock().unwrap();
        for (i, r) in results.iter().enumerate() {
            if !self.jobs.contains(&*r.job_id) {
                report.not_here.push(i);
            } else if !self
                .written
                .lock()
                .unwrap()
                .insert((r.job_id.to_string(), r.index))
            {
                report.duplicates += 1;
            } else {
                report.written += 1;
                seen.push(r.clone());
            }
        }
        Ok(report)
    }
}

fn options(batch: usize) -> ConsumerOptions {
    ConsumerOptions {
        batch,
        poll_timeout: Duration::from_millis(200),
        min_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(200),
        lease_ttl: Duration::from_secs(2),
        ..ConsumerOptions::default()
    }
}

/// Starts a consumer of RESULTS that takes the lease itself.
async fn spawn_with(
    redis: &RedisServer,
    handler: Arc<dyn ResultHandler>,
    options: ConsumerOptions,
) -> (ConsumerHandle, CancellationToken) {
    let client = batch_redis::connect(&redis.url(), &Default::default())
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let consumer = ResultConsumer::new(
        client.clone(),
        client,
        ListKeys::new(RESULTS),
        handler,
        options,
    );
    (consumer.spawn(None, shutdown.clone()), shutdown)
}

async fn start(
    redis: &RedisServer,
    handler: Arc<Recorder>,
    batch: usize,
) -> (ConsumerHandle, CancellationToken) {
    spawn_with(redis, handler, options(batch)).await
}

fn push(redis: &RedisServer, job: &str, indexes: impl IntoIterator<Item = u64>) {
    for i in indexes {
        let r = ResultMessage::http(request_id(job, i), 200, format!(r#"{{"n":{i}}}"#));
        redis.command(&["LPUSH", RESULTS, &r.to_json()]);
    }
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn takes_oldest_first_in_batches_and_leaves_nothing_in_flight() {
    let redis = RedisServer::start();
    push(&redis, "job", 0..250);
    let handler = Recorder::for_jobs(&["job"]);
    let (handle, shutdown) = start(&redis, handler.clone(), 100).await;
    until("250 results", || handler.indexes().len() == 250).await;
    assert_eq!(
        handler.indexes(),
        (0..250).collect::<Vec<_>>(),
        "oldest first"
    );
    assert_eq!(*handler.batches.lock().unwrap(), [100, 100, 50]);
    handle.stats().drained().await;
    assert_eq!(redis.command(&["LLEN", INFLIGHT]), ":0");
    assert_eq!(redis.command(&["LLEN", RESULTS]), ":0");
    assert_eq!(handle.stats().written_total(), 250);
    shutdown.cancel();
    handle.join().await;
}

/// Rounds (handler calls) it took to write 200 results pushed one every 2 ms.
async fn rounds_for_a_trickle(linger: Duration) -> usize {
    let redis = RedisServer::start();
    let handler = Recorder::for_jobs(&["job"]);
    let options = ConsumerOptions {
        linger,
        ..options(1000)
    };
    let (handle, shutdown) = spawn_with(&redis, handler.clone(), options).await;
    for i in 0..200 {
        push(&redis, "job", [i]);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    until("200 results", || handler.indexes().len() == 200).await;
    assert_eq!(handler.indexes(), (0..200).collect::<Vec<_>>());
    shutdown.cancel();
    handle.join().await;
    let rounds = handler.batches.lock().unwrap().len();
    rounds
}

#[tokio::test]
async fn results_that_trickle_in_are_written_many_at_a_time() {
    let eager = rounds_for_a_trickle(Duration::ZERO).await;
    let lingering = rounds_for_a_trickle(Duration::from_millis(25)).await;
    eprintln!("rounds for 200 results: {eager} without linger, {lingering} with 25 ms");
    // About 400 ms of pushes: one round per 25 ms, against about one per result.
    assert!(lingering <= 50, "{lingering} rounds");
    assert!(
        eager >= 2 * lingering,
        "{eager} rounds without linger, {lingering} with"
    );
}

#[tokio::test]
async fn bad_and_foreign_messages_are_counted_and_skipped() {
    let redis = RedisServer::start();
    let handler = Recorder::for_jobs(&["job"]);
    let (handle, shutdown) = start(&redis, handler.clone(), 10).await;
    push(&redis, "job", [0]);
    redis.command(&["LPUSH", RESULTS, "garbage{"]);
    redis.command(&[
        "LPUSH",
        RESULTS,
        r#"{"id":"not-one-of-ours","status_code":200,"payload":"{}"}"#,
    ]);
    push(&redis, "someone-elses-job", [3]);
    push(&redis, "job", [0]);
    let echoed = r#"{"id":"x","status_code":200,"payload":"{}","metadata":{"job_id":"job","request_index":"7"}}"#;
    redis.command(&["LPUSH", RESULTS, echoed]);
    push(&redis, "job", [1]);
    until("three good results", || handler.indexes().len() == 3).await;
    handle.stats().drained().await;
    let stats = handle.stats();
    assert_eq!(handler.indexes(), [0, 7, 1]);
    assert_eq!(stats.malformed_total(), 2);
    assert_eq!(stats.unknown_job_total(), 1);
    assert_eq!(stats.duplicates_total(), 1);
    assert_eq!(stats.received_total(), 7);
    shutdown.cancel();
    handle.join().await;
}

#[tokio::test]
async fn results_left_in_flight_by_a_crash_are_handled_first() {
    let redis = RedisServer::start();
    // A predecessor moved these and died before writing them.
    for i in [5u64, 6] {
        let r = ResultMessage::http(request_id("job", i), 200, "{}");
        redis.command(&["LPUSH", INFLIGHT, &r.to_json()]);
    }
    push(&redis, "job", [7]);
    let handler = Recorder::for_jobs(&["job"]);
    let (handle, shutdown) = start(&redis, handler.clone(), 10).await;
    until("three results", || handler.indexes().len() == 3).await;
    let mut first_two = handler.indexes()[..2].to_vec();
    first_two.sort();
    assert_eq!(first_two, [5, 6]);
    assert_eq!(handle.stats().recovered_total(), 2);
    handle.stats().drained().await;
    assert_eq!(redis.command(&["LLEN", INFLIGHT]), ":0");
    shutdown.cancel();
    handle.join().await;
}

#[tokio::test]
async fn a_failing_handler_keeps_results_in_flight_until_it_succeeds() {
    let redis = RedisServer::start();
    let handler = Recorder::for_jobs(&["job"]);
    handler.fail_next.store(3, Ordering::SeqCst);
    push(&redis, "job", 0..5);
    let (handle, shutdown) = start(&redis, handler.clone(), 10).await;
    until("a handler failure", || {
        handle.stats().handler_errors_total() >= 1
    })
    .await;
    assert_eq!(
        redis.command(&["LLEN", INFLIGHT]),
        ":5",
        "kept while unwritten"
    );
    until("all results", || handler.indexes().len() == 5).await;
    assert_eq!(handle.stats().handler_errors_total(), 3);
    handle.stats().drained().await;
    assert_eq!(redis.command(&["LLEN", INFLIGHT]), ":0");
    shutdown.cancel();
    handle.join().await;
}

#[tokio::test]
async fn survives_a_redis_restart() {
    let mut redis = RedisServer::builder().aof(true).start();
    let handler = Recorder::for_jobs(&["job"]);
    let (handle, shutdown) = start(&redis, handler.clone(), 10).await;
    push(&redis, "job", 0..3);
    until("first results", || handler.indexes().len() == 3).await;
    redis.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    redis.restart();
    push(&redis, "job", 3..6);
    until("results after the restart", || handler.indexes().len() == 6).await;
    shutdown.cancel();
    handle.join().await;
}

/// A Redis restarted empty (or flushed) while a reader holds the list: its lease key is gone.
/// The reader takes the lease again and reads what comes next.
#[tokio::test]
async fn a_reader_whose_lease_vanished_takes_it_again_and_reads_on() {
    let mut redis = RedisServer::start();
    let lease = "{llm-d-async:results:pool-a:$batch}:lease";
    let handler = Recorder::for_jobs(&["job"]);
    let (handle, shutdown) = start(&redis, handler.clone(), 10).await;
    push(&redis, "job", 0..3);
    until("first results", || handler.indexes().len() == 3).await;
    let holder = redis.command(&["GET", lease]);
    redis.restart();
    assert_eq!(redis.command(&["EXISTS", lease]), ":0");
    push(&redis, "job", 3..6);
    until("results after the restart", || handler.indexes().len() == 6).await;
    let again = redis.command(&["GET", lease]);
    assert_eq!(
        again.split(' ').take(4).collect::<Vec<_>>(),
        holder.split(' ').take(4).collect::<Vec<_>>(),
        "this process holds the lease again"
    );
    // Flushed under it while it blocks on an empty list: the same.
    redis.command(&["FLUSHALL"]);
    push(&redis, "job", 6..9);
    until("results after the flush", || handler.indexes().len() == 9).await;
    until("the lease taken again", || {
        redis.command(&["EXISTS", lease]) == ":1"
    })
    .await;
    assert_eq!(handler.indexes(), (0..9).collect::<Vec<_>>());
    shutdown.cancel();
    handle.join().await;
}

#[tokio::test]
async fn stops_promptly_while_blocked() {
    let redis = RedisServer::start();
    let (handle, shutdown) = spawn_with(
        &redis,
        Recorder::for_jobs(&[]),
        ConsumerOptions {
            poll_timeout: Duration::from_secs(30),
            ..ConsumerOptions::default()
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), handle.join())
        .await
        .expect("stopped within 5 s despite a 30 s poll");
}

#[tokio::test]
async fn shutdown_while_writes_fail_leaves_the_results_in_flight() {
    let redis = RedisServer::start();
    let handler = Recorder::for_jobs(&["job"]);
    handler.fail_next.store(u32::MAX, Ordering::SeqCst);
    push(&redis, "job", 0..4);
    let (handle, shutdown) = start(&redis, handler.clone(), 10).await;
    until("a handler failure", || {
        handle.stats().handler_errors_total() >= 1
    })
    .await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), handle.join())
        .await
        .expect("stopped although the handler never succeeded");
    assert_eq!(
        redis.command(&["LLEN", INFLIGHT]),
        ":4",
        "kept for the next consumer"
    );
    assert!(handler.indexes().is_empty());
}

/// Writes its first batch, then fails every time.
struct FirstBatchOnly(Arc<Recorder>, AtomicU32);

impl ResultHandler for FirstBatchOnly {
    fn write(&self, results: &[Routed]) -> Result<WriteReport, HandlerError> {
        if self.1.fetch_add(1, Ordering::SeqCst) > 0 {
            return Err(HandlerError("disk full".into()));
        }
        self.0.write(results)
    }
}

#[tokio::test]
async fn only_written_batches_leave_the_in_flight_list() {
    let redis = RedisServer::start();
    push(&redis, "job", 0..30);
    let recorder = Recorder::for_jobs(&["job"]);
    let (handle, shutdown) = spawn_with(
        &redis,
        Arc::new(FirstBatchOnly(recorder.clone(), AtomicU32::new(0))),
        options(10),
    )
    .await;
    until("the second batch failing", || {
        handle.stats().handler_errors_total() >= 1
    })
    .await;
    shutdown.cancel();
    handle.join().await;
    assert_eq!(recorder.indexes(), (0..10).collect::<Vec<_>>());
    // The batch being written and the one taken meanwhile are both still in flight, nothing else.
    let mut in_flight: Vec<u64> = redis
        .command_list(&["LRANGE", INFLIGHT, "0", "-1"])
        .iter()
        .map(|raw| {
            batch_wire::parse_request_id(&ResultMessage::parse(raw).unwrap().id)
                .unwrap()
                .1
        })
        .collect();
    in_flight.sort();
    assert_eq!(in_flight, (10..30).collect::<Vec<_>>());

    // A healthy successor writes them, each once.
    let (handle, shutdown) = start(&redis, recorder.clone(), 10).await;
    until("all results", || recorder.indexes().len() == 30).await;
    assert_eq!(handle.stats().recovered_total(), 20);
    handle.stats().drained().await;
    assert_eq!(redis.command(&["LLEN", INFLIGHT]), ":0");
    shutdown.cancel();
    handle.join().await;
}

#[tokio::test]
async fn a_second_reader_waits_until_the_first_lets_go() {
    let redis = RedisServer::start();
    let first = Recorder::for_jobs(&["job"]);
    let second = Recorder::for_jobs(&["job"]);
    let (a, stop_a) = start(&redis, first.clone(), 10).await;
    until("the first consumer's lease", || {
        redis.command(&["EXISTS", "{llm-d-async:results:pool-a:$batch}:lease"]) == ":1"
    })
    .await;
    let (b, stop_b) = start(&redis, second.clone(), 10).await;
    push(&redis, "job", 0..50);
    until("50 results", || first.indexes().len() == 50).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        second.indexes().is_empty(),
        "the second reader took results"
    );
    // The first stops and releases its lease: the second takes over at once.
    stop_a.cancel();
    a.join().await;
    push(&redis, "job", 50..60);
    until("10 more results", || second.indexes().len() == 10).await;
    assert_eq!(second.indexes(), (50..60).collect::<Vec<_>>());
    stop_b.cancel();
    b.join().await;
}

#[tokio::test]
async fn results_of_jobs_registered_elsewhere_are_parked_not_dropped() {
    let redis = RedisServer::start();
    let keys = ListKeys::new(RESULTS);
    let future = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600)
        .to_string();
    redis.command(&["HSET", &keys.jobs, "elsewhere", &future]);
    redis.command(&["HSET", &keys.jobs, "long-gone", "1000"]);
    let handler = Recorder::for_jobs(&["job"]);
    let (handle, shutdown) = start(&redis, handler.clone(), 10).await;
    push(&redis, "elsewhere", [1, 2]);
    push(&redis, "job", [0]);
    push(&redis, "long-gone", [4]);
    push(&redis, "nobody", [5]);
    until("the local result", || handler.indexes() == [0]).await;
    handle.stats().drained().await;
    let parked = keys.parked_list("elsewhere");
    let kept: Vec<u64> = redis
        .command_list(&["LRANGE", &parked, "0", "-1"])
        .iter()
        .map(|raw| {
            batch_wire::parse_request_id(&ResultMessage::parse(raw).unwrap().id)
                .unwrap()
                .1
        })
        .collect();
    assert_eq!(
        kept,
        [2, 1],
        "kept in the dispatcher's order (oldest on the right)"
    );
    assert_eq!(handle.stats().parked_total(), 2);
    assert_eq!(
        handle.stats().unknown_job_total(),
        2,
        "past deadline or unregistered"
    );
    let ttl: i64 = redis.command(&["TTL", &parked])[1..].parse().unwrap();
    assert!(
        ttl > 3600,
        "the parked list expires after its job's deadline: {ttl}"
    );
    shutdown.cancel();
    handle.join().await;

    // Whoever runs the job later reads its parked list like any other.
    let runner = Recorder::for_jobs(&["elsewhere"]);
    let client = batch_redis::connect(&redis.url(), &Default::default())
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let parked_reader = ResultConsumer::new(
        client.clone(),
        client,
        ListKeys::parked(RESULTS, "elsewhere"),
        runner.clone(),
        ConsumerOptions {
            blocking: false,
            ..options(10)
        },
    )
    .spawn(None, stop.clone());
    until("the parked results", || runner.indexes() == [1, 2]).await;
    stop.cancel();
    parked_reader.join().await;
}

/// A queue entry that names its own result list sends every result of the pool there: the
/// reader hands the results of a job running elsewhere on to the list its requests named,
/// oldest first, and tells that list where they came from; registered-only jobs are parked as
/// before, routes past their deadline are not followed.
#[tokio::test]
async fn results_whose_requests_named_another_list_are_handed_on_to_it() {
    let redis = RedisServer::start();
    let routes = "llm-d-async:result-routes:pool-a";
    let other = "llm-d-async:results:pool-a:$batch-2";
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let keys = ListKeys::new(RESULTS);
    redis.command(&[
        "HSET",
        routes,
        "moved",
        &batch_consumer::route_value(now + 3600, other),
        "expired",
        &batch_consumer::route_value(now - 10, other),
        "parked-here",
        &batch_consumer::route_value(now + 3600, RESULTS),
    ]);
    redis.command(&["HSET", &keys.jobs, "parked-here", &(now + 3600).to_string()]);
    let handler = Recorder::for_jobs(&["job"]);
    let options = ConsumerOptions {
        routes: Some(routes.into()),
        ..options(10)
    };
    let (handle, shutdown) = spawn_with(&redis, handler.clone(), options).await;
    push(&redis, "moved", [1, 2, 3]);
    push(&redis, "job", [0]);
    push(&redis, "expired", [7]);
    push(&redis, "parked-here", [8]);
    until("the local result", || handler.indexes() == [0]).await;
    handle.stats().drained().await;
    let ids = |key: &str| -> Vec<u64> {
        redis
            .command_list(&["LRANGE", key, "0", "-1"])
            .iter()
            .map(|raw| {
                batch_wire::parse_request_id(&ResultMessage::parse(raw).unwrap().id)
                    .unwrap()
                    .1
            })
            .collect()
    };
    assert_eq!(ids(other), [3, 2, 1], "oldest on the right, as pushed");
    assert_eq!(ids(&keys.parked_list("parked-here")), [8]);
    assert_eq!(
        redis.command(&["GET", &ListKeys::new(other).handed_from]),
        RESULTS
    );
    assert_eq!(handle.stats().handed_on_total(), 3);
    assert_eq!(handle.stats().parked_total(), 1);
    assert_eq!(handle.stats().unknown_job_total(), 1, "the expired route");
    assert_eq!(redis.command(&["LLEN", &keys.inflight]), ":0");
    shutdown.cancel();
    handle.join().await;

    // The lost-line search sees what waits in a list, in flight and parked, by id prefix.
    let client = batch_redis::connect(&redis.url(), &Default::default())
        .await
        .unwrap();
    let prefix = &request_id("moved", 0)[..request_id("moved", 0).len() - 1];
    let mut found = batch_consumer::waiting_ids(&client, other, "moved", prefix)
        .await
        .unwrap();
    found.sort();
    assert_eq!(found, [1, 2, 3].map(|i| request_id("moved", i)));
    let parked_prefix = &request_id("parked-here", 0)[..request_id("parked-here", 0).len() - 1];
    let parked = batch_consumer::waiting_ids(&client, RESULTS, "parked-here", parked_prefix)
        .await
        .unwrap();
    assert_eq!(parked, [request_id("parked-here", 8)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_killed_every_few_milliseconds_lose_and_double_nothing() {
    const N: u64 = 50_000;
    let redis = RedisServer::start();
    // Many results at once, as RPUSH of prepared messages in chunks.
    let messages: Vec<String> = (0..N)
        .map(|i| {
            ResultMessage::http(request_id("job", i), 200, format!(r#"{{"n":{i}}}"#)).to_json()
        })
        .collect();
    let filler = batch_redis::connect(&redis.url(), &Default::default())
        .await
        .unwrap();
    for chunk in messages.chunks(1000) {
        let _: i64 = fred::interfaces::ListInterface::lpush(&filler, RESULTS, chunk.to_vec())
            .await
            .unwrap();
    }
    let handler = Recorder::for_jobs(&["job"]);
    let (handle, shutdown) = start(&redis, handler.clone(), 500).await;
    // Kill every client connection but the killer's, every 5 ms, while they drain.
    let port = redis.port();
    let killing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let kills = {
        let killing = killing.clone();
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            let mut killed = 0u32;
            let mut buf = [0u8; 64];
            while killing.load(Ordering::SeqCst) {
                s.write_all(b"CLIENT KILL TYPE normal SKIPME yes\r\n")
                    .unwrap();
                let n = s.read(&mut buf).unwrap();
                if buf[..n].starts_with(b":") && &buf[..n] != b":0\r\n" {
                    killed += 1;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            killed
        })
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    while (handler.written.lock().unwrap().len() as u64) < N {
        assert!(
            Instant::now() < deadline,
            "only {} of {N} results after 300 s",
            handler.written.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    killing.store(false, Ordering::SeqCst);
    let killed = kills.join().unwrap();
    assert!(
        killed > 10,
        "the connections were killed only {killed} times"
    );
    handle.stats().drained().await;
    let written = handler.written.lock().unwrap().clone();
    assert_eq!(written.len() as u64, N);
    assert!((0..N).all(|i| written.contains(&("job".to_owned(), i))));
    // Each result was written once; a batch offered again after a kill is all duplicates.
    let seen = handler.seen.lock().unwrap().len() as u64;
    assert_eq!(seen, N, "a result was written twice");
    assert_eq!(redis.command(&["LLEN", RESULTS]), ":0");
    assert_eq!(redis.command(&["LLEN", INFLIGHT]), ":0");
    shutdown.cancel();
    handle.join().await;
}
