//! Shared by the integration tests: the documented ACL rule.

use batch_testkit::RedisServer;

/// The `ACL SETUSER batch ...` line of the README, so the documented rule is the tested one.
pub fn documented_rule() -> Vec<String> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("reading README.md");
    let line = readme
        .lines()
        .find(|l| l.starts_with("ACL SETUSER batch "))
        .expect("README.md documents the processor's ACL rule (a line `ACL SETUSER batch ...`)");
    line.split_whitespace().map(str::to_owned).collect()
}

/// Runs an `ACL SETUSER` rule on `redis`, `>PASSWORD` replaced by `password`.
pub fn add_user(redis: &RedisServer, rule: &[String], password: &str) {
    let args: Vec<String> = rule
        .iter()
        .map(|a| a.replace(">PASSWORD", &format!(">{password}")))
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_eq!(redis.command(&args), "+OK", "{args:?}");
}
