//! The retry set's mover: requests a gateway refused wait in the retry set until their backoff
//! is due, then go back into their request queue (v0.9 puts them straight into the request
//! queue at now + backoff instead; see `worker.rs`).

use super::*;

impl Shared {
    /// v0.10 (and main after #390): every poll interval, up to `batch_size` retries whose time
    /// has come (score up to now, in whole seconds) leave the retry set, each removed by
    /// whoever wins its ZREM, and go back byte for byte into their request queue at their
    /// deadline score, where the poller (and the gate) takes them like any other member.
    pub(super) async fn move_retries(self: Arc<Self>) {
        let mut ticker = tokio::time::interval(self.poll_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let due: Vec<String> = match self
                .redis
                .zrangebyscore(
                    self.retry_queue.as_str(),
                    "-inf",
                    now_secs() as f64,
                    false,
                    Some((0, i64::try_from(self.batch_size).unwrap_or(i64::MAX))),
                )
                .await
            {
                Ok(members) => members,
                Err(e) => {
                    self.redis_error("ZRANGEBYSCORE (retries)", &e);
                    continue;
                }
            };
            for member in due {
                match self
                    .redis
                    .zrem::<i64, _, _>(self.retry_queue.as_str(), member.as_str())
                    .await
                {
                    Ok(1..) => {}
                    Ok(_) => continue,
                    Err(e) => {
                        self.redis_error("ZREM (retries)", &e);
                        continue;
                    }
                }
                let env = match Envelope::parse(&member) {
                    Ok(env) => env,
                    Err(e) => {
                        Counters::bump(&self.counters.dropped_invalid);
                        tracing::warn!(error = %e, "dropping an invalid retry member");
                        continue;
                    }
                };
                let queue = non_empty(&env.internal.request_queue_name)
                    .map(str::to_owned)
                    .or_else(|| self.queues.first().map(|q| q.name.clone()));
                let Some(queue) = queue else { continue };
                self.redis_write("ZADD (due retry)", || {
                    self.redis.zadd::<i64, _, _>(
                        queue.as_str(),
                        None,
                        None,
                        false,
                        false,
                        (env.score(), member.as_str()),
                    )
                })
                .await;
            }
        }
    }
}
