//! The executor against both dispatcher releases the simulator plays: v0.9 (ZPOPMIN, expired
//! requests dropped, requests in hand lost on a crash) and v0.10 (leased claims, reclaimer,
//! `DEADLINE_EXCEEDED` results, `request_token` in results). Each scenario runs against both.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::*;
use batch_executor::{AsyncMode, Executor};
use batch_testkit::both_versions;
use batch_wire::{error_codes, parse_request_id, BatchStatus, Envelope};
use dispatcher_sim::{DispatcherVersion, GatewayConfig};
use tokio_util::sync::CancellationToken;

const QUEUE: &str = "llm-d-async:requests:pool-a";
const RESULTS: &str = "llm-d-async:results:pool-a:$batch";
const CLAIMED: &str = "{llm-d-async:requests:pool-a}:claimed";

fn open_gate(env: &Env) {
    env.redis.command(&["SET", "dispatch-gate-budget", "1"]);
}

fn zcard(env: &Env, key: &str) -> u64 {
    let reply = env.redis.command(&["ZCARD", key]);
    reply
        .trim_start_matches(':')
        .parse()
        .unwrap_or_else(|_| panic!("ZCARD {key}: {reply}"))
}

// ---- A job that completes ----------------------------------------------------------------------

async fn completes(version: DispatcherVersion) {
    let env = Env::start(GatewayConfig::default()).await;
    // Two models in one pool: their positions in the queue follow each other.
    let lines = write_input(&env.path("in.jsonl"), 400, &["llama-3", "llama-3-instruct"]);
    let config = env.async_config(&[("llama-3", "pool-a"), ("llama-3-instruct", "pool-a")], "");
    let sim = env.dispatcher_version(&["pool-a"], version, |_| {}).await;
    let (executor, batch) = run_job(&env, &config).await;
    assert_eq!(batch.status, BatchStatus::Completed);
    assert_eq!(batch.request_counts.completed, 400);
    let results = Results::read(&env.path("out"));
    results.assert_answered(&lines);
    let stats = &executor.mode::<AsyncMode>().unwrap().consumer_stats().await["pool-a"];
    assert_eq!(stats.written_total(), 400);
    // v0.10 sends each line's own token back: none is refused.
    assert_eq!(stats.mismatched_total(), 0);
    assert_eq!(zcard(&env, QUEUE), 0);
    if version == DispatcherVersion::V0_10 {
        // Every claim was acknowledged with its result.
        assert_eq!(env.redis.command(&["HLEN", CLAIMED]), ":0");
    }
    executor.shutdown().await;
    sim.shutdown().await;
}
both_versions!(completes);

// ---- Expiry --------------------------------------------------------------------------------------

/// The gate stays closed: nothing is sent and the processor's own deadline ends the job.
async fn expires_at_its_own_deadline(version: DispatcherVersion) {
    let (env, lines, config, sim) =
        one_pool_version(GatewayConfig::default(), 50, version, closed_gate).await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let mut job = spec(&env, "in.jsonl", "out");
    job.completion_window = Duration::from_secs(3);
    let batch = executor.run(job, CancellationToken::new()).await.unwrap();
    assert_eq!(batch.status, BatchStatus::Expired);
    let results = Results::read(&env.path("out"));
    results.assert_each_once(&lines);
    assert_eq!(results.error_codes().get("batch_expired"), Some(&50));
    assert_eq!(zcard(&env, QUEUE), 0, "pending requests withdrawn");
    assert_eq!(sim.stats().taken, 0);
    assert_eq!(
        executor.mode::<AsyncMode>().unwrap().consumer_stats().await["pool-a"].written_total(),
        0
    );
    executor.shutdown().await;
    sim.shutdown().await;
}
both_versions!(expires_at_its_own_deadline);

/// Rewrites every queued member's `deadline` to `deadline`, as a dispatcher whose clock runs
/// ahead would see it (the processor's own deadline is still far).
fn move_deadlines(env: &Env, deadline: i64) -> usize {
    let members = env
        .redis
        .command_list(&["ZRANGE", QUEUE, "0", "-1", "WITHSCORES"]);
    for pair in members.chunks(2) {
        let mut member: serde_json::Value = serde_json::from_str(&pair[0]).unwrap();
        member["data"]["deadline"] = deadline.into();
        let moved = member.to_string();
        assert_eq!(env.redis.command(&["ZREM", QUEUE, &pair[0]]), ":1");
        assert_eq!(env.redis.command(&["ZADD", QUEUE, &pair[1], &moved]), ":1");
    }
    members.len() / 2
}

/// Requests the dispatcher finds past their deadline: v0.9 drops them without a word (the
/// processor's deadline then closes the lines), v0.10 answers `DEADLINE_EXCEEDED`, which the
/// processor writes as `batch_expired` without waiting for its own deadline.
async fn a_dispatcher_past_the_deadline(version: DispatcherVersion) {
    let (env, lines, config, sim) =
        one_pool_version(GatewayConfig::default(), 50, version, closed_gate).await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let mut job = spec(&env, "in.jsonl", "out");
    let v0_10 = version == DispatcherVersion::V0_10;
    // With v0.10 the results must end the job: its own deadline is out of reach.
    // v0.9: long enough for the members to be moved before the job's own deadline.
    job.completion_window = if v0_10 {
        Duration::from_secs(600)
    } else {
        Duration::from_secs(12)
    };
    let run = executor.run(job, CancellationToken::new());
    let skew = async {
        eventually("the job enqueued", Duration::from_secs(30), || {
            zcard(&env, QUEUE) == 50
        })
        .await;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        assert_eq!(move_deadlines(&env, now - 10), 50);
        open_gate(&env);
    };
    let (batch, ()) = tokio::join!(run, skew);
    let batch = batch.unwrap();
    let results = Results::read(&env.path("out"));
    results.assert_each_once(&lines);
    assert_eq!(results.error_codes().get("batch_expired"), Some(&50));
    for line in &results.error {
        assert_eq!(
            line["error"]["message"],
            error_codes::BATCH_EXPIRED_MESSAGE,
            "{line}"
        );
    }
    let stats = &executor.mode::<AsyncMode>().unwrap().consumer_stats().await["pool-a"];
    if v0_10 {
        assert_eq!(sim.stats().results_for("DEADLINE_EXCEEDED"), 50);
        assert_eq!(stats.written_total(), 50, "every line closed by its result");
        // Every line has a result, so the job is done, long before its deadline.
        assert_eq!(batch.status, BatchStatus::Completed);
        assert_eq!(batch.request_counts.failed, 50);
    } else {
        assert_eq!(sim.stats().dropped_expired, 50);
        assert_eq!(stats.written_total(), 0, "v0.9 answers nothing");
        assert_eq!(batch.status, BatchStatus::Expired);
    }
    executor.shutdown().await;
    sim.shutdown().await;
}
both_versions!(a_dispatcher_past_the_deadline);

// ---- Cancel --------------------------------------------------------------------------------------

/// Cancelled half way: what was answered stays, the rest is `batch_cancelled`, the queue is empty.
async fn cancel_mid_job(version: DispatcherVersion) {
    let (env, lines, config, sim) = one_pool_version(
        fixed_latency(Duration::from_millis(20)),
        600,
        version,
        |c| c.batch_size = 2,
    )
    .await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let cancel = CancellationToken::new();
    let run = executor.run(spec(&env, "in.jsonl", "out"), cancel.clone());
    let out = env.path("out");
    let cancelling = async {
        eventually("some answers", Duration::from_secs(60), || {
            output_lines(&out) >= 20
        })
        .await;
        cancel.cancel();
    };
    let (batch, ()) = tokio::join!(run, cancelling);
    let batch = batch.unwrap();
    assert_eq!(batch.status, BatchStatus::Cancelled);
    let results = Results::read(&out);
    results.assert_each_once(&lines);
    let (statuses, codes) = (results.statuses(), results.error_codes());
    let answered = statuses.get(&200).copied().unwrap_or(0);
    // A line the dispatcher took after the cancel marker was set comes back as its own
    // `CANCELLED`, passed through as the original processor does; the rest are ours.
    let cancelled: usize = ["batch_cancelled", "CANCELLED"]
        .iter()
        .filter_map(|c| codes.get(*c))
        .sum();
    assert!(answered >= 20, "{answered}");
    assert!(cancelled > 0, "cancelled too late to prove anything");
    assert_eq!(
        answered + cancelled,
        600,
        "statuses {statuses:?}, error codes {codes:?}"
    );
    assert_eq!(zcard(&env, QUEUE), 0);
    if version == DispatcherVersion::V0_10 {
        // What the dispatcher had in hand is answered (or cancelled by marker) and acknowledged.
        eventually("claims settled", Duration::from_secs(30), || {
            env.redis.command(&["HLEN", CLAIMED]) == ":0"
        })
        .await;
    }
    executor.shutdown().await;
    sim.shutdown().await;
}
both_versions!(cancel_mid_job);

// ---- A dispatcher killed mid-job -----------------------------------------------------------------

/// v0.9 loses what the dispatcher had in hand: only the processor's `lost_request_timeout`
/// brings it back. v0.10 keeps it claimed: the next dispatcher's reclaimer puts it back once
/// the lease runs out, and the processor's timeout (10 minutes here) never comes into play.
async fn dispatcher_killed_mid_job(version: DispatcherVersion) {
    let env = Env::start(fixed_latency(Duration::from_millis(50))).await;
    let v0_10 = version == DispatcherVersion::V0_10;
    let lines = write_input(&env.path("in.jsonl"), 300, &["llama-3"]);
    let lost = if v0_10 { "10m" } else { "1s" };
    let config = env.async_config(
        &[("llama-3", "pool-a")],
        &format!("  lost_request_timeout: {lost}\n"),
    );
    // At time scale 0.01, a 100 s lease is 1 s.
    let lease = Duration::from_secs(100);
    let crashing = env
        .dispatcher_version(&["pool-a"], version, |c| {
            c.sim.crash_after = Some(100);
            c.sim.claim_lease = lease;
            c.batch_size = 40;
        })
        .await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let job = executor.run(spec(&env, "in.jsonl", "out"), CancellationToken::new());
    let recover = async {
        crashing.crashed().await;
        if v0_10 {
            // The requests it had in hand are still claimed, not lost.
            assert_ne!(env.redis.command(&["HLEN", CLAIMED]), ":0");
        }
        env.dispatcher_version(&["pool-a"], version, |c| c.sim.claim_lease = lease)
            .await
    };
    let (batch, replacement) = tokio::join!(job, recover);
    let batch = batch.unwrap();
    assert_eq!(batch.status, BatchStatus::Completed);
    let results = Results::read(&env.path("out"));
    results.assert_answered(&lines);
    assert_eq!(batch.request_counts.completed, 300);
    if v0_10 {
        assert!(
            replacement.stats().reclaimed > 0,
            "{:?}",
            replacement.stats()
        );
        assert_eq!(env.redis.command(&["HLEN", CLAIMED]), ":0");
    }
    executor.shutdown().await;
    replacement.shutdown().await;
    crashing.shutdown().await;
}
both_versions!(dispatcher_killed_mid_job);

// ---- Results v0.10 may send ----------------------------------------------------------------------

/// A result with another line's token is dropped and counted; a payload given as a JSON object
/// is read; an unknown error code becomes the error line's code.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn results_are_checked_against_their_lines_token() {
    let (env, lines, config, sim) = one_pool_version(
        GatewayConfig::default(),
        20,
        DispatcherVersion::V0_10,
        closed_gate,
    )
    .await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let run = executor.run(spec(&env, "in.jsonl", "out"), CancellationToken::new());
    let stats = async {
        eventually("the job enqueued", Duration::from_secs(30), || {
            zcard(&env, QUEUE) == 20
        })
        .await;
        let mut token = BTreeMap::new();
        for member in env.redis.command_list(&["ZRANGE", QUEUE, "0", "-1"]) {
            let e = Envelope::parse(&member).unwrap();
            let line = parse_request_id(&e.data.id).unwrap().1;
            token.insert(line, (e.data.id.clone(), e.internal.request_token.unwrap()));
        }
        let push = |r: serde_json::Value| {
            env.redis.command(&["LPUSH", RESULTS, &r.to_string()]);
        };
        // Lines 0-4: another attempt's token (the line's id, a token it was never sent with).
        for line in 0..5 {
            let (id, _) = &token[&line];
            push(serde_json::json!({"id": id, "status_code": 200,
                "payload": "{\"from\":\"another attempt\"}", "request_token": "0000000000000000"}));
        }
        // Line 5: its own token, the payload as an object.
        let (id, t) = &token[&5];
        push(
            serde_json::json!({"id": id, "status_code": 200, "request_token": t,
            "payload": {"id": "chatcmpl-object", "choices": []}}),
        );
        // Line 6: its own token, a code this processor has never heard of.
        let (id, t) = &token[&6];
        push(
            serde_json::json!({"id": id, "request_token": t, "payload": "{\"error\":\"gone\"}",
            "error_code": "PAYLOAD_UNAVAILABLE", "error_message": "payload gone"}),
        );
        // Line 7: no token at all (v0.9): accepted.
        let (id, _) = &token[&7];
        push(
            serde_json::json!({"id": id, "status_code": 200, "payload": "{\"id\":\"chatcmpl-v09\"}"}),
        );
        let consumer =
            executor.mode::<AsyncMode>().unwrap().consumer_stats().await["pool-a"].clone();
        eventually("the pushed results read", Duration::from_secs(30), || {
            consumer.mismatched_total() == 5 && consumer.written_total() == 3
        })
        .await;
        open_gate(&env);
        consumer
    };
    let (batch, consumer) = tokio::join!(run, stats);
    let batch = batch.unwrap();
    assert_eq!(batch.status, BatchStatus::Completed);
    let results = Results::read(&env.path("out"));
    results.assert_each_once(&lines);
    let by_line = |n: usize| {
        results
            .output
            .iter()
            .chain(&results.error)
            .find(|l| l["custom_id"] == format!("req-{n}"))
            .unwrap()
            .clone()
    };
    // The refused results left their lines to the dispatcher's real answers.
    for n in 0..5 {
        let l = by_line(n);
        assert!(
            l["response"]["body"]["id"]
                .as_str()
                .unwrap()
                .starts_with("chatcmpl-"),
            "{l}"
        );
        assert!(l["response"]["body"].get("from").is_none(), "{l}");
    }
    assert_eq!(by_line(5)["response"]["body"]["id"], "chatcmpl-object");
    assert_eq!(by_line(6)["error"]["code"], "PAYLOAD_UNAVAILABLE");
    assert_eq!(by_line(6)["error"]["message"], "payload gone");
    assert_eq!(by_line(7)["response"]["body"]["id"], "chatcmpl-v09");
    assert_eq!(consumer.mismatched_total(), 5);
    // Lines 5-7 were answered by us; the dispatcher's own answers to them are duplicates.
    assert_eq!(consumer.written_total(), 20);
    executor.shutdown().await;
    sim.shutdown().await;
}

// ---- Plan order in the queue ---------------------------------------------------------------------

/// Line indices of the input in plan order: by the hash of the system prompt, then by line.
fn plan_order(lines: &[String]) -> Vec<u64> {
    let mut keyed: Vec<(u32, u64)> = lines
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let system = v["body"]["messages"][0]["content"].as_str().unwrap();
            (batch_wire::hash::fnv1a_32(system.as_bytes()), i as u64)
        })
        .collect();
    keyed.sort();
    keyed.into_iter().map(|(_, i)| i).collect()
}

/// Two jobs of one deadline, gate closed: each job's scores strictly increase in its plan order,
/// their integer part is the deadline, and the two jobs interleave.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_queue_holds_each_job_in_plan_order() {
    let env = Env::start(GatewayConfig::default()).await;
    let lines = write_input(&env.path("a.jsonl"), 150, &["llama-3"]);
    write_input(&env.path("b.jsonl"), 150, &["llama-3"]);
    let order = plan_order(&lines);
    assert_ne!(
        order,
        (0..150).collect::<Vec<_>>(),
        "plan order is not file order"
    );
    let config = env.async_config(&[("llama-3", "pool-a")], "");
    let sim = env
        .dispatcher_version(&["pool-a"], DispatcherVersion::V0_10, closed_gate)
        .await;
    let executor = Executor::new(load(&config)).await.unwrap();
    // Both jobs need one deadline (whole seconds): start them early in a second, and try again
    // in the rare case that preparing them crossed into the next one.
    let mut attempt = 0;
    let (members, deadline) = loop {
        attempt += 1;
        assert!(attempt <= 3, "the two jobs never shared a deadline");
        let frac = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .subsec_millis();
        tokio::time::sleep(Duration::from_millis(u64::from(1000 - frac) + 20)).await;
        let cancel = CancellationToken::new();
        let (a_out, b_out) = (format!("a-{attempt}"), format!("b-{attempt}"));
        let specs = [spec(&env, "a.jsonl", &a_out), spec(&env, "b.jsonl", &b_out)];
        let runs = executor.run_all(&specs, cancel.clone());
        let look = async {
            eventually("both jobs enqueued", Duration::from_secs(30), || {
                zcard(&env, QUEUE) == 300
            })
            .await;
            let members = env
                .redis
                .command_list(&["ZRANGE", QUEUE, "0", "-1", "WITHSCORES"]);
            cancel.cancel();
            members
        };
        let (batches, members) = tokio::join!(runs, look);
        let deadlines: Vec<i64> = batches.into_iter().map(|b| b.unwrap().expires_at).collect();
        eventually("both jobs withdrawn", Duration::from_secs(30), || {
            zcard(&env, QUEUE) == 0
        })
        .await;
        if deadlines[0] == deadlines[1] {
            break (members, deadlines[0]);
        }
    };

    let mut by_job: BTreeMap<String, Vec<(u64, f64)>> = BTreeMap::new();
    let mut sequence = Vec::new();
    for pair in members.chunks(2) {
        let e = Envelope::parse(&pair[0]).unwrap();
        let (job, line) = parse_request_id(&e.data.id).unwrap();
        let score: f64 = pair[1].parse().unwrap();
        assert_eq!(score.floor() as i64, deadline, "{}", pair[1]);
        assert_eq!(e.data.deadline, deadline);
        sequence.push(job.clone());
        by_job.entry(job).or_default().push((line, score));
    }
    assert_eq!(by_job.len(), 2);
    for (job, got) in &by_job {
        let lines: Vec<u64> = got.iter().map(|(l, _)| *l).collect();
        assert_eq!(lines, order, "job {job} out of plan order");
        for w in got.windows(2) {
            assert!(
                w[0].1 < w[1].1,
                "job {job}: scores {} then {}",
                w[0].1,
                w[1].1
            );
        }
    }
    // Interleaved: the jobs alternate (equal positions share a score), not one after the other.
    let switches = sequence.windows(2).filter(|w| w[0] != w[1]).count();
    assert!(switches >= 250, "{switches} switches between the jobs");
    executor.shutdown().await;
    sim.shutdown().await;
}
