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

use fred::interfaces::{
    KeysInterface, ListInterface, SetsInterface, SortedSetsInterface, TransactionInterface,
};
use fred::types::scripts::Script;
use serde::{Deserialize, Serialize};

use crate::{parse, parse_batch, split_more, Cursor, Page, Store, StoreError};

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
/// Endpoints a fan-out script handles at once: however many a tenant has, Redis is held for no
/// longer than this many take.
const FAN_OUT_CHUNK: usize = 64;
/// How many of the most overdue deliveries an earlier version queued in the shared due set a
/// claim weighs (each tenant's own due set is weighed whole, by its head).
const SHARED_CLAIM_WINDOW: usize = 1024;

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

    /// A page of `tenant`'s endpoints, oldest first: up to `limit` past `after`. Its cost is the
    /// page's, whatever the tenant's count: the index is ranked, and only the page's records are
    /// read.
    pub async fn list_webhooks_page(
        &self,
        tenant: &str,
        after: Option<&Cursor>,
        limit: usize,
    ) -> Result<Page<StoredWebhook>, StoreError> {
        let index = self.keys.webhooks(tenant);
        let start = match after {
            None => 0,
            Some(Cursor::Offset(n)) => i64::try_from(*n).unwrap_or(i64::MAX),
            Some(Cursor::Id(id)) => {
                let rank: Option<i64> = self.client.zrank(&index, id.as_str(), false).await?;
                rank.ok_or_else(|| StoreError::UnknownCursor(id.clone()))? + 1
            }
        };
        // One more than the page, to tell whether more follow.
        let stop = start.saturating_add(limit as i64);
        let ids: Vec<String> = self
            .client
            .zrange(&index, start, stop, None, false, None, false)
            .await?;
        let (ids, has_more) = split_more(ids, limit);
        let keys: Vec<String> = ids.iter().map(|id| self.keys.webhook(id)).collect();
        let data = self.get_all(&keys).await?;
        Ok(Page { data, has_more })
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
            let record = self.keys.batch(&id);
            let raw: Option<String> = self.client.get(&record).await?;
            let tenant = match raw {
                Some(raw) => Some(parse_batch(&record, &raw)?.tenant),
                None => None,
            };
            if self.fan_out_batch(&id, tenant.as_deref(), now_ms).await? {
                return Ok(true);
            }
        }
        Ok(true)
    }

    /// Queues ended batch `id`'s deliveries to `tenant`'s endpoints ([`FAN_OUT_CHUNK`] per
    /// script), or only drops it from the ended list when its record is gone (`tenant` `None`):
    /// false when the endpoints changed under it (read them again, from the first).
    async fn fan_out_batch(
        &self,
        id: &str,
        tenant: Option<&str>,
        now_ms: u64,
    ) -> Result<bool, StoreError> {
        // A batch whose record is gone queues nothing: the shared set stands in for its
        // tenant's.
        let due = tenant.map_or_else(|| self.keys.webhook_due(), |t| self.keys.webhook_due_of(t));
        let common = [
            self.keys.webhook_ended(),
            due,
            self.keys.webhook_due_tenants(),
            self.keys.batch(id),
        ];
        let mut first = 0;
        loop {
            // The script is given every key it touches: each chunk of the tenant's endpoints
            // is read first, and it refuses (-1) when they changed since.
            let mut keys = common.to_vec();
            let mut endpoints: Vec<String> = Vec::new();
            if let Some(tenant) = tenant {
                let index = self.keys.webhooks(tenant);
                let last = (first + FAN_OUT_CHUNK) as i64 - 1;
                endpoints = self
                    .client
                    .zrange(&index, first as i64, last, None, false, None, false)
                    .await?;
                keys.push(index);
                for ep in &endpoints {
                    keys.push(self.keys.webhook(ep));
                    keys.push(self.keys.webhook_delivery(&format!("{id}:{ep}")));
                }
            }
            let is_last = endpoints.len() < FAN_OUT_CHUNK;
            let mut args = vec![
                id.to_owned(),
                now_ms.to_string(),
                first.to_string(),
                if is_last { "1" } else { "0" }.to_owned(),
            ];
            args.extend(endpoints);
            let n: i64 = FAN_OUT
                .evalsha_with_reload(&self.client, keys, args)
                .await?;
            match n {
                2 => first += FAN_OUT_CHUNK,
                -1 => return Ok(false),
                _ => return Ok(true),
            }
        }
    }

    /// Claims a due delivery for `lease` (nobody else sends it meanwhile): the most overdue of
    /// the tenant served longest ago among those with one due, its id and record; `None` when
    /// nothing is due. A claimed delivery whose record is gone is dropped.
    pub async fn claim_webhook_delivery(
        &self,
        now_ms: u64,
        lease: Duration,
    ) -> Result<Option<(String, Option<Delivery>)>, StoreError> {
        // The script is handed each tenant's due set: the tenants are read first. One added
        // meanwhile is weighed at the next claim.
        let tenants: Vec<String> = self
            .client
            .smembers(self.keys.webhook_due_tenants())
            .await?;
        let mut keys = vec![
            self.keys.webhook_due(),
            self.keys.webhook_served(),
            self.keys.webhook_due_tenants(),
        ];
        keys.extend(tenants.iter().map(|t| self.keys.webhook_due_of(t)));
        let mut args = vec![
            now_ms.to_string(),
            (lease.as_millis() as u64).to_string(),
            SHARED_CLAIM_WINDOW.to_string(),
            tenants.len().to_string(),
        ];
        args.extend(tenants);
        let id: Option<String> = CLAIM_DELIVERY
            .evalsha_with_reload(&self.client, keys, args)
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
        // Queued by an earlier version, it may still sit in the shared set.
        let _: () = self.client.zrem(self.keys.webhook_due_for(id), id).await?;
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
        // Into its tenant's due set, and out of the shared one where an earlier version queued
        // it, in one step: a claim in between would otherwise find it in both.
        let trx = self.client.multi();
        let due = self.keys.webhook_due_for(id);
        let _: () = trx
            .zadd(&due, None, None, false, false, (due_ms as f64, id))
            .await?;
        if let Some((tenant, _)) = id.split_once('/') {
            let _: () = trx.sadd(self.keys.webhook_due_tenants(), tenant).await?;
            let _: () = trx.zrem(self.keys.webhook_due(), id).await?;
        }
        let _: Vec<fred::types::Value> = trx.exec(true).await?;
        Ok(())
    }
}
