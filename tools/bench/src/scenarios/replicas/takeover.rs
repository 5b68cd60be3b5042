//! The takeover run: a replica killed mid-job, and how soon the others hold and move its jobs.

use super::*;

/// Sleeps until 20 ms past the next whole second of the clock, so what follows has a second
/// of its own.
async fn next_second() {
    let into = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(Duration::ZERO, |d| {
            Duration::from_nanos(d.subsec_nanos().into())
        });
    tokio::time::sleep(Duration::from_secs(1) - into + Duration::from_millis(20)).await;
}

/// Fails with `what` once `started` is more than `limit` ago, else waits 100 ms.
async fn not_yet(what: &str, started: Instant, limit: Duration) -> Result<(), BenchError> {
    if started.elapsed() > limit {
        return Err(BenchError::Check(format!("{what}: not within {limit:?}")));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(())
}

pub(super) async fn takeover(
    cx: Ctx<'_>,
    ttl: Duration,
    run: usize,
    input: &Path,
) -> Result<Takeover, BenchError> {
    let Ctx { lab, s, progress } = cx;
    lab.flush_redis().await?;
    let dir = lab.fresh_dir(&format!("replicas-takeover-{}-{run}", ttl.as_secs()))?;
    let mut services = start_replicas(lab, s, &dir, 3, |setup| ServeSetup {
        max_active_jobs: TAKEOVER_MAX_ACTIVE_JOBS,
        replica: Some(ReplicaSetup {
            id: String::new(),
            lease_ttl: ttl,
            checkpoint_interval: CHECKPOINT_INTERVAL,
        }),
        lost_request_timeout: Some(LOST_REQUEST_TIMEOUT),
        ..setup
    })
    .await?;
    let apis: Vec<Api> = services.iter().map(|r| Api::new(r.base(), 8)).collect();
    let body = upload_for_batches(&apis[0], input).await?;
    next_second().await;
    let ids = create_batches(&apis, &body, TAKEOVER_BATCHES, TAKEOVER_BATCHES).await?;

    let waiting = Instant::now();
    let holders: Vec<String> = 'leased: loop {
        let mut held = Vec::new();
        for id in &ids {
            match lease(lab, id).await? {
                Some(l) => held.push(holder(&l).to_owned()),
                None => {
                    not_yet(
                        "every batch running under a lease",
                        waiting,
                        Duration::from_secs(60),
                    )
                    .await?;
                    continue 'leased;
                }
            }
        }
        break held;
    };
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for h in &holders {
        *count.entry(h.as_str()).or_default() += 1;
    }
    let victim_name = count
        .iter()
        .max_by_key(|(_, c)| **c)
        .map(|(h, _)| h.to_string())
        .unwrap_or_default();
    let victim: usize = victim_name
        .strip_prefix('r')
        .and_then(|i| i.parse().ok())
        .filter(|i| *i < services.len())
        .ok_or_else(|| BenchError::Check(format!("a lease held by {victim_name:?}")))?;
    let mut lost: Vec<String> = ids
        .iter()
        .zip(&holders)
        .filter(|(_, h)| **h == victim_name)
        .map(|(id, _)| id.clone())
        .collect();
    let survivor = &apis[(victim + 1) % services.len()];
    let tenth = (s.takeover_lines / 10).max(1) as u64;
    let mut created = BTreeSet::new();
    let waiting = Instant::now();
    'ready: loop {
        for id in &lost {
            let key = state_keys().checkpoint(id);
            let exists: u64 = lab.client().exists(key).await?;
            let (done, _) = completed(survivor, id).await?;
            // A job that ran ahead of the others (an earlier deadline) may end first: it has
            // nothing left to take over.
            if done >= s.takeover_lines as u64 {
                continue;
            }
            if exists == 0 || done < tenth {
                not_yet(
                    &format!("a checkpoint and a tenth of the lines of each job of the replica to kill (now {id}: checkpoint {exists}, {done} of {tenth} lines)"),
                    waiting,
                    Duration::from_secs(120),
                )
                .await?;
                continue 'ready;
            }
        }
        break;
    }
    let mut running = Vec::new();
    for id in lost {
        if completed(survivor, &id).await?.0 < s.takeover_lines as u64 {
            running.push(id);
        }
    }
    lost = running;
    if lost.is_empty() {
        return Err(BenchError::Check(
            "every job of the replica to kill ended before it could be killed".into(),
        ));
    }
    for id in &ids {
        created.insert(completed(survivor, id).await?.1);
    }
    let mut last = Vec::new();
    for id in &lost {
        last.push(completed(survivor, id).await?.0);
    }

    let killed = Instant::now();
    services[victim].kill();
    let mut held: Vec<Option<f64>> = vec![None; lost.len()];
    let mut growing: Vec<Option<f64>> = vec![None; lost.len()];
    let limit = ttl + Duration::from_secs(120);
    while growing.iter().any(Option::is_none) {
        for (j, id) in lost.iter().enumerate() {
            if held[j].is_none() {
                if let Some(l) = lease(lab, id).await? {
                    if holder(&l) != victim_name {
                        held[j] = Some(killed.elapsed().as_secs_f64());
                    }
                }
            }
            let (done, _) = completed(survivor, id).await?;
            if held[j].is_some() && growing[j].is_none() && done > last[j] {
                growing[j] = Some(killed.elapsed().as_secs_f64());
            }
            last[j] = done;
        }
        if killed.elapsed() > limit {
            return Err(BenchError::Check(format!(
                "after the SIGKILL of {victim_name}, within {limit:?}: its jobs {lost:?} held again at {held:?} s, growing at {growing:?} s"
            )));
        }
        tokio::time::sleep(TAKEOVER_POLL).await;
    }
    let held: Vec<f64> = held.into_iter().flatten().collect();
    let progressing: Vec<f64> = growing.into_iter().flatten().collect();
    wait_completed(
        survivor,
        &ids,
        s.takeover_lines,
        killed,
        POLL,
        Duration::from_secs(300),
    )
    .await?;
    progress(&format!(
        "   takeover, lease_ttl {} s, run {run}: killed {victim_name} holding {} of {} jobs; held again after {:?} s, growing after {:?} s; load {}",
        ttl.as_secs(), lost.len(), ids.len(),
        held.iter().map(|t| (t * 100.0).round() / 100.0).collect::<Vec<_>>(),
        progressing.iter().map(|t| (t * 100.0).round() / 100.0).collect::<Vec<_>>(),
        load_average(),
    ));
    for (i, service) in services.into_iter().enumerate() {
        if i != victim {
            stop(service).await?;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Takeover {
        held,
        progressing,
        one_deadline: created.len() == 1,
    })
}
