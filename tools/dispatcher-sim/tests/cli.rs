//! The binary, spawned as users run it, against a real redis-server.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use batch_testkit::{tempdir, RedisServer};
use batch_wire::hash::body_digest;
use batch_wire::ResultMessage;

const BIN: &str = env!("CARGO_BIN_EXE_async-dispatcher-sim");

/// A child process, killed when dropped (also when the test fails).
struct Sim {
    child: Child,
    stdout: Receiver<String>,
    stderr: Arc<Mutex<String>>,
    /// Reads stderr to its end; joined once the process exited, so nothing it wrote is missed.
    stderr_reader: Option<std::thread::JoinHandle<()>>,
}

impl Sim {
    fn spawn(args: &[&str]) -> Sim {
        let mut command = Command::new(BIN);
        command.args(args).env_remove("REDIS_URL");
        Sim::spawn_command(command)
    }

    fn spawn_command(mut command: Command) -> Sim {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning async-dispatcher-sim");
        let (tx, stdout) = channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = stderr.clone();
        let mut err = child.stderr.take().unwrap();
        let stderr_reader = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Sim {
            child,
            stdout,
            stderr,
            stderr_reader: Some(stderr_reader),
        }
    }

    /// The `key=value` pairs of the startup line.
    fn listening(&self) -> Vec<(String, String)> {
        let line = self
            .stdout
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("no startup line; stderr:\n{}", self.stderr()));
        let rest = line
            .strip_prefix("listening ")
            .unwrap_or_else(|| panic!("{line}"));
        rest.split(' ')
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                (k.to_owned(), v.to_owned())
            })
            .collect()
    }

    fn url(&self, pairs: &[(String, String)], key: &str) -> String {
        pairs.iter().find(|(k, _)| k == key).unwrap().1.clone()
    }

    fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let until = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                if let Some(reader) = self.stderr_reader.take() {
                    let _ = reader.join();
                }
                return status;
            }
            assert!(
                Instant::now() < until,
                "still running; stderr:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// SIGTERM, as an orchestrator stops it.
    fn terminate(&self) {
        let pid = libc::pid_t::try_from(self.child.id()).unwrap();
        // SAFETY: kill(2) with a pid this test spawned and has not reaped yet.
        let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
        assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn envelope(id: &str, deadline: i64, payload: &str, results: &str) -> String {
    format!(
        r#"{{"internal":{{"request_token":"t-{id}","result_queue_name":"{results}"}},"request_kind":"plain","data":{{"id":"{id}","created":{},"deadline":{deadline},"payload":{payload},"metadata":{{"job_id":"j"}}}}}}"#,
        now()
    )
}

fn enqueue(redis: &RedisServer, queue: &str, member: &str, deadline: i64) {
    assert_eq!(
        redis.command(&["ZADD", queue, &deadline.to_string(), member]),
        ":1"
    );
}

/// Ten requests m0..m9 in queue `q`, deadlines ten minutes on and a second apart, results to
/// `crash-results`: their members.
fn enqueue_ten(redis: &RedisServer) -> Vec<String> {
    let deadline = now() + 600;
    (0..10)
        .map(|i| {
            let member = envelope(
                &format!("m{i}"),
                deadline + i,
                r#"{"model":"m"}"#,
                "crash-results",
            );
            enqueue(redis, "q", &member, deadline + i);
            member
        })
        .collect()
}

/// Pops `n` results, oldest first.
fn pop_results(redis: &RedisServer, list: &str, n: usize) -> Vec<ResultMessage> {
    pop_texts(redis, list, n)
        .iter()
        .map(|raw| ResultMessage::parse(raw).unwrap())
        .collect()
}

/// Pops `n` raw results, oldest first, as JSON values (to see every field written).
fn pop_raw(redis: &RedisServer, list: &str, n: usize) -> Vec<serde_json::Value> {
    pop_texts(redis, list, n)
        .iter()
        .map(|raw| serde_json::from_str(raw).unwrap())
        .collect()
}

/// Pops `n` messages off `list`, oldest first, waiting up to 20 s for them.
fn pop_texts(redis: &RedisServer, list: &str, n: usize) -> Vec<String> {
    let until = Instant::now() + Duration::from_secs(20);
    let mut out = Vec::new();
    while out.len() < n {
        let raw = redis.command(&["RPOP", list]);
        if raw.starts_with('{') {
            out.push(raw);
        } else {
            assert!(
                Instant::now() < until,
                "{} of {n} results on {list}",
                out.len()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    out
}

/// A plain HTTP/1.0 GET: the body.
fn http_get(url: &str) -> String {
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let mut stream = TcpStream::connect(host).unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

/// Starts with a queues-config file of the real dispatcher's shape, serves one queue through
/// the embedded gateway and one through a separately run `gateway`, and stops cleanly on SIGTERM.
#[test]
fn processes_messages_end_to_end_from_a_queues_config_file() {
    let redis = RedisServer::start();
    let dir = tempdir().unwrap();
    let gateway = Sim::spawn(&["gateway", "--listen", "127.0.0.1:0", "--latency", "5ms"]);
    let gw = gateway.listening();
    let gateway_url = gateway.url(&gw, "gateway");

    let config = dir.path().join("queues.json");
    std::fs::write(
        &config,
        format!(
            r#"[
  {{"queue_name": "llm-d-async:requests:pool-a", "request_path_url": "/v1/chat/completions",
    "gate_type": "constant", "gate_params": {{"budget": "1"}}}},
  {{"queue_name": "llm-d-async:requests:pool-b", "igw_base_url": "{gateway_url}",
    "request_path_url": "/v1/completions", "gate_type": "prometheus-budget",
    "gate_params": {{"pool": "pool-b", "max_concurrency": "100", "baseline": "0.05"}},
    "inference_objective": "batch"}}
]"#
        ),
    )
    .unwrap();
    let url = redis.url();
    let mut sim = Sim::spawn(&[
        "--message-queue-impl=redis-sortedset",
        "--redis.url",
        &url,
        "--redis.ss.queues-config-file",
        config.to_str().unwrap(),
        "--redis.ss.result-queue-name",
        "llm-d-async:results:default",
        "--redis.ss.poll-interval-ms",
        "50",
        "--embedded-gateway",
        // Needed by the prometheus-budget gate, as by the real dispatcher's.
        "--prometheus-url",
        "http://127.0.0.1:9",
    ]);
    let pairs = sim.listening();
    assert!(sim.url(&pairs, "gateway").starts_with("http://127.0.0.1:"));
    let metrics = sim.url(&pairs, "metrics");

    let deadline = now() + 600;
    // Written as Go's encoder writes them (keys sorted, compact): the dispatcher re-encodes
    // payloads before sending, and these come out byte for byte.
    let chat = r#"{"messages":[{"content":"hi","role":"user"}],"model":"m"}"#;
    let completion = r#"{"model":"m","prompt":"hello"}"#;
    enqueue(
        &redis,
        "llm-d-async:requests:pool-a",
        &envelope("a1", deadline, chat, "results-a"),
        deadline,
    );
    enqueue(
        &redis,
        "llm-d-async:requests:pool-b",
        &envelope("b1", deadline, completion, "results-b"),
        deadline,
    );
    let a = pop_results(&redis, "results-a", 1);
    let b = pop_results(&redis, "results-b", 1);
    assert_eq!((a[0].id.as_str(), a[0].status_code), ("a1", Some(200)));
    assert!(a[0]
        .payload
        .contains(&format!("chatcmpl-{}", body_digest(chat.as_bytes()))));
    assert_eq!((b[0].id.as_str(), b[0].status_code), ("b1", Some(200)));
    assert!(b[0]
        .payload
        .contains(&format!("cmpl-{}", body_digest(completion.as_bytes()))));

    let seen = http_get(&format!("{gateway_url}/admin/requests"));
    assert!(
        seen.contains(r#""x-gateway-inference-objective":"batch""#),
        "{seen}"
    );
    let page = http_get(&format!("{metrics}/metrics"));
    assert!(
        page.lines().any(|l| l == "dispatcher_taken_total 2"),
        "{page}"
    );

    sim.terminate();
    let status = sim.wait(Duration::from_secs(15));
    assert!(status.success(), "{status:?}; stderr:\n{}", sim.stderr());
}

/// `--sim.crash-after N` exits non-zero after taking exactly N, and (v0.9) those N never get
/// results.
#[test]
fn crash_after_exits_non_zero_and_loses_the_messages_in_hand() {
    let redis = RedisServer::start();
    let gateway = Sim::spawn(&["gateway", "--listen", "127.0.0.1:0", "--latency", "3s"]);
    let gw = gateway.listening();
    let gateway_url = gateway.url(&gw, "gateway");
    let members = enqueue_ten(&redis);
    let queues = format!(r#"[{{"queue_name":"q","igw_base_url":"{gateway_url}"}}]"#);
    let url = redis.url();
    let mut sim = Sim::spawn(&[
        "--redis.url",
        &url,
        "--redis.ss.queues-config",
        &queues,
        "--redis.ss.poll-interval-ms",
        "50",
        "--sim.crash-after",
        "3",
        "--dispatcher-version",
        "0.9",
    ]);
    let status = sim.wait(Duration::from_secs(20));
    assert!(!status.success(), "{status:?}");
    assert_eq!(status.code(), Some(137));
    assert!(sim.stderr().contains("crash-after"), "{}", sim.stderr());
    assert_eq!(redis.command(&["ZCARD", "q"]), ":7", "exactly 3 taken");
    // The lowest deadlines went first: m0..m2 are gone, the rest are still queued.
    for (i, member) in members.iter().enumerate() {
        let score = redis.command(&["ZSCORE", "q", member]);
        assert_eq!(score == "(nil)", i < 3, "m{i}: {score}");
    }
    assert_eq!(redis.command(&["LLEN", "crash-results"]), ":0");
    assert_eq!(redis.command(&["ZCARD", "retry-sortedset"]), ":0");
}

/// A gate type the real dispatcher knows but the simulator does not model is a startup error.
#[test]
fn a_gate_type_the_simulator_does_not_model_exits_non_zero_naming_it() {
    // Unknown names open the gate as in the real dispatcher; real types not simulated refuse.
    let mut sim = Sim::spawn(&[
        "--redis.url",
        "redis://127.0.0.1:9",
        "--redis.ss.queues-config",
        r#"[{"queue_name":"q","gate_type":"redis-quota"}]"#,
        "--embedded-gateway",
    ]);
    let status = sim.wait(Duration::from_secs(20));
    assert!(!status.success());
    assert!(sim.stderr().contains("redis-quota"), "{}", sim.stderr());
}

/// Only loopback listen addresses by default, and only the sorted-set transport.
#[test]
fn refuses_non_loopback_listeners_and_other_transports() {
    let mut gw = Sim::spawn(&["gateway", "--listen", "0.0.0.0:0"]);
    assert!(!gw.wait(Duration::from_secs(20)).success());
    assert!(
        gw.stderr().contains("--allow-non-loopback"),
        "{}",
        gw.stderr()
    );

    let mut sim = Sim::spawn(&[
        "--message-queue-impl",
        "redis-pubsub",
        "--redis.url",
        "redis://127.0.0.1:9",
        "--redis.ss.queues-config",
        r#"[{"queue_name":"q"}]"#,
    ]);
    assert!(!sim.wait(Duration::from_secs(20)).success());
    assert!(sim.stderr().contains("redis-pubsub"), "{}", sim.stderr());
}

/// `--dispatcher-version 0.9` drops an expired message silently and writes no `request_token`;
/// `0.10` (the default) answers it with `DEADLINE_EXCEEDED` and puts `request_token` in results.
#[test]
fn dispatcher_version_switches_expired_handling_and_tokens() {
    let redis = RedisServer::start();
    let url = redis.url();
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let mut sims = Vec::new();
    for (version, queue) in [(Some("0.9"), "q9"), (None, "q10")] {
        enqueue(
            &redis,
            queue,
            &envelope(
                &format!("old-{queue}"),
                now() - 5,
                chat,
                &format!("res-{queue}"),
            ),
            now() - 5,
        );
        let deadline = now() + 600;
        enqueue(
            &redis,
            queue,
            &envelope(
                &format!("new-{queue}"),
                deadline,
                chat,
                &format!("res-{queue}"),
            ),
            deadline,
        );
        let queues = format!(r#"[{{"queue_name":"{queue}"}}]"#);
        let mut args = vec![
            "--redis.url",
            &url,
            "--redis.ss.queues-config",
            &queues,
            "--redis.ss.poll-interval-ms",
            "50",
            "--embedded-gateway",
        ];
        if let Some(v) = version {
            args.extend(["--dispatcher-version", v]);
        }
        let sim = Sim::spawn(&args);
        sim.listening();
        sims.push(sim);
    }
    let v09 = pop_raw(&redis, "res-q9", 1);
    assert_eq!(v09[0]["id"], "new-q9");
    assert_eq!(v09[0]["status_code"], 200);
    assert!(v09[0].get("request_token").is_none(), "{}", v09[0]);

    let mut v10 = pop_raw(&redis, "res-q10", 2);
    v10.sort_by_key(|r| r["id"].as_str().unwrap().to_owned());
    assert_eq!(v10[0]["id"], "new-q10");
    assert_eq!(v10[0]["status_code"], 200);
    assert_eq!(v10[0]["request_token"], "t-new-q10");
    assert_eq!(v10[1]["id"], "old-q10");
    assert_eq!(v10[1]["error_code"], "DEADLINE_EXCEEDED");
    assert_eq!(v10[1]["request_token"], "t-old-q10");

    // Given time to have written one, v0.9 wrote nothing for the expired message.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(redis.command(&["LLEN", "res-q9"]), ":0");
    assert_eq!(redis.command(&["ZCARD", "q9"]), ":0", "it was taken");
    let bad = Sim::spawn(&["--dispatcher-version", "0.8"]).wait(Duration::from_secs(20));
    assert!(!bad.success());
}

/// v0.10's `--transport redis-sortedset --transport-config-file FILE`: the URL, the queues, the
/// default result list and the poll interval all come from the one JSON object.
#[test]
fn transport_config_file_configures_everything() {
    let redis = RedisServer::start();
    let dir = tempdir().unwrap();
    let file = dir.path().join("transport.json");
    std::fs::write(
        &file,
        format!(
            r#"{{"url": "{}", "retry_queue_name": "tc-retries", "result_queue_name": "tc-results",
  "poll_interval_ms": 50, "batch_size": 5, "enable_tracing": false,
  "queues": [{{"queue_name": "tq", "request_path_url": "/v1/chat/completions"}}]}}"#,
            redis.url()
        ),
    )
    .unwrap();
    let mut sim = Sim::spawn(&[
        "--transport",
        "redis-sortedset",
        "--transport-config-file",
        file.to_str().unwrap(),
        "--embedded-gateway",
    ]);
    sim.listening();
    let deadline = now() + 600;
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"tc"}]}"#;
    // No internal.result_queue_name: the transport config's default list gets it.
    let member = format!(
        r#"{{"internal":{{"request_token":"tok"}},"request_kind":"plain","data":{{"id":"tc1","created":1,"deadline":{deadline},"payload":{chat}}}}}"#
    );
    enqueue(&redis, "tq", &member, deadline);
    let got = pop_raw(&redis, "tc-results", 1);
    assert_eq!(got[0]["id"], "tc1");
    assert_eq!(got[0]["status_code"], 200);
    assert_eq!(got[0]["request_token"], "tok");
    sim.terminate();
    assert!(sim.wait(Duration::from_secs(15)).success());

    let mut bad = Sim::spawn(&["--transport-config", r#"[{"queue_name":"q"}]"#]);
    assert!(!bad.wait(Duration::from_secs(20)).success());
    assert!(
        bad.stderr().contains("transport config"),
        "{}",
        bad.stderr()
    );
}

/// v0.10: "a dispatcher killed with requests in hand no longer loses them". The first
/// simulator crashes with three claimed; once their lease runs out a second one reclaims and
/// answers them, so all ten get a result.
#[test]
fn crash_after_loses_nothing_in_v0_10() {
    let redis = RedisServer::start();
    let url = redis.url();
    enqueue_ten(&redis);
    let queues = r#"[{"queue_name":"q"}]"#;
    let common = [
        "--redis.url",
        &url,
        "--redis.ss.queues-config",
        queues,
        "--redis.ss.poll-interval-ms",
        "50",
        "--embedded-gateway",
        "--sim.claim-lease",
        "1s",
        "--sim.reclaim-interval",
        "100ms",
    ];
    let mut first = Sim::spawn(
        &[
            &common[..],
            &["--gateway.latency", "5s", "--sim.crash-after", "3"],
        ]
        .concat(),
    );
    let status = first.wait(Duration::from_secs(20));
    assert_eq!(status.code(), Some(137), "{}", first.stderr());
    assert_eq!(redis.command(&["ZCARD", "q"]), ":7");
    assert_eq!(
        redis.command(&["HLEN", "{q}:claimed"]),
        ":3",
        "in hand, claimed"
    );
    assert_eq!(redis.command(&["LLEN", "crash-results"]), ":0");

    let second = Sim::spawn(&common);
    second.listening();
    let mut ids: Vec<String> = pop_results(&redis, "crash-results", 10)
        .into_iter()
        .map(|r| r.id)
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 10, "{ids:?}");
    // Each claim is released right after its result is pushed.
    let until = Instant::now() + Duration::from_secs(10);
    while redis.command(&["HLEN", "{q}:claimed"]) != ":0" {
        assert!(Instant::now() < until, "claims left after every result");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(redis.command(&["ZCARD", "q"]), ":0");
}

/// What `processor queues` prints for an async config in `dir` of one model `m` on pool-a at
/// `gateway_url`, Redis at `redis_url`, with `extra` more top-level YAML.
fn printed_queues(
    dir: &std::path::Path,
    redis_url: &str,
    gateway_url: &str,
    extra: &str,
) -> batch_config::DispatcherQueues {
    let url_file = dir.join("redis-url");
    std::fs::write(&url_file, redis_url).unwrap();
    let yaml = dir.join("async.yaml");
    std::fs::write(
        &yaml,
        format!(
            "dispatch_mode: async\nredis_url_file: {}\nmodel_gateways:\n  m:\n    url: {gateway_url}\n    inference_pool_name: pool-a\n{extra}",
            url_file.display()
        ),
    )
    .unwrap();
    let config = batch_config::ProcessorConfig::load(&yaml).unwrap();
    config.dispatcher_queues().unwrap()
}

/// The dispatcher configuration and command lines `processor queues` prints (both releases'
/// forms) start the simulator exactly as printed, which then carries a request; without the
/// `--prometheus-url` they print, it refuses to start, as the real dispatcher does.
#[test]
fn the_configuration_processor_queues_prints_starts_the_simulator() {
    let redis = RedisServer::start();
    let dir = tempdir().unwrap();
    let gateway = Sim::spawn(&["gateway", "--listen", "127.0.0.1:0"]);
    let gateway_url = gateway.url(&gateway.listening(), "gateway");
    let queues = printed_queues(dir.path(), &redis.url(), &gateway_url, "");
    assert!(
        queues.needs_prometheus(),
        "the default gate reads Prometheus"
    );
    std::fs::write(dir.path().join("queues.json"), queues.queues_config_json()).unwrap();
    let mut transport: serde_json::Value =
        serde_json::from_str(&queues.transport_config().to_json()).unwrap();
    transport["url"] = redis.url().into();
    std::fs::write(dir.path().join("transport.json"), transport.to_string()).unwrap();

    let deadline = now() + 600;
    let chat = r#"{"messages":[{"content":"hi","role":"user"}],"model":"m"}"#;
    let commands = [
        queues.command_v0_9("queues.json"),
        queues.command_v0_10("transport.json"),
    ];
    for (n, printed) in commands.iter().enumerate() {
        let line = printed
            .strip_prefix("llm-d-async ")
            .unwrap_or_else(|| panic!("{printed}"));
        let shell = |line: &str| {
            let mut command = Command::new("sh");
            command
                .arg("-c")
                .arg(format!("exec {BIN} {line}"))
                .current_dir(dir.path())
                .env("REDIS_URL", redis.url())
                .env("PROMETHEUS_URL", "http://127.0.0.1:9");
            command
        };
        let without = line.replace(r#" --prometheus-url "$PROMETHEUS_URL""#, "");
        assert_ne!(without, line, "{printed}");
        let refused = shell(&without).output().unwrap();
        assert!(!refused.status.success(), "{printed}");
        let said = String::from_utf8_lossy(&refused.stderr);
        assert!(said.contains("--prometheus-url is required"), "{said}");

        let mut sim = Sim::spawn_command(shell(line));
        sim.listening();
        let id = format!("r{n}");
        enqueue(
            &redis,
            "llm-d-async:requests:pool-a",
            &envelope(&id, deadline, chat, "results-here"),
            deadline,
        );
        let got = pop_results(&redis, "results-here", 1);
        assert_eq!(
            (got[0].id.as_str(), got[0].status_code),
            (id.as_str(), Some(200)),
            "{printed}"
        );
        sim.terminate();
        let status = sim.wait(Duration::from_secs(15));
        assert!(status.success(), "{status:?}; stderr:\n{}", sim.stderr());
    }
}

/// With the pods' metrics pages in the config, `processor queues` prints gates that read them
/// itself (`endpoint-scrape` on running and on waiting requests, in a `composite`) and no
/// `--prometheus-url`: the simulator starts from exactly that
/// (a gateway in vLLM mode standing in for the model server) and carries a request.
#[test]
fn the_endpoint_scrape_configuration_processor_queues_prints_starts_the_simulator() {
    let redis = RedisServer::start();
    let dir = tempdir().unwrap();
    let gateway = Sim::spawn(&["gateway", "--listen", "127.0.0.1:0", "--max-num-seqs", "4"]);
    let gateway_url = gateway.url(&gateway.listening(), "gateway");
    let dispatcher = format!(
        "async_dispatch:\n  dispatcher:\n    max_num_seqs: 4\n    metrics_urls:\n      pool-a: [{gateway_url}/metrics]\n"
    );
    let queues = printed_queues(dir.path(), &redis.url(), &gateway_url, &dispatcher);
    assert_eq!(queues.queues_config[0].gate_type, "composite");
    std::fs::write(dir.path().join("queues.json"), queues.queues_config_json()).unwrap();
    let printed = queues.command_v0_9("queues.json");
    assert!(!printed.contains("--prometheus-url"), "{printed}");
    let line = printed.strip_prefix("llm-d-async ").unwrap();
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(format!("exec {BIN} {line}"))
        .current_dir(dir.path())
        .env("REDIS_URL", redis.url());
    let mut sim = Sim::spawn_command(command);
    sim.listening();
    let deadline = now() + 600;
    let chat = r#"{"messages":[{"content":"hi","role":"user"}],"model":"m"}"#;
    enqueue(
        &redis,
        "llm-d-async:requests:pool-a",
        &envelope("scraped", deadline, chat, "results-here"),
        deadline,
    );
    let got = pop_results(&redis, "results-here", 1);
    assert_eq!(
        (got[0].id.as_str(), got[0].status_code),
        ("scraped", Some(200)),
        "{printed}"
    );
    sim.terminate();
    let status = sim.wait(Duration::from_secs(15));
    assert!(status.success(), "{status:?}; stderr:\n{}", sim.stderr());
}
