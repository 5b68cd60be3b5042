//! Tenants' webhook endpoints and the queue of their deliveries, in Redis.
//!
//! A batch reaching a final status is pushed on `{prefix}:webhook_ended` by the same script that
//! saves the status, so no end is lost to a replica dying right after it. Any replica then fans
//! it out into one delivery per endpoint of the tenant that wants the event, each in
//! `{prefix}:webhook_due` (a sorted set by due time in ms). A sender claims a due delivery by
//! moving its due time past its own attempt (a lease): one sender at a time per delivery, and
//! another replica's turn when that one dies. The signing secret sits under a key of its own,
//! never in the record that listings read.

use std::sync::LazyLock;
use std::time::Duration;

use fred::interfaces::{KeysInterface, SortedSetsInterface};
use fred::types::scripts::Script;
use serde::{Deserialize, Serialize};

use crate::{parse, Store, StoreError};

/// The batch events a webhook endpoint may subscribe to.
pub const BATCH_EVENTS: &[&str] = &[
    "batch.completed",
    "batch.failed",
    "batch.cancelled",
    "batch.expired",
];

/// A webhook endpoint as the API shows it (without its secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebhookEndpoint {
    /// `we_…`.
    pub id: String,
    /// Always `webhook_endpoint`.
    pub object: String,
    /// Unix seconds.
    pub created_at: i64,
    /// Unix seconds of the last change (url, name, events, status, secret).
    #[serde(default)]
    pub updated_at: Option<i64>,
    /// The tenant's name for it.
    pub name: Option<String>,
    /// Where events are sent.
    pub url: String,
    /// The events sent to it.
    pub event_types: Vec<String>,
    /// `enabled` or `disabled`.
    pub status: String,
    /// The secret's first and last characters, the rest masked.
    pub signing_secret_hint: String,
}

/// A webhook endpoint and its tenant, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredWebhook {
    /// The owning tenant.
    pub tenant: String,
    /// The object the API shows.
    pub endpoint: WebhookEndpoint,
}

/// One event to deliver to one endpoint, until a 2xx answer or the give-up time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivery {
    /// `evt_…`: the `webhook-id` of every attempt, the same for the same batch end.
    pub event_id: String,
    /// The endpoint's id.
    pub endpoint: String,
    /// `batch.completed`, …
    #[serde(rename = "type")]
    pub kind: String,
    /// The batch the event is about.
    pub batch: String,
    /// Unix seconds of the event.
    pub created_at: i64,
    /// Attempts made so far.
    pub attempt: u32,
}

/// KEYS: the ended list, the due set. ARGV: key prefix, now in ms.
/// Turns the oldest ended batch into one delivery per endpoint of its tenant subscribed to the
/// event; the ids are derived from the batch and the endpoint, so doing it twice (a replica dying
/// in between) queues nothing twice. Returns 0 when no batch waits.
const FAN_OUT_LUA: &str = r#"
local id = redis.call('LINDEX', KEYS[1], 0)
if not id then return 0 end
local raw = redis.call('GET', ARGV[1] .. ':batch:' .. id)
if raw then
  local b = cjson.decode(raw)
  local kind = 'batch.' .. b['batch']['status']
  local created = tonumber(ARGV[2]) / 1000
  local event = 'evt_' .. string.sub(redis.sha1hex(id .. '/' .. kind), 1, 32)
  for _, ep in ipairs(redis.call('ZRANGE', ARGV[1] .. ':webhooks:' .. b['tenant'], 0, -1)) do
    local er = redis.call('GET', ARGV[1] .. ':webhook:' .. ep)
    if er then
      local e = cjson.decode(er)['endpoint']
      local wants = false
      for _, t in ipairs(e['event_types']) do
        if t == kind then wants = true end
      end
      if wants and e['status'] == 'enabled' then
        local did = event .. ':' .. ep
        local d = cjson.encode({event_id = event, endpoint = ep, type = kind, batch = id,
          created_at = math.floor(created), attempt = 0})
        if redis.call('SET', ARGV[1] .. ':webhook_delivery:' .. did, d, 'NX') then
          redis.call('ZADD', KEYS[2], ARGV[2], did)
        end
      end
    end
  end
end
redis.call('LPOP', KEYS[1])
return 1
"#;

/// KEYS: the due set. ARGV: now in ms, lease in ms, key prefix.
/// Claims the most overdue delivery by moving it to now + lease; `{id, record}` or nil.
const CLAIM_DELIVERY_LUA: &str = r#"
local d = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 1)
if #d == 0 then return nil end
redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[2]), d[1])
return {d[1], redis.call('GET', ARGV[3] .. ':webhook_delivery:' .. d[1]) or ''}
"#;

static FAN_OUT: LazyLock<Script> = LazyLock::new(|| Script::from_lua(FAN_OUT_LUA));
static CLAIM_DELIVERY: LazyLock<Script> = LazyLock::new(|| Script::from_lua(CLAIM_DELIVERY_LUA));

impl Store {
    /// The list a batch reaching a final status is pushed on.
    pub(crate) fn webhook_ended_key(&self) -> String {
        self.key(&["webhook_ended"])
    }

    /// Stores an endpoint and lists it under its tenant; `secret`, when given, replaces its
    /// signing secret.
    pub async fn put_webhook(
        &self,
        webhook: &StoredWebhook,
        secret: Option<&str>,
    ) -> Result<(), StoreError> {
        let id = &webhook.endpoint.id;
        let json = serde_json::to_string(webhook).expect("a webhook record serializes");
        if let Some(secret) = secret {
            let _: () = self
                .client
                .set(self.key(&["webhook_secret", id]), secret, None, None, false)
                .await?;
        }
        let _: () = self
            .client
            .set(self.key(&["webhook", id]), json, None, None, false)
            .await?;
        let _: () = self
            .client
            .zadd(
                self.key(&["webhooks", &webhook.tenant]),
                None,
                None,
                false,
                false,
                (webhook.endpoint.created_at as f64, id.as_str()),
            )
            .await?;
        Ok(())
    }

    /// The endpoint `id`.
    pub async fn webhook(&self, id: &str) -> Result<Option<StoredWebhook>, StoreError> {
        let key = self.key(&["webhook", id]);
        let raw: Option<String> = self.client.get(&key).await?;
        raw.map(|r| parse(&key, &r)).transpose()
    }

    /// The signing secret of endpoint `id`.
    pub async fn webhook_secret(&self, id: &str) -> Result<Option<String>, StoreError> {
        Ok(self.client.get(self.key(&["webhook_secret", id])).await?)
    }

    /// Every endpoint of `tenant`, oldest first.
    pub async fn list_webhooks(&self, tenant: &str) -> Result<Vec<StoredWebhook>, StoreError> {
        let ids: Vec<String> = self
            .client
            .zrange(
                self.key(&["webhooks", tenant]),
                0,
                -1,
                None,
                false,
                None,
                false,
            )
            .await?;
        let keys: Vec<String> = ids.iter().map(|id| self.key(&["webhook", id])).collect();
        self.get_all(&keys).await
    }

    /// Deletes an endpoint and its secret; its queued deliveries are dropped when their turn
    /// comes.
    pub async fn delete_webhook(&self, webhook: &StoredWebhook) -> Result<(), StoreError> {
        let id = &webhook.endpoint.id;
        let _: () = self
            .client
            .zrem(self.key(&["webhooks", &webhook.tenant]), id.as_str())
            .await?;
        let _: () = self
            .client
            .del(vec![
                self.key(&["webhook", id]),
                self.key(&["webhook_secret", id]),
            ])
            .await?;
        Ok(())
    }

    /// Turns one ended batch into its deliveries; false when none waited.
    pub async fn fan_out_webhook_events(&self, now_ms: u64) -> Result<bool, StoreError> {
        let n: i64 = FAN_OUT
            .evalsha_with_reload(
                &self.client,
                vec![self.webhook_ended_key(), self.key(&["webhook_due"])],
                vec![self.prefix.clone(), now_ms.to_string()],
            )
            .await?;
        Ok(n == 1)
    }

    /// Claims the most overdue delivery for `lease` (nobody else sends it meanwhile): its id and
    /// record, `None` when nothing is due. A claimed delivery whose record is gone is dropped.
    pub async fn claim_webhook_delivery(
        &self,
        now_ms: u64,
        lease: Duration,
    ) -> Result<Option<(String, Option<Delivery>)>, StoreError> {
        let got: Option<Vec<String>> = CLAIM_DELIVERY
            .evalsha_with_reload(
                &self.client,
                vec![self.key(&["webhook_due"])],
                vec![
                    now_ms.to_string(),
                    (lease.as_millis() as u64).to_string(),
                    self.prefix.clone(),
                ],
            )
            .await?;
        let Some([id, raw]) = got.and_then(|v| <[String; 2]>::try_from(v).ok()) else {
            return Ok(None);
        };
        if raw.is_empty() {
            return Ok(Some((id, None)));
        }
        let key = self.key(&["webhook_delivery", &id]);
        Ok(Some((id, Some(parse(&key, &raw)?))))
    }

    /// Ends delivery `id`: delivered, given up or its endpoint gone.
    pub async fn finish_webhook_delivery(&self, id: &str) -> Result<(), StoreError> {
        let _: () = self.client.zrem(self.key(&["webhook_due"]), id).await?;
        let _: () = self.client.del(self.key(&["webhook_delivery", id])).await?;
        Ok(())
    }

    /// Records a failed attempt of delivery `id` and makes it due again at `due_ms`.
    pub async fn retry_webhook_delivery(
        &self,
        id: &str,
        delivery: &Delivery,
        due_ms: u64,
    ) -> Result<(), StoreError> {
        let json = serde_json::to_string(delivery).expect("a delivery serializes");
        let _: () = self
            .client
            .set(self.key(&["webhook_delivery", id]), json, None, None, false)
            .await?;
        let _: () = self
            .client
            .zadd(
                self.key(&["webhook_due"]),
                None,
                None,
                false,
                false,
                (due_ms as f64, id),
            )
            .await?;
        Ok(())
    }
}
