//! What the service tests share beyond the service itself: two tenants' keys, a gated
//! dispatcher that holds a job mid-way, batches submitted and counted, and the inventory a
//! restart must keep.

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use dispatcher_sim::{DispatcherHandle, GatewayConfig, DEFAULT_BUDGET_KEY};
use serde_json::{json, Value};

use super::api::{add_serve_section, async_service, input_jsonl, Api, Resp};
use super::{closed_gate, Env};

/// Two tenants' keys, and the `(key, tenant)` pairs of the keys file.
pub const KEY_A: &str = "sk-test-alpha-0001";

pub const KEY_B: &str = "sk-test-beta-0002";

pub const TWO_TENANTS: &[(&str, &str)] = &[(KEY_A, "alpha"), (KEY_B, "beta")];

pub const ONE_TENANT: &[(&str, &str)] = &[(KEY_A, "alpha")];

/// How long a small batch may take to finish on a loaded 2-core machine.
pub const FINISH: Duration = Duration::from_secs(120);

/// A dispatcher on `pool-a` behind a `redis` gate, closed until [`gate`] opens it, taking one
/// request per 20 ms poll: a job of a few hundred lines stays mid-way for seconds.
pub async fn gated_dispatcher(env: &Env) -> DispatcherHandle {
    env.dispatcher(&["pool-a"], |c| {
        closed_gate(c);
        c.batch_size = 1;
    })
    .await
}

/// Opens (`true`) or closes the gate of [`gated_dispatcher`].
pub fn gate(env: &Env, open: bool) {
    env.redis
        .command(&["SET", DEFAULT_BUDGET_KEY, if open { "1" } else { "0" }]);
}

/// A gateway answering each request after 200 ms, so that some are always in flight.
pub fn slow_gateway() -> GatewayConfig {
    super::fixed_latency(Duration::from_millis(200))
}

/// A sync-mode service config of the two tenants for `llama-3` at the env's gateway, with
/// `concurrency` requests at once (no adaptive limit) and `serve_extra` lines of `serve:`.
pub fn sync_service(env: &Env, concurrency: usize, serve_extra: &str) -> std::path::PathBuf {
    let config = env.sync_config(
        &["llama-3"],
        "",
        &format!(
            "redis_url_file: {}\nconcurrency:\n  global: {concurrency}\n  per_endpoint: {concurrency}\n  aimd:\n    enabled: false\n",
            env.redis_url_file.display()
        ),
    );
    let storage = env.path("storage");
    std::fs::create_dir_all(&storage).unwrap();
    add_serve_section(&config, &storage, TWO_TENANTS, serve_extra, "");
    config
}

/// Opens the gate of [`gated_dispatcher`] until at least `n` lines of batch `id` are done, then
/// closes it again.
pub async fn let_through(env: &Env, api: &Api, id: &str, n: u64) {
    gate(env, true);
    api.wait_batch(id, FINISH, &format!("{n} lines done"), |b| {
        count(b, "completed") >= n
    })
    .await;
    gate(env, false);
}

/// Uploads `n` lines of `llama-3` as `<name>.jsonl` and creates a 24 h batch of them: the file
/// id, the batch id and the lines' custom ids.
pub async fn submit(api: &Api, name: &str, n: usize) -> (String, String, Vec<String>) {
    submit_within(api, name, n, "24h").await
}

/// [`submit`] with the completion window `window`.
pub async fn submit_within(
    api: &Api,
    name: &str,
    n: usize,
    window: &str,
) -> (String, String, Vec<String>) {
    let (text, lines) = input_jsonl(name, n, "llama-3");
    let file = api
        .upload_ok(&format!("{name}.jsonl"), text.as_bytes())
        .await;
    let id = id_of(&api.create_batch(&file, window).await.expect(200));
    (file, id, lines)
}

/// How many lines of `batch` its `request_counts` say are `field`.
pub fn count(batch: &Value, field: &str) -> u64 {
    batch["request_counts"][field]
        .as_u64()
        .unwrap_or_else(|| panic!("request_counts.{field}: {batch}"))
}

/// How many lines of `batch` its `x_request_counts` say are `field`.
pub fn x_count(batch: &Value, field: &str) -> u64 {
    batch["x_request_counts"][field]
        .as_u64()
        .unwrap_or_else(|| panic!("x_request_counts.{field}: {batch}"))
}

/// The `id` of an object of the API.
pub fn id_of(v: &Value) -> String {
    v["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no id: {v}"))
        .to_owned()
}

/// Panics unless the answer has an `x-request-id`.
#[track_caller]
pub fn has_request_id(resp: &Resp) {
    let id = resp
        .headers
        .get("x-request-id")
        .unwrap_or_else(|| panic!("no x-request-id on {} {}", resp.status, resp.text()));
    assert!(!id.is_empty());
}

/// What a restart must keep of a file: everything but the deprecated `status`.
pub fn file_identity(f: &Value) -> Value {
    json!([
        f["id"],
        f["bytes"],
        f["filename"],
        f["purpose"],
        f["created_at"],
        f["expires_at"]
    ])
}

/// What a restart must keep of a batch.
pub fn batch_identity(b: &Value) -> Value {
    json!([
        b["id"],
        b["input_file_id"],
        b["endpoint"],
        b["created_at"],
        b["metadata"]
    ])
}

/// Panics unless `after` lists every file and batch of `before`, unchanged, and no other batch;
/// files added since are a batch's results.
#[track_caller]
pub fn assert_kept(before: &(Vec<Value>, Vec<Value>), after: &(Vec<Value>, Vec<Value>)) {
    assert_eq!(after.1, before.1, "the batches listed changed");
    for file in &before.0 {
        assert!(
            after.0.contains(file),
            "{file} is no longer listed as before: {:?}",
            after.0
        );
    }
    for file in after.0.iter().filter(|f| !before.0.contains(f)) {
        assert_eq!(file[3], "batch_output", "a file appeared: {file}");
    }
}

/// The files and batches a tenant sees, for comparing across a restart.
pub async fn inventory(api: &Api) -> (Vec<Value>, Vec<Value>) {
    let files = api.list_all("/v1/files", "order=asc", 100).await;
    let batches = api.list_all("/v1/batches", "", 100).await;
    (
        files.iter().map(file_identity).collect(),
        batches.iter().map(batch_identity).collect(),
    )
}

/// A service under test, however it runs (in the test's process or as `processor serve`):
/// started on a config, listening on a loopback port, and a client of it.
pub trait ServiceUnderTest: Sized {
    /// Starts the service of the config at `config` on a free loopback port.
    fn start_on(config: &Path) -> impl Future<Output = Self>;

    /// A client sending `key` as its bearer token (none when `None`).
    fn client_of(&self, key: Option<&str>) -> Api;
}

/// The start most service tests share: an [`Env`] on `gateway`, the async service of `tenants`
/// (`serve_extra` added to its `serve:` section) running, and the first tenant's client.
pub async fn start_tenants<S: ServiceUnderTest>(
    tenants: &[(&str, &str)],
    gateway: GatewayConfig,
    serve_extra: &str,
) -> (Env, S, Api) {
    let env = Env::start(gateway).await;
    let config = async_service(&env, tenants, serve_extra, "");
    let service = S::start_on(&config).await;
    let first = service.client_of(Some(tenants[0].0));
    (env, service, first)
}

/// Defines `two_tenants` and `one_tenant` for the tests' service type `$service` (a
/// [`ServiceUnderTest`]): the env, the service and tenant A's client. Keep the first two for
/// the whole test (as `_env`, `_service` when unused: `_` would drop them at once).
#[macro_export]
macro_rules! tenant_starts {
    ($service:ty) => {
        /// An env on `gateway`, the two tenants' async service (`serve_extra` added to its
        /// `serve:` section) running, and tenant A's client.
        pub async fn two_tenants(
            gateway: $crate::e2e::GatewayConfig,
            serve_extra: &str,
        ) -> ($crate::e2e::Env, $service, $crate::e2e::api::Api) {
            $crate::e2e::tenants::start_tenants(
                $crate::e2e::tenants::TWO_TENANTS,
                gateway,
                serve_extra,
            )
            .await
        }

        /// `two_tenants` with tenant A alone, on the default gateway.
        pub async fn one_tenant(
            serve_extra: &str,
        ) -> ($crate::e2e::Env, $service, $crate::e2e::api::Api) {
            $crate::e2e::tenants::start_tenants(
                $crate::e2e::tenants::ONE_TENANT,
                $crate::e2e::GatewayConfig::default(),
                serve_extra,
            )
            .await
        }
    };
}
