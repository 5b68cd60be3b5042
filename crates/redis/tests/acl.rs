//! ACL users: the rule the README documents is enough for the processor's commands; a user
//! without them gets an error that names NOPERM and the command.

mod common;

use std::time::{Duration, Instant};

use common::{add_user, documented_rule};

use batch_redis::{connect, ConnectError, ConnectOptions};
use batch_testkit::RedisServer;
use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};

async fn run(client: &Client, command: &'static str, args: &[&str]) -> Result<Value, Error> {
    let (name, sub) = match command.split_once(' ') {
        Some((name, sub)) => (name, Some(sub)),
        None => (command, None),
    };
    let mut all: Vec<Value> = sub.into_iter().map(Value::from).collect();
    all.extend(args.iter().map(|a| Value::from(*a)));
    client
        .custom(
            CustomCommand::new_static(name, ClusterHash::FirstKey, false),
            all,
        )
        .await
}

/// Every command of the processor's set, on keys of the processor's names.
const SESSION: &[(&str, &[&str])] = &[
    ("PING", &[]),
    (
        "ZADD",
        &["llm-d-async:requests:pool-a", "1", "m1", "2", "m2"],
    ),
    ("ZSCORE", &["llm-d-async:requests:pool-a", "m1"]),
    ("ZMSCORE", &["llm-d-async:requests:pool-a", "m1", "m2"]),
    ("ZSCAN", &["llm-d-async:requests:pool-a", "0"]),
    (
        "ZRANGEBYSCORE",
        &["llm-d-async:requests:pool-a", "-inf", "+inf"],
    ),
    ("ZCARD", &["llm-d-async:requests:pool-a"]),
    ("ZREM", &["llm-d-async:requests:pool-a", "m2"]),
    ("LPUSH", &["llm-d-async:results:pool-a:$batch", "r1"]),
    ("RPUSH", &["llm-d-async:results:pool-a:$batch", "r2"]),
    ("LLEN", &["llm-d-async:results:pool-a:$batch"]),
    ("LRANGE", &["llm-d-async:results:pool-a:$batch", "0", "-1"]),
    ("LINDEX", &["llm-d-async:results:pool-a:$batch", "0"]),
    (
        "LMOVE",
        &[
            "llm-d-async:results:pool-a:$batch",
            "llm-d-async:results:pool-a:$batch:inflight",
            "RIGHT",
            "LEFT",
        ],
    ),
    (
        "BLMOVE",
        &[
            "llm-d-async:results:pool-a:$batch",
            "llm-d-async:results:pool-a:$batch:inflight",
            "RIGHT",
            "LEFT",
            "0.1",
        ],
    ),
    (
        "LTRIM",
        &["llm-d-async:results:pool-a:$batch:inflight", "0", "-2"],
    ),
    ("RPUSH", &["llm-d-async:results:pool-a:$batch", "r3"]),
    (
        "RENAMENX",
        &["llm-d-async:results:pool-a:$batch", "llm-d-async:taken"],
    ),
    ("RENAME", &["llm-d-async:taken", "llm-d-async:taken-2"]),
    ("EXISTS", &["llm-d-async:taken-2"]),
    ("DEL", &["llm-d-async:taken-2"]),
    (
        "SET",
        &["request-cancel:batch_req_x_1", "token", "EX", "60"],
    ),
    ("GET", &["request-cancel:batch_req_x_1"]),
    ("PEXPIRE", &["request-cancel:batch_req_x_1", "60000"]),
    ("PTTL", &["request-cancel:batch_req_x_1"]),
    ("HSET", &["llm-d-async:jobs", "job-1", "running"]),
    ("HGET", &["llm-d-async:jobs", "job-1"]),
    ("HEXISTS", &["llm-d-async:jobs", "job-1"]),
    ("HGETALL", &["llm-d-async:jobs"]),
    ("HSCAN", &["llm-d-async:jobs", "0"]),
    ("HDEL", &["llm-d-async:jobs", "job-1"]),
    ("INCR", &["dispatch-gate-budget"]),
    (
        "EVAL",
        &[
            "if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then \
             redis.call('SET', 'request-cancel:' .. ARGV[2], 't', 'EX', 60) end \
             return redis.call('LLEN', KEYS[2])",
            "2",
            "llm-d-async:requests:pool-a",
            "llm-d-async:results:pool-a:$batch",
            "gone",
            "batch_req_x_2",
        ],
    ),
    ("SCRIPT LOAD", &["return 1"]),
    (
        "SCRIPT EXISTS",
        &["e0e1f9fabfc9d4800c877a703b823ac0578ff8db"],
    ),
    (
        "EVALSHA",
        &["e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "0"],
    ),
];

#[tokio::test]
async fn the_documented_rule_allows_every_processor_command() {
    let redis = RedisServer::start();
    add_user(&redis, &documented_rule(), "s3cret-pw");
    let url = format!("redis://batch:s3cret-pw@127.0.0.1:{}", redis.port());
    let client = connect(&url, &ConnectOptions::default()).await.unwrap();
    for (command, args) in SESSION {
        if let Err(e) = run(&client, command, args).await {
            panic!("{command} {args:?} refused for the documented ACL user: {e}");
        }
    }
    // The script's SET reached its key: the cancel marker exists.
    assert_eq!(
        redis.command(&["EXISTS", "request-cancel:batch_req_x_2"]),
        ":1"
    );

    // Other keys stay out of reach.
    let err = run(&client, "GET", &["someone-else:secret"])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("NOPERM"), "{err}");
}

#[tokio::test]
async fn a_user_without_the_commands_gets_an_error_naming_noperm_and_the_command() {
    let redis = RedisServer::start();
    let rule: Vec<String> = "ACL SETUSER reader on >PASSWORD ~* -@all +@connection +get"
        .split(' ')
        .map(str::to_owned)
        .collect();
    add_user(&redis, &rule, "pw");
    let url = format!("redis://reader:pw@127.0.0.1:{}", redis.port());
    // Connecting needs only the connection commands.
    let client = connect(&url, &ConnectOptions::default()).await.unwrap();
    let err = client
        .zadd::<i64, _, _>(
            "llm-d-async:requests:pool-a",
            None,
            None,
            false,
            false,
            (1.0, "m"),
        )
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("NOPERM"), "{text}");
    assert!(text.to_ascii_lowercase().contains("zadd"), "{text}");
}

#[tokio::test]
async fn a_wrong_password_fails_at_once_without_showing_it() {
    let redis = RedisServer::start();
    add_user(&redis, &documented_rule(), "right-pw");
    let url = format!("redis://batch:wrong-pw@127.0.0.1:{}", redis.port());
    let options = ConnectOptions {
        attempts: 5,
        initial_backoff: Duration::from_secs(1),
        ..ConnectOptions::default()
    };
    let started = Instant::now();
    let err = connect(&url, &options).await.unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, ConnectError::Auth { .. }), "{text}");
    assert!(text.contains("WRONGPASS"), "{text}");
    assert!(
        !text.contains("wrong-pw") && !text.contains("right-pw"),
        "{text}"
    );
    // Not retried: five attempts with 1 s+ backoff would take over 10 s.
    assert!(started.elapsed() < Duration::from_secs(8), "{text}");

    // A password-only URL (requirepass-style default user) works too.
    redis.command(&["CONFIG", "SET", "requirepass", "only-pw"]);
    let url = format!("redis://:only-pw@127.0.0.1:{}", redis.port());
    let client = connect(&url, &ConnectOptions::default()).await.unwrap();
    let pong: String = client.ping(None).await.unwrap();
    assert_eq!(pong, "PONG");
}
