//! v0.10's claims as the engine uses them: taking members under a lease, the heartbeat that
//! renews the leases in hand, the release after a result, and the reclaimer that puts back
//! claims whose lease ran out (the scripts and keys are in `claims.rs`).

use super::*;

impl Shared {
    /// v0.10: peek at the `n` lowest members, then claim each (another dispatcher may win it).
    pub(super) async fn claim_each(
        self: &Arc<Self>,
        q: &Arc<Queue>,
        n: usize,
    ) -> Result<Continue, ()> {
        let peeked: Vec<(String, f64)> = match self
            .redis
            .zrangebyscore(
                q.name.as_str(),
                "-inf",
                "+inf",
                true,
                Some((0, i64::try_from(n).unwrap_or(i64::MAX))),
            )
            .await
        {
            Ok(members) => members,
            Err(e) => {
                self.redis_error("ZRANGEBYSCORE (peek)", &e);
                return Err(());
            }
        };
        for (member, score) in peeked {
            if self.stop.is_cancelled() || !self.reserve_take() {
                return Ok(Continue::Stop);
            }
            let env = match Envelope::parse(&member) {
                Ok(env) => env,
                Err(why) => {
                    // Without an id there is no claim key: removed outright, no result.
                    match self
                        .redis
                        .zrem::<i64, _, _>(q.name.as_str(), member.as_str())
                        .await
                    {
                        Ok(1..) => {
                            if self.count_take() {
                                return Ok(Continue::Stop);
                            }
                            self.drop_invalid(q, &why);
                        }
                        Ok(_) => self.unreserve_take(),
                        Err(e) => {
                            self.unreserve_take();
                            self.redis_error("ZREM (invalid member)", &e);
                            return Err(());
                        }
                    }
                    continue;
                }
            };
            match self.claim(&q.claims, &member, &env).await {
                Ok(Some(claim)) => {
                    if self.count_take() {
                        return Ok(Continue::Stop);
                    }
                    let taken = Taken {
                        env,
                        claim: Some(claim),
                        release: None,
                    };
                    self.clone().take(q.clone(), taken, member, score).await;
                }
                Ok(None) => self.unreserve_take(),
                Err(e) => {
                    self.unreserve_take();
                    self.redis_error("EVALSHA (claim)", &e);
                    return Err(());
                }
            }
        }
        Ok(Continue::Yes)
    }

    pub(super) fn drop_invalid(&self, q: &Queue, why: &str) {
        Counters::bump(&self.counters.dropped_invalid);
        tracing::warn!(queue = %q.name, error = %why, "dropping an invalid member without a result");
    }

    /// The lease expiry of a claim taken or renewed now: min(now + lease, deadline + 5 min),
    /// both scaled, and never sooner than the next heartbeat.
    pub(super) fn lease_expiry(&self, deadline: i64) -> f64 {
        let now = now_f64();
        let lease = now + self.sim.scaled(self.sim.claim_lease).as_secs_f64();
        let cap = deadline as f64 + self.sim.scaled(LEASE_GRACE).as_secs_f64();
        lease
            .min(cap)
            .max(now + self.heartbeat_interval().as_secs_f64())
    }

    /// lease / 3, at most 30 s, then scaled. The real one also keeps it above 1 s, which with
    /// the short leases of tests would renew too late.
    pub(super) fn heartbeat_interval(&self) -> Duration {
        let third = self.sim.claim_lease / 3;
        self.sim.scaled(third.min(Duration::from_secs(30)))
    }

    /// Claims `member` of `keys.queue`; `None` when another dispatcher has it.
    pub(super) async fn claim(
        &self,
        keys: &Arc<ClaimKeys>,
        member: &str,
        env: &Envelope,
    ) -> Result<Option<Claim>, fred::error::Error> {
        let key = ClaimKeys::claim_key(&env.data.id, env.token().unwrap_or(""));
        let expiry = self.lease_expiry(env.data.deadline);
        let won = self
            .scripts
            .claim(&self.redis, keys, member, &key, &self.instance_id, expiry)
            .await?;
        if !won {
            return Ok(None);
        }
        self.held_claims().insert(
            (keys.queue.clone(), key.clone()),
            (keys.clone(), env.data.deadline),
        );
        Ok(Some(Claim {
            keys: keys.clone(),
            key,
        }))
    }

    pub(super) fn held_claims(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the claim is still ours, extending its lease (done before writing its result).
    pub(super) async fn still_ours(&self, claim: &Claim) -> bool {
        let deadline = self
            .held_claims()
            .get(&(claim.keys.queue.clone(), claim.key.clone()))
            .map(|(_, d)| *d);
        let Some(deadline) = deadline else {
            return false;
        };
        let expiry = self.lease_expiry(deadline);
        self.redis_write("EVALSHA (renew)", || {
            self.scripts.renew(
                &self.redis,
                &claim.keys,
                &claim.key,
                &self.instance_id,
                expiry,
            )
        })
        .await
        .unwrap_or(false)
    }

    /// Stops renewing a claim.
    pub(super) fn forget(&self, claim: &Claim) {
        self.held_claims()
            .remove(&(claim.keys.queue.clone(), claim.key.clone()));
    }

    /// The ack's second half: deletes the claim's entries (owner checked).
    pub(super) async fn release(&self, claim: &Claim) {
        self.forget(claim);
        let released = self
            .redis_write("EVALSHA (release)", || {
                self.scripts
                    .release(&self.redis, &claim.keys, &claim.key, &self.instance_id)
            })
            .await;
        if released == Some(false) {
            tracing::warn!(queue = %claim.keys.queue, "a claim was reclaimed while in hand");
        }
    }

    /// Renews every lease in hand, every lease / 3.
    pub(super) async fn heartbeat(self: Arc<Self>) {
        let mut ticker = tokio::time::interval(self.heartbeat_interval());
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let held: Vec<(Arc<ClaimKeys>, String, i64)> = self
                .held_claims()
                .iter()
                .map(|((_, key), (keys, deadline))| (keys.clone(), key.clone(), *deadline))
                .collect();
            for (keys, key, deadline) in held {
                let expiry = self.lease_expiry(deadline);
                match self
                    .scripts
                    .renew(&self.redis, &keys, &key, &self.instance_id, expiry)
                    .await
                {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!(queue = %keys.queue, "a claim in hand was reclaimed");
                    }
                    Err(e) => self.redis_error("EVALSHA (renew)", &e),
                }
            }
        }
    }

    /// Every reclaim interval: expired claims of every queue (and of the retry set) go back.
    pub(super) async fn reclaimer(self: Arc<Self>) {
        let mut ticker = tokio::time::interval(self.sim.scaled(self.sim.reclaim_interval));
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let sets: Vec<(Arc<ClaimKeys>, bool)> = self
            .queues
            .iter()
            .map(|q| (q.claims.clone(), true))
            .collect();
        loop {
            ticker.tick().await;
            for (keys, request_queue) in &sets {
                self.reclaim(keys, *request_queue).await;
            }
        }
    }

    /// Puts back the expired claims of one sorted set: request queue members at their deadline
    /// score, retries due at once.
    pub(super) async fn reclaim(&self, keys: &ClaimKeys, request_queue: bool) {
        let now = now_f64();
        let expired = match self
            .scripts
            .expired(&self.redis, keys, now, RECLAIM_BATCH)
            .await
        {
            Ok(e) => e,
            Err(e) => {
                self.redis_error("ZRANGEBYSCORE (claims)", &e);
                return;
            }
        };
        for key in expired {
            let member = match self.scripts.member(&self.redis, keys, &key).await {
                Ok(m) => m,
                Err(e) => {
                    self.redis_error("HGET (claimed)", &e);
                    continue;
                }
            };
            let score = match member.as_deref().map(Envelope::parse) {
                Some(Ok(env)) if request_queue => env.score(),
                _ => now,
            };
            match self
                .scripts
                .reclaim(&self.redis, keys, &key, now, score)
                .await
            {
                Ok(true) => {
                    Counters::bump(&self.counters.reclaimed);
                    tracing::info!(queue = %keys.queue, "an expired claim was put back");
                }
                Ok(false) => {}
                Err(e) => self.redis_error("EVALSHA (reclaim)", &e),
            }
        }
    }
}
