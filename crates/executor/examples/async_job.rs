//! Enqueues a job's requests into the llm-d-async dispatcher's request queue and consumes their
//! results: the two halves of async mode, with the crates the executor runs them with.
//!
//! - `batch-producer` turns each input line into the envelope the dispatcher reads and ZADDs it
//!   to `llm-d-async:requests:<pool>`, scored by the job's deadline;
//! - the dispatcher (here the simulator of `tools/dispatcher-sim`, with its gateway, in this
//!   process) sends each to the gateway and LPUSHes the answer onto the result list the envelope
//!   names;
//! - `batch-consumer` holds the result list's lease and hands the results, routed back to their
//!   job and line, to a [`ResultHandler`], acknowledging them once it returns.
//!
//! The executor's async mode does the same with the plan of an input file and writes the
//! results to the job's files. Redis is a `redis-server` from `PATH`, started on a free loopback
//! port by `batch-testkit` and stopped at the end.
//!
//! ```text
//! cargo run -p batch-executor --example async_job
//! ```

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use batch_consumer::{
    Acquired, ConsumerOptions, HandlerError, Lease, ResultConsumer, ResultHandler, Routed,
    WriteReport,
};
use batch_keys::{ListKeys, QueueNames};
use batch_producer::{JobMessages, Producer, ProducerOptions, Request};
use batch_redis::ConnectOptions;
use batch_wire::Outcome;
use dispatcher_sim::{Dispatcher, DispatcherConfig, Gateway, GatewayConfig, QueueEntry};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

type Error = Box<dyn std::error::Error>;

/// Lines in the job.
const LINES: u64 = 50;
/// The inference pool the job's model is served by: it names both queues.
const POOL: &str = "pool-a";

/// Keeps each line's outcome (its HTTP status, or the error code of a request that got no
/// answer), and wakes `main` once every line has one.
#[derive(Default)]
struct Collect {
    outcomes: Mutex<BTreeMap<u64, String>>,
    all_in: Notify,
}

impl ResultHandler for Collect {
    fn write(&self, results: &[Routed]) -> Result<WriteReport, HandlerError> {
        let mut outcomes = self.outcomes.lock().expect("not poisoned");
        let mut report = WriteReport::default();
        for routed in results {
            let outcome = match routed.result.outcome() {
                Outcome::Http { status, .. } => status.to_string(),
                Outcome::Failed { code, message } => format!("{code}: {message}"),
            };
            // A result can come twice (a retried acknowledgement); each line counts once.
            match outcomes.insert(routed.index, outcome) {
                None => report.written += 1,
                Some(_) => report.duplicates += 1,
            }
        }
        if outcomes.len() as u64 == LINES {
            self.all_in.notify_one();
        }
        Ok(report)
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let redis = batch_testkit::RedisServer::start();
    let gateway = Gateway::start("127.0.0.1:0".parse()?, GatewayConfig::default()).await?;
    let names = QueueNames::default();
    let request_queue = names.request_queue_name(POOL)?;
    let result_queue = names.result_queue_name(POOL)?;

    // The dispatcher: polls the request queue every 20 ms; a queue without `igw_base_url` is
    // served by the gateway given here.
    let mut dispatcher = DispatcherConfig::new(redis.url(), vec![QueueEntry::new(&request_queue)]);
    dispatcher.poll_interval = Duration::from_millis(20);
    let dispatcher = Dispatcher::start(dispatcher, Some(&gateway)).await?;

    let client = batch_redis::connect(&redis.url(), &ConnectOptions::default()).await?;

    // Consume first: the consumer's blocking pop wants a connection of its own.
    let keys = ListKeys::new(&result_queue);
    let options = ConsumerOptions {
        poll_timeout: Duration::from_millis(200),
        ..ConsumerOptions::default()
    };
    let Acquired::Taken(lease) =
        Lease::try_acquire(&client, &keys.lease, options.lease_ttl).await?
    else {
        return Err(format!("another process reads {result_queue}").into());
    };
    let reader = batch_redis::connect(&redis.url(), &ConnectOptions::default()).await?;
    let collect = Arc::new(Collect::default());
    let shutdown = CancellationToken::new();
    let consumer = ResultConsumer::new(reader, client.clone(), keys, collect.clone(), options)
        .spawn(Some(lease), shutdown.clone());

    // Enqueue the job's requests.
    let created = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() as i64;
    let job = JobMessages {
        job_id: "batch_example".into(),
        created,
        deadline: created + 24 * 3600,
        request_queue,
        result_queue,
        headers: BTreeMap::new(),
    };
    // The lines go to a blocking thread, which builds the members while earlier ones are sent.
    let scores = job.clone();
    let requests = (0..LINES).map(move |index| {
        Ok::<_, Infallible>(Request {
            index,
            score: scores.score_at(index),
            line: input_line(index).into_bytes(),
        })
    });
    let producer = Producer::new(client, ProducerOptions::default());
    let enqueued = producer.enqueue_requests(&job, requests).await?;
    println!(
        "enqueued {} requests into {}",
        enqueued.added, job.request_queue
    );

    let waited = tokio::time::timeout(Duration::from_secs(30), collect.all_in.notified()).await;
    shutdown.cancel();
    consumer.join().await;
    dispatcher.shutdown().await;
    gateway.shutdown().await;

    let outcomes = collect.outcomes.lock().expect("not poisoned").clone();
    println!(
        "{} results consumed from {}",
        outcomes.len(),
        job.result_queue
    );
    if waited.is_err() || outcomes.len() as u64 != LINES || outcomes.values().any(|o| o != "200") {
        return Err(format!("expected {LINES} answers of 200, got {outcomes:?}").into());
    }
    Ok(())
}

/// Line `i` of the job, in the OpenAI batch input format.
fn input_line(i: u64) -> String {
    serde_json::json!({
        "custom_id": format!("req-{i}"),
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "llama-3",
            "messages": [{"role": "user", "content": format!("question {i}")}],
            "max_tokens": 8,
        },
    })
    .to_string()
}
