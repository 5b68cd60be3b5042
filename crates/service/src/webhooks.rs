//! Delivers `batch.*` events to tenants' webhook endpoints, signed the Standard Webhooks way.
//!
//! The queue is in Redis ([`batch_state::Store::claim_webhook_delivery`]): every replica runs
//! this loop, a delivery is claimed by one sender at a time, and one whose sender died is
//! claimed again once its lease passes. Each attempt carries the same `webhook-id`; a 2xx ends
//! it, anything else is retried with exponential backoff until `serve.webhooks.give_up_after`.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use batch_config::WebhooksConfig;
use batch_http_client::CheckedClient;
use batch_state::{now_unix, Delivery, Store, WebhookEndpoint};
use bytes::Bytes;
use http_body_util::Full;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How often the queue is looked at when it was empty.
const POLL: Duration = Duration::from_millis(250);
/// Deliveries in flight at once on one replica.
const IN_FLIGHT: usize = 16;
/// The longest wait between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(3600);

/// Signs and sends webhook events.
pub(crate) struct Sender {
    client: CheckedClient,
    config: WebhooksConfig,
}

impl Sender {
    pub(crate) fn new(config: WebhooksConfig) -> Result<Self, String> {
        // A host name is called only at addresses the rules allow, checked when connecting.
        let rules = config.clone();
        let client = batch_http_client::build_checked(&Default::default(), move |ip| {
            rules.allows_address(ip)
        })
        .map_err(|e| format!("webhook client: {e}"))?;
        Ok(Self { client, config })
    }

    /// Sends `body` to `url` signed with `secret` as event `id`: the status answered, or why
    /// there was none. The URL is checked against the rules again: they may have changed.
    pub(crate) async fn send(
        &self,
        url: &str,
        secret: &str,
        id: &str,
        body: &str,
    ) -> Result<u16, String> {
        // Sent to the URL as the checker read it, never re-parsed from the raw string.
        let checked = self.config.check_url(url)?;
        let timestamp = now_unix().to_string();
        let signature = sign(secret, id, &timestamp, body)?;
        let request = hyper::Request::post(checked.as_str())
            .header("content-type", "application/json")
            .header("user-agent", "batch-processor-webhooks")
            .header("webhook-id", id)
            .header("webhook-timestamp", &timestamp)
            .header("webhook-signature", format!("v1,{signature}"))
            .body(Full::new(Bytes::from(body.to_owned())))
            .map_err(|e| format!("cannot build the request: {e}"))?;
        // Redirects are not followed (the client has no such layer): a 3xx is a failure.
        match tokio::time::timeout(self.config.timeout, self.client.request(request)).await {
            Ok(Ok(response)) => Ok(response.status().as_u16()),
            Ok(Err(e)) => Err(format!("no answer: {e}")),
            Err(_) => Err(format!("no answer within {:?}", self.config.timeout)),
        }
    }

    /// One sample event to `endpoint`, outside the queue.
    pub(crate) async fn test(
        &self,
        endpoint: &WebhookEndpoint,
        secret: &str,
        event_type: &str,
    ) -> Option<u16> {
        let id = batch_state::new_id("evt_");
        let body = event_body(&id, event_type, "batch_test", now_unix());
        self.send(&endpoint.url, secret, &id, &body)
            .await
            .map_err(|e| tracing::info!(webhook = %endpoint.id, error = %e, "test delivery failed"))
            .ok()
    }
}

/// `v1` signature: base64 of HMAC-SHA256 over `<id>.<timestamp>.<body>`, keyed with the
/// base64-decoded part of the secret after `whsec_`.
fn sign(secret: &str, id: &str, timestamp: &str, body: &str) -> Result<String, String> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let key = b64
        .decode(secret.strip_prefix("whsec_").unwrap_or(secret))
        .map_err(|_| "the stored signing secret is not base64".to_owned())?;
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key);
    let tag = ring::hmac::sign(&key, format!("{id}.{timestamp}.{body}").as_bytes());
    Ok(b64.encode(tag.as_ref()))
}

/// The event as OpenAI sends it.
fn event_body(id: &str, kind: &str, batch: &str, created_at: i64) -> String {
    serde_json::json!({
        "id": id,
        "object": "event",
        "created_at": created_at,
        "type": kind,
        "data": {"id": batch},
    })
    .to_string()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The wait after the `attempt`-th failure (1-based).
fn backoff(initial: Duration, attempt: u32) -> Duration {
    initial
        .saturating_mul(1u32 << attempt.saturating_sub(1).min(20))
        .min(MAX_BACKOFF)
}

/// Fans ended batches out into deliveries and sends what is due, until `stop`.
pub(crate) async fn run(store: Store, sender: Arc<Sender>, stop: CancellationToken) {
    let mut in_flight = JoinSet::new();
    // A claim outlives the longest attempt, so that no other replica sends it meanwhile.
    let lease = sender.config.timeout + Duration::from_secs(5);
    loop {
        let mut idle = true;
        match store.fan_out_webhook_events(now_ms()).await {
            Ok(more) => idle &= !more,
            Err(e) => tracing::warn!(error = %e, "webhook events: the state store failed"),
        }
        while in_flight.try_join_next().is_some() {}
        if in_flight.len() < IN_FLIGHT {
            match store.claim_webhook_delivery(now_ms(), lease).await {
                Ok(Some((id, delivery))) => {
                    idle = false;
                    let (store, sender) = (store.clone(), sender.clone());
                    in_flight.spawn(async move {
                        if let Err(e) = deliver(&store, &sender, &id, delivery).await {
                            tracing::warn!(delivery = %id, error = %e, "webhook delivery: the state store failed; it is retried after its lease");
                        }
                    });
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "webhook deliveries: the state store failed"),
            }
        }
        if idle {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(POLL) => {}
            }
        } else if stop.is_cancelled() {
            break;
        }
    }
    // A delivery cut here is sent again after its lease, with the same id.
    in_flight.abort_all();
}

/// One attempt of delivery `id`, then its end or its next turn.
async fn deliver(
    store: &Store,
    sender: &Sender,
    id: &str,
    delivery: Option<Delivery>,
) -> Result<(), batch_state::StoreError> {
    let Some(mut delivery) = delivery else {
        return store.finish_webhook_delivery(id).await;
    };
    let endpoint = store.webhook(&delivery.endpoint).await?;
    let secret = store.webhook_secret(&delivery.endpoint).await?;
    let (Some(endpoint), Some(secret)) = (endpoint, secret) else {
        tracing::info!(delivery = %id, "webhook endpoint deleted: its event is dropped");
        return store.finish_webhook_delivery(id).await;
    };
    let body = event_body(
        &delivery.event_id,
        &delivery.kind,
        &delivery.batch,
        delivery.created_at,
    );
    let outcome = sender
        .send(&endpoint.endpoint.url, &secret, &delivery.event_id, &body)
        .await;
    delivery.attempt += 1;
    let failure = match outcome {
        Ok(status) if (200..300).contains(&status) => {
            metrics::counter!("batch_service_webhook_deliveries_total", "result" => "sent")
                .increment(1);
            tracing::info!(event = %delivery.event_id, webhook = %delivery.endpoint, attempt = delivery.attempt, "webhook delivered");
            return store.finish_webhook_delivery(id).await;
        }
        Ok(status) => format!("answered {status}"),
        Err(e) => e,
    };
    let age = Duration::from_secs(now_unix().saturating_sub(delivery.created_at).max(0) as u64);
    if age >= sender.config.give_up_after {
        metrics::counter!("batch_service_webhook_deliveries_total", "result" => "given_up")
            .increment(1);
        tracing::warn!(event = %delivery.event_id, webhook = %delivery.endpoint, attempts = delivery.attempt, error = %failure, "webhook delivery given up");
        return store.finish_webhook_delivery(id).await;
    }
    let wait = backoff(sender.config.retry_initial_backoff, delivery.attempt);
    metrics::counter!("batch_service_webhook_deliveries_total", "result" => "retried").increment(1);
    tracing::info!(event = %delivery.event_id, webhook = %delivery.endpoint, attempt = delivery.attempt, error = %failure, retry_in = ?wait, "webhook delivery failed");
    store
        .retry_webhook_delivery(id, &delivery, now_ms() + wait.as_millis() as u64)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Standard Webhooks specification's own example.
    #[test]
    fn signs_as_the_standard_webhooks_example() {
        let sig = sign(
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            "1614265330",
            r#"{"test": 2432232314}"#,
        )
        .unwrap();
        assert_eq!(sig, "g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn backoff_doubles_up_to_an_hour() {
        let s = Duration::from_secs(5);
        assert_eq!(backoff(s, 1), s);
        assert_eq!(backoff(s, 2), s * 2);
        assert_eq!(backoff(s, 4), s * 8);
        assert_eq!(backoff(s, 30), MAX_BACKOFF);
    }
}
