//! Tenants' webhook endpoints and the queue of their deliveries, in Redis.
//!
//! A batch reaching a final status is pushed on `{prefix}:webhook_ended` by the same script that
//! saves the status, so no end is lost to a replica dying right after it. Any replica then fans
//! it out into one delivery per endpoint of the tenant that wants the event (its record under
//! `<batch>:<endpoint>`), each in `{prefix}:webhook_due` (a sorted set by due time in ms, its
//! member `<tenant>/<batch>:<endpoint>`). A sender claims a due delivery by moving its due time
//! past its own attempt (a lease): one sender at a time per delivery, and another replica's
//! turn when that one dies. Turns are shared among tenants: of the most overdue deliveries,
//! the claim takes one of the tenant served longest ago. The signing secret sits under a key of its own,
//! never in the record that listings read.

use std::sync::LazyLock;
use std::time::Duration;

use fred::interfaces::{KeysInterface, ListInterface, SortedSetsInterface};
use fred::types::scripts::Script;
use serde::{Deserialize, Serialize};

use crate::{parse, parse_batch, Store, StoreError};

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

static FAN_OUT: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("webhooks/fan_out.lua")));
static ADD_ENDPOINT: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("webhooks/add_endpoint.lua")));
static CLAIM_DELIVERY: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("webhooks/claim_delivery.lua")));

/// How many times a fan-out reads a tenant's endpoints again when they keep changing under it.
const FAN_OUT_TRIES: usize = 8;
/// How many of the most overdue deliveries a claim weighs to share turns among tenants: a
/// tenant is only passed over while another has more than this many due before its own.
const CLAIM_WINDOW: usize = 1024;

impl Store {
    /// Stores an endpoint and lists it under its tenant; `secret`, when given, replaces its
    /// signing secret.
    pub async fn put_webhook(
        &self,
        webhook: &StoredWebhook,
        secret: Option<&str>,
    ) -> Result<(), StoreError> {
        let id = &webhook.endpoint.id;
        self.write_webhook(webhook, secret).await?;
        let _: () = self
            .client
            .zadd(
                self.keys.webhooks(&webhook.tenant),
                None,
                None,
                false,
                false,
                (webhook.endpoint.created_at as f64, id.as_str()),
            )
            .await?;
        Ok(())
    }

    /// Writes an endpoint's record and, when given, its signing secret (not its listing).
    async fn write_webhook(
        &self,
        webhook: &StoredWebhook,
        secret: Option<&str>,
    ) -> Result<(), StoreError> {
        let id = &webhook.endpoint.id;
        let json = serde_json::to_string(webhook).expect("a webhook record serializes");
        if let Some(secret) = secret {
            let _: () = self
                .client
                .set(self.keys.webhook_secret(id), secret, None, None, false)
                .await?;
        }
        let _: () = self
            .client
            .set(self.keys.webhook(id), json, None, None, false)
            .await?;
        Ok(())
    }

    /// Stores a new endpoint with its signing secret and lists it under its tenant, unless the
    /// tenant already has `cap` endpoints: false then, and nothing is kept. The cap is checked
    /// and the endpoint listed in one step, so racing creates cannot pass it together.
    pub async fn create_webhook(
        &self,
        webhook: &StoredWebhook,
        secret: &str,
        cap: u32,
    ) -> Result<bool, StoreError> {
        let id = &webhook.endpoint.id;
        // The record first: an endpoint listed is always readable.
        self.write_webhook(webhook, Some(secret)).await?;
        let listed: i64 = ADD_ENDPOINT
            .evalsha_with_reload(
                &self.client,
                vec![self.keys.webhooks(&webhook.tenant)],
                vec![
                    cap.to_string(),
                    webhook.endpoint.created_at.to_string(),
                    id.clone(),
                ],
            )
            .await?;
        if listed == 1 {
            return Ok(true);
        }
        self.forget_webhook(id).await?;
        Ok(false)
    }

    /// The endpoint `id`.
    pub async fn webhook(&self, id: &str) -> Result<Option<StoredWebhook>, StoreError> {
        let key = self.keys.webhook(id);
        let raw: Option<String> = self.client.get(&key).await?;
        raw.map(|r| parse(&key, &r)).transpose()
    }

    /// The signing secret of endpoint `id`.
    pub async fn webhook_secret(&self, id: &str) -> Result<Option<String>, StoreError> {
        Ok(self.client.get(self.keys.webhook_secret(id)).await?)
    }

    /// Every endpoint of `tenant`, oldest first.
    pub async fn list_webhooks(&self, tenant: &str) -> Result<Vec<StoredWebhook>, StoreError> {
        let ids: Vec<String> = self
            .client
            .zrange(self.keys.webhooks(tenant), 0, -1, None, false, None, false)
            .await?;
        let keys: Vec<String> = ids.iter().map(|id| self.keys.webhook(id)).collect();
        self.get_all(&keys).await
    }

    /// Deletes an endpoint and its secret; its queued deliveries are dropped when their turn
    /// comes.
    pub async fn delete_webhook(&self, webhook: &StoredWebhook) -> Result<(), StoreError> {
        let id = &webhook.endpoint.id;
        let _: () = self
            .client
            .zrem(self.keys.webhooks(&webhook.tenant), id.as_str())
            .await?;
        self.forget_webhook(id).await
    }

    /// Deletes endpoint `id`'s record and signing secret.
    async fn forget_webhook(&self, id: &str) -> Result<(), StoreError> {
        let _: () = self
            .client
            .del(vec![self.keys.webhook(id), self.keys.webhook_secret(id)])
            .await?;
        Ok(())
    }

    /// Turns one ended batch into its deliveries; false when none waited.
    pub async fn fan_out_webhook_events(&self, now_ms: u64) -> Result<bool, StoreError> {
        let ended = self.keys.webhook_ended();
        for _ in 0..FAN_OUT_TRIES {
            let Some(id): Option<String> = self.client.lindex(&ended, 0).await? else {
                return Ok(false);
            };
            // The script is given every key it touches: the tenant's endpoints are read first,
            // and it refuses (-1) when they changed since.
            let record = self.keys.batch(&id);
            let raw: Option<String> = self.client.get(&record).await?;
            let tenant = match raw {
                Some(raw) => Some(parse_batch(&record, &raw)?.tenant),
                None => None,
            };
            let mut keys = vec![ended.clone(), self.keys.webhook_due(), record];
            let mut args = vec![id.clone(), now_ms.to_string()];
            if let Some(tenant) = tenant {
                let index = self.keys.webhooks(&tenant);
                let endpoints: Vec<String> = self
                    .client
                    .zrange(&index, 0, -1, None, false, None, false)
                    .await?;
                keys.push(index);
                for ep in endpoints {
                    keys.push(self.keys.webhook(&ep));
                    keys.push(self.keys.webhook_delivery(&format!("{id}:{ep}")));
                    args.push(ep);
                }
            }
            let n: i64 = FAN_OUT
                .evalsha_with_reload(&self.client, keys, args)
                .await?;
            if n >= 0 {
                return Ok(true);
            }
        }
        Ok(true)
    }

    /// Claims a due delivery for `lease` (nobody else sends it meanwhile), of the tenant served
    /// longest ago among the most overdue: its id and record, `None` when nothing is due. A
    /// claimed delivery whose record is gone is dropped.
    pub async fn claim_webhook_delivery(
        &self,
        now_ms: u64,
        lease: Duration,
    ) -> Result<Option<(String, Option<Delivery>)>, StoreError> {
        let id: Option<String> = CLAIM_DELIVERY
            .evalsha_with_reload(
                &self.client,
                vec![self.keys.webhook_due(), self.keys.webhook_served()],
                vec![
                    now_ms.to_string(),
                    (lease.as_millis() as u64).to_string(),
                    CLAIM_WINDOW.to_string(),
                ],
            )
            .await?;
        let Some(id) = id else {
            return Ok(None);
        };
        let key = self.keys.webhook_delivery(&id);
        let raw: Option<String> = self.client.get(&key).await?;
        let delivery = raw.map(|raw| parse(&key, &raw)).transpose()?;
        Ok(Some((id, delivery)))
    }

    /// Ends delivery `id`: delivered, given up or its endpoint gone.
    pub async fn finish_webhook_delivery(&self, id: &str) -> Result<(), StoreError> {
        let _: () = self.client.zrem(self.keys.webhook_due(), id).await?;
        let _: () = self.client.del(self.keys.webhook_delivery(id)).await?;
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
            .set(self.keys.webhook_delivery(id), json, None, None, false)
            .await?;
        let _: () = self
            .client
            .zadd(
                self.keys.webhook_due(),
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
