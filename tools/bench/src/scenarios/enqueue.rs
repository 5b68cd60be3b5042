//! Enqueue (and cancel) a job with the gate closed: nothing takes members out of the set.

use std::path::Path;
use std::time::{Duration, Instant};

use batch_executor::Executor;
use batch_producer::{request_token, JobMessages, Producer, ProducerOptions};
use batch_wire::BatchStatus;
use fred::interfaces::{KeysInterface, SortedSetsInterface, TransactionInterface};
use fred::types::Expiration;
use tokio_util::sync::CancellationToken;

use super::{
    async_config, blocking, limits, lines, plan, ready, record_until, spec, with_executor, Ctx,
};
use crate::inputs::{write_input, POOL};
use crate::lab::Lab;
use crate::redis_benchmark::RedisBenchmark;
use crate::report::{Kind, Report, Row, Target, Unit};
use crate::stats::Summary;
use crate::BenchError;

const ENQUEUE: &str = "Enqueue";
const CANCEL: &str = "Cancel";
const RATE: Unit = Unit::PerSecond("req/s");

pub(crate) async fn run(cx: Ctx<'_>, report: &mut Report) -> Result<(), BenchError> {
    let Ctx { lab, s, progress } = cx;
    let n = s.enqueue_lines;
    // On a cluster the rows get their own scenario names, beside the single-server ones.
    let (enqueue, cancel) = (lab.scenario(ENQUEUE), lab.scenario(CANCEL));
    let cluster = lab.cluster_primaries().is_some();
    let input = lab.path("enqueue.jsonl");
    let bytes = write_input(&input, n, s.request_bytes)?;
    let config = async_config(lab, "enqueue")?;
    let queue = config.try_queue_names()?.request_queue_name(POOL)?;
    let chunk = config.async_dispatch.enqueue_chunk;

    // Planning alone: the validating pass and the plan files.
    let mut plan_secs = Vec::new();
    for run in 0..s.short_runs {
        let dir = lab.fresh_dir(&format!("plan-{run}"))?;
        let input = input.clone();
        let secs = blocking(move || {
            let t = Instant::now();
            plan(&input, &dir)?;
            Ok(t.elapsed().as_secs_f64())
        })
        .await?;
        plan_secs.push(secs);
    }
    progress(&format!(
        "   planning {} lines: {:.3} s",
        lines(n),
        Summary::new(plan_secs.clone()).median()
    ));

    // The members as the producer writes them, and the limit's member of their size.
    let result_queue = batch_keys::QueueNames::new(batch_keys::DEFAULT_PREFIX, "enqueue")
        .and_then(|names| names.result_queue_name(POOL))?;
    let messages = super::job_messages("batch_producer", queue.clone(), result_queue);
    let text = std::fs::read_to_string(&input).map_err(|e| BenchError::io(&input, e))?;
    let members = super::members(&messages, &text)?;
    drop(text);
    let member_bytes = members.iter().map(String::len).sum::<usize>() / members.len().max(1);
    let prefix = "m:__rand_int__:";
    let pad = "x".repeat(member_bytes.saturating_sub(prefix.len() + 8));
    let member = format!("{prefix}{pad}");
    let bench = RedisBenchmark::new(lab.port_of("bench:zadd")?, s.redis_benchmark_requests, 1);
    let zadd = ["ZADD", "bench:zadd", "1", &member];

    // The executor path: validate, plan, enqueue; then cancel the job. Each run is followed
    // by a run of the limit, so the two meet the same spell of this machine.
    let paired = PairedLimit {
        bench: RedisBenchmark {
            pipeline: 32,
            ..bench.clone()
        },
        member: member.clone(),
    };
    let (rates, cancel_secs, to_queue, after_prepare, pair_ratios) =
        with_executor(config, async |executor| {
            executor_runs(cx, executor, &input, &queue, &paired).await
        })
        .await?;

    // The producer alone, and the naive baseline, on members built beforehand.

    let producer = Producer::new(
        lab.client().clone(),
        ProducerOptions {
            chunk,
            ..ProducerOptions::default()
        },
    );
    let mut producer_rates = Vec::new();
    for _ in 0..s.short_runs {
        lab.flush_redis().await?;
        let batch = members.clone();
        let t = Instant::now();
        let added = producer.enqueue(&queue, messages.score(), batch).await?;
        let secs = t.elapsed().as_secs_f64();
        if added != n as u64 {
            return Err(BenchError::Check(format!(
                "the producer added {added} of {n} members"
            )));
        }
        producer_rates.push(n as f64 / secs);
    }

    // The baseline's MULTI spans keys of several slots, which a cluster refuses.
    let mut naive_rates = Vec::new();
    for _ in 0..if cluster { 0 } else { s.long_runs } {
        lab.flush_redis().await?;
        let t = Instant::now();
        naive_enqueue(lab, &messages, &queue, &members).await?;
        naive_rates.push(n as f64 / t.elapsed().as_secs_f64());
        if lab.zcard(&queue).await? != n as u64 {
            return Err(BenchError::Check("the naive baseline lost members".into()));
        }
    }
    drop(members);

    // The limit: redis-benchmark ZADD of members of the same size, one per command.
    let limits = limits::by_pipeline(lab, s, &bench, None, &zadd).await?;
    let (best_pipeline, best) = crate::stats::best_median(&limits);
    let limit_name = format!("redis-benchmark ZADD, -P {best_pipeline}");

    let plan = Summary::new(plan_secs);
    // A rate against the best redis-benchmark ZADD.
    let rate_row = |figure: String, runs: Vec<f64>| {
        Row::new(&enqueue, figure, RATE, Summary::new(runs)).limit(&limit_name, best)
    };
    let whole = format!(
        "executor: validate + plan + ZADD, {} lines of {} B",
        lines(n),
        bytes / n.max(1) as u64
    );
    report
        .rows
        .push(rate_row(whole, rates).target(Target::RatioAtLeast(1.0)));
    report.rows.push(Row::new(
        &enqueue,
        "executor ÷ redis-benchmark ZADD -P 32 run right after it (each run paired)",
        Unit::Percent,
        Summary::new(pair_ratios),
    ));
    report.rows.push(Row::new(
        &enqueue,
        "of which validating and planning (Plan::build alone)",
        Unit::Seconds,
        plan.clone(),
    ));
    let after = "executor: enqueue (read, build and ZADD every member, after validation)";
    report
        .rows
        .push(rate_row(after.into(), after_prepare).target(Target::RatioAtLeast(0.8)));
    let producer = "Producer::enqueue of pre-built members";
    report.rows.push(rate_row(producer.into(), producer_rates));
    if !cluster {
        let naive = "baseline: one MULTI (DEL, SET, ZADD) per request";
        report
            .rows
            .push(rate_row(naive.into(), naive_rates).kind(Kind::Baseline));
    }
    limits::push_rows(report, &enqueue, RATE, limits, |p| {
        format!("redis-benchmark ZADD, -P {p}")
    });
    report.rows.push(Row::new(
        &cancel,
        format!(
            "cancel with {} members pending: until none is left",
            lines(n)
        ),
        Unit::Seconds,
        Summary::new(cancel_secs),
    ));
    if cluster {
        return super::cluster::enqueue_limits(lab, s, report, &member, member_bytes).await;
    }
    report.note(ENQUEUE, format!(
        "The executor figure runs from `Executor::prepare` (validation and planning included) until the job's `dispatched` counter reaches its {} lines, through the real async path, with no dispatcher taking members (a closed gate). Planning alone took {:.0} ms of the {:.0} ms (median). The ≥ 100 % target applies to this whole figure. The paired row divides each executor run's rate by that of one `redis-benchmark -P 32` ZADD run made right after it, so both meet the same spell of this machine, whose speed swings from run to run. The row after it leaves out `Executor::prepare` (validation, planning, opening the result files: ingestion, which must finish before anything is sent, since an invalid file sends nothing), measured in the same runs.",
        lines(n), plan.median() * 1000.0, Summary::new(to_queue).median() * 1000.0
    ));
    report.note(ENQUEUE, "Planning reads the file in blocks of 1 MiB on one thread (hashing it, finding its line ends with SIMD) and checks lines on two: the usual line is read by hand in one pass, its message text skipped 32 bytes at a time, and serde reads only the lines of any other shape. Members are written field by field around the line's raw body. What bounds the figure: redis-server takes one core for the ZADDs (the variadic ZADD after planning beats one member per command), so planning's time adds to the total. Redis's work per member is the same whoever sends it: `perf record -a` of this scenario puts siphash first among redis-server's own functions (about a sixth of its samples; Redis 7.0 hashes a new member twice, to look it up and to add it), then the copies of the member and the socket reads; the variadic ZADD saves only the per-command part. Validation cannot overlap the sends (the dispatcher takes any member it sees, and an invalid file must send nothing), so the ratio comes out near 100 %, above or below it with this machine's noise.");
    report.note(ENQUEUE, format!(
        "Members are {member_bytes} bytes on average (the envelope around a {} B input line). The producer sends variadic ZADDs of {chunk} members, 4 in flight.",
        bytes / n.max(1) as u64
    ));
    report.note(ENQUEUE, format!(
        "The limit is the best median of `redis-benchmark -c 50 -n {} -r 100000000000 ZADD bench:zadd 1 m:__rand_int__:<{member_bytes} B>` with `-P 1` and `-P 32` (one member per command; `__rand_int__` makes members unique).",
        s.redis_benchmark_requests
    ));
    report.note(ENQUEUE, "The baseline is the original Go producer's way: per request one MULTI of DEL request-cancel:<id>, SET request-active:<id> <token> PX <ttl>, ZADD, EXEC, awaited one by one.");
    report.note(CANCEL, format!(
        "Measured in the enqueue runs: from the cancel until `execute` returned the job `cancelled`, its pending members removed with batched ZREMs (a Lua script, {chunk} per call) and every line written as `batch_cancelled`; the set was checked empty after each run."
    ));
    Ok(())
}

/// One MULTI/EXEC per request, as the original producer enqueues.
async fn naive_enqueue(
    lab: &Lab,
    messages: &JobMessages,
    queue: &str,
    members: &[String],
) -> Result<(), BenchError> {
    let client = lab.client();
    let ttl_ms = Duration::from_secs((messages.deadline - messages.created).max(1) as u64)
        .as_millis() as i64;
    for (i, member) in members.iter().enumerate() {
        let id = batch_wire::request_id(&messages.job_id, i as u64);
        let token = request_token(&messages.job_id, messages.created, i as u64);
        let trx = client.multi();
        let _: () = trx.del(batch_keys::cancel_marker_key(&id)).await?;
        let _: () = trx
            .set(
                format!("request-active:{id}"),
                token,
                Some(Expiration::PX(ttl_ms)),
                None,
                false,
            )
            .await?;
        let _: () = trx
            .zadd(
                queue,
                None,
                None,
                false,
                false,
                (messages.score(), member.as_str()),
            )
            .await?;
        let _: Vec<fred::types::Value> = trx.exec(true).await?;
    }
    Ok(())
}

/// Per run: enqueue the job through the executor until it is all in the set, then cancel it.
/// Returns the enqueue rates, the cancel times, the enqueue times and the rates after
/// `prepare` (validation and planning) returned.
async fn executor_runs(
    cx: Ctx<'_>,
    executor: &Executor,
    input: &Path,
    queue: &str,
    paired: &PairedLimit,
) -> Result<Runs, BenchError> {
    let Ctx { lab, s, progress } = cx;
    let (mut rates, mut cancel_secs, mut to_queue, mut after_prepare, mut pair_ratios) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for run in 0..s.short_runs {
        lab.flush_redis().await?;
        let out = lab.fresh_dir(&format!("enqueue-{run}"))?;
        let cancel = CancellationToken::new();
        let start = Instant::now();
        let job = ready(
            executor,
            &spec(input, &out, Some(format!("batch_enqueue{run}"))),
        )
        .await?;
        let prepared = start.elapsed();
        let total = job.progress().borrow().counts.total;
        let rx = job.progress();
        let execute = executor.execute(job, cancel.clone());
        tokio::pin!(execute);
        let enqueued = tokio::select! {
            seen = record_until(rx, start, |p| p.dispatched >= total, std::future::pending()) => seen.last().map(|(t, _)| *t).unwrap_or_default(),
            ended = &mut execute => return Err(BenchError::Check(format!("enqueue run {run}: the job ended before it was enqueued: {:?}", ended.map(|b| b.status)))),
        };
        let queued = lab.zcard(queue).await;
        let cancelled_at = Instant::now();
        cancel.cancel();
        let batch = execute.await?;
        let ended = Instant::now();
        let (queued, left) = (queued?, lab.zcard(queue).await?);
        if queued != total || batch.status != BatchStatus::Cancelled || left != 0 {
            return Err(BenchError::Check(format!(
                "enqueue run {run}: {queued} of {total} members queued, job {}, {left} members left after the cancel",
                batch.status.as_str()
            )));
        }
        rates.push(total as f64 / enqueued.as_secs_f64());
        to_queue.push(enqueued.as_secs_f64());
        after_prepare.push(total as f64 / (enqueued - prepared).as_secs_f64());
        cancel_secs.push(ended.duration_since(cancelled_at).as_secs_f64());
        lab.flush_redis().await?;
        let limit = paired.run().await?;
        pair_ratios.push(rates[run] / limit);
        progress(&format!(
            "   run {run}: {} lines enqueued in {:.3} s ({:.0} % of redis-benchmark's {} req/s right after), cancelled in {:.3} s",
            lines(total as usize),
            enqueued.as_secs_f64(),
            pair_ratios[run] * 100.0,
            crate::report::thousands(limit),
            cancel_secs[run]
        ));
    }
    Ok((rates, cancel_secs, to_queue, after_prepare, pair_ratios))
}

/// Per executor run: its rate, cancel time, time to queue everything, rate after `prepare`,
/// and its rate over that of the limit run right after it.
type Runs = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

/// The limit run after each executor run: `redis-benchmark -P 32` ZADD of one member per
/// command.
struct PairedLimit {
    bench: RedisBenchmark,
    member: String,
}

impl PairedLimit {
    async fn run(&self) -> Result<f64, BenchError> {
        let (bench, member) = (self.bench.clone(), self.member.clone());
        blocking(move || bench.run(&["ZADD", "bench:zadd", "1", &member])).await
    }
}
