use super::*;
use batch_testkit::RedisServer;
use batch_wire::Batch;
use serde_json::json;

async fn store(redis: &RedisServer) -> Store {
    let client = batch_redis::connect(&redis.url(), &Default::default())
        .await
        .unwrap();
    Store::new(client, "svc")
}

fn file(tenant: &str, id: &str, purpose: &str, expires_at: Option<i64>) -> StoredFile {
    StoredFile {
        tenant: tenant.into(),
        file: FileObject {
            id: id.into(),
            object: "file".into(),
            bytes: 10,
            created_at: 1,
            filename: "in.jsonl".into(),
            purpose: purpose.into(),
            expires_at,
            status: "processed".into(),
            status_details: None,
        },
        key: None,
    }
}

fn batch(tenant: &str, id: &str, deadline: i64) -> StoredBatch {
    StoredBatch::new(id, tenant, "file-x", "24h", 86_400, 1, deadline)
}

#[tokio::test]
async fn listings_page_by_id_per_tenant_and_purpose() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    let ids: Vec<String> = (0..25).map(|i| format!("file-{i:03}")).collect();
    for (i, id) in ids.iter().enumerate() {
        let purpose = if i % 5 == 0 { "batch_output" } else { "batch" };
        s.put_file(&file("a", id, purpose, None)).await.unwrap();
    }
    s.put_file(&file("b", "file-999", "batch", None))
        .await
        .unwrap();

    let mut seen = Vec::new();
    let mut after: Option<Cursor> = None;
    loop {
        let page = s
            .list_files("a", None, after.as_ref(), 10, Order::Asc)
            .await
            .unwrap();
        seen.extend(page.data.iter().map(|f| f.file.id.clone()));
        after = page.data.last().map(|f| Cursor::Id(f.file.id.clone()));
        if !page.has_more {
            break;
        }
    }
    assert_eq!(seen, ids, "every file of a, once, in order, none of b's");

    // An offset skips that many, and agrees with the id cursor at the same place.
    let by_offset = s
        .list_files("a", None, Some(&Cursor::Offset(10)), 10, Order::Asc)
        .await
        .unwrap();
    let by_id = s
        .list_files("a", None, Some(&Cursor::Id(ids[9].clone())), 10, Order::Asc)
        .await
        .unwrap();
    let offset_ids: Vec<_> = by_offset.data.iter().map(|f| &f.file.id).collect();
    let id_ids: Vec<_> = by_id.data.iter().map(|f| &f.file.id).collect();
    assert_eq!(offset_ids, ids[10..20].iter().collect::<Vec<_>>());
    assert_eq!(offset_ids, id_ids);
    assert!(by_offset.has_more && by_id.has_more);
    let last = s
        .list_files("a", None, Some(&Cursor::Offset(20)), 10, Order::Asc)
        .await
        .unwrap();
    assert_eq!((last.data.len(), last.has_more), (5, false));
    let past = s
        .list_files("a", None, Some(&Cursor::Offset(25)), 10, Order::Asc)
        .await
        .unwrap();
    assert_eq!((past.data.len(), past.has_more), (0, false));
    // An id that is not in this listing (another tenant's, another purpose's, none) is refused.
    for stranger in ["file-999", "file-nope"] {
        let e = s
            .list_files(
                "a",
                None,
                Some(&Cursor::Id(stranger.into())),
                10,
                Order::Asc,
            )
            .await
            .unwrap_err();
        assert!(
            matches!(e, StoreError::UnknownCursor(ref c) if c == stranger),
            "{e}"
        );
    }
    let e = s
        .list_files(
            "a",
            Some("batch_output"),
            Some(&Cursor::Id(ids[1].clone())),
            10,
            Order::Asc,
        )
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::UnknownCursor(_)), "{e}");

    let desc = s.list_files("a", None, None, 3, Order::Desc).await.unwrap();
    let got: Vec<_> = desc.data.iter().map(|f| f.file.id.as_str()).collect();
    assert_eq!(got, ["file-024", "file-023", "file-022"]);
    assert!(desc.has_more);
    let outputs = s
        .list_files("a", Some("batch_output"), None, 100, Order::Asc)
        .await
        .unwrap();
    assert_eq!(outputs.data.len(), 5);
    assert!(!outputs.has_more);

    let gone = s.file("file-003").await.unwrap().unwrap();
    assert!(s.delete_file(&gone).await.unwrap());
    assert!(!s.delete_file(&gone).await.unwrap());
    assert!(s.file("file-003").await.unwrap().is_none());
    let all = s
        .list_files("a", None, None, 100, Order::Asc)
        .await
        .unwrap();
    assert_eq!(all.data.len(), 24);
}

#[tokio::test]
async fn expired_files_are_found_by_time() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    s.put_file(&file("a", "file-1", "batch", Some(100)))
        .await
        .unwrap();
    s.put_file(&file("a", "file-2", "batch", Some(200)))
        .await
        .unwrap();
    s.put_file(&file("a", "file-3", "batch", None))
        .await
        .unwrap();
    assert_eq!(s.expired_files(150, 10).await.unwrap(), ["file-1"]);
    assert_eq!(
        s.expired_files(250, 10).await.unwrap(),
        ["file-1", "file-2"]
    );
    let f = s.file("file-1").await.unwrap().unwrap();
    s.delete_file(&f).await.unwrap();
    assert_eq!(s.expired_files(250, 10).await.unwrap(), ["file-2"]);
}

const TTL: std::time::Duration = std::time::Duration::from_secs(30);

fn job_of(lease: Option<JobLease>) -> Option<String> {
    lease.map(|l| l.job)
}

#[tokio::test]
async fn jobs_are_claimed_by_deadline_and_cancels_jump_the_queue() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    s.create_batch(&batch("a", "batch_late", 300))
        .await
        .unwrap();
    s.create_batch(&batch("b", "batch_soon", 100))
        .await
        .unwrap();
    s.create_batch(&batch("a", "batch_mid", 200)).await.unwrap();
    assert_eq!(s.queued().await.unwrap(), 3);

    let soon = s
        .claim_queued("r1", TTL, &SlotShare::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((soon.job.as_str(), soon.epoch), ("batch_soon", 1));
    assert_eq!(
        s.request_cancel("batch_late").await.unwrap(),
        CancelRequest::WasQueued
    );
    assert_eq!(
        s.request_cancel("batch_late").await.unwrap(),
        CancelRequest::Already
    );
    assert_eq!(
        s.request_cancel("batch_soon").await.unwrap(),
        CancelRequest::WasRunning
    );
    assert!(s.cancel_requested("batch_soon").await.unwrap());
    assert!(!s.cancel_requested("batch_mid").await.unwrap());
    let shown = s.batch("batch_late").await.unwrap().unwrap();
    assert_eq!(shown.status, BatchStatus::Cancelling);

    assert_eq!(
        job_of(s.claim_cancelled("r1", TTL).await.unwrap()).as_deref(),
        Some("batch_late")
    );
    assert_eq!(s.claim_cancelled("r1", TTL).await.unwrap(), None);
    assert_eq!(
        job_of(
            s.claim_queued("r2", TTL, &SlotShare::default())
                .await
                .unwrap()
        )
        .as_deref(),
        Some("batch_mid")
    );
    assert_eq!(
        s.claim_queued("r2", TTL, &SlotShare::default())
            .await
            .unwrap(),
        None
    );
    let running = s.running().await.unwrap();
    assert_eq!(running.get("batch_soon").map(String::as_str), Some("r1"));
    assert_eq!(running.get("batch_mid").map(String::as_str), Some("r2"));
    assert!(s.release(&soon).await.unwrap());
    assert!(!s.running().await.unwrap().contains_key("batch_soon"));
}

/// Creates tenant `a`'s batch `id` (alone in the queue) and claims it for `r1`.
async fn created_and_claimed(s: &Store, id: &str) -> JobLease {
    s.create_batch(&batch("a", id, 100)).await.unwrap();
    s.claim_queued("r1", TTL, &SlotShare::default())
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn a_cancel_request_moves_the_record_and_a_racing_save_keeps_it() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    let lease = created_and_claimed(&s, "batch_1").await;
    // The runner's copy of the record, read before the cancel.
    let mut runner = s.batch("batch_1").await.unwrap().unwrap();
    let running = Change::Running {
        status: BatchStatus::InProgress,
        counts: batch_wire::RequestCounts {
            total: 4,
            completed: 1,
            failed: 0,
        },
    };
    assert_eq!(
        s.advance(&mut runner, running, Some(&lease)).await.unwrap(),
        Advance::Saved
    );
    assert_eq!(
        s.request_cancel("batch_1").await.unwrap(),
        CancelRequest::WasRunning
    );
    let stored = s.batch("batch_1").await.unwrap().unwrap();
    assert_eq!(stored.status, BatchStatus::Cancelling);
    let counts = s.status_counts().await.unwrap();
    assert_eq!(counts.get("cancelling"), Some(&1));
    assert_eq!(counts.get("in_progress"), Some(&0));
    // The runner's next progress save, from its stale copy, does not move it back.
    assert_eq!(runner.status, BatchStatus::InProgress);
    assert_eq!(
        s.advance(&mut runner, running, Some(&lease)).await.unwrap(),
        Advance::Saved
    );
    assert_eq!(runner.status, BatchStatus::Cancelling);
    let stored = s.batch("batch_1").await.unwrap().unwrap();
    assert_eq!(stored.status, BatchStatus::Cancelling);
    assert_eq!(stored.counts.completed, 1);
    assert_eq!(stored.times.cancelling, runner.times.cancelling);
}

#[tokio::test]
async fn a_lapsed_lease_is_adopted_with_a_new_epoch_that_fences_the_old_holder() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    s.create_batch(&batch("a", "batch_1", 100)).await.unwrap();
    let short = std::time::Duration::from_millis(300);
    let first = s
        .claim_queued("r1", short, &SlotShare::default())
        .await
        .unwrap()
        .unwrap();
    let record = s.batch("batch_1").await.unwrap().unwrap();
    assert_eq!(s.save_batch(&record, Some(&first)).await.unwrap(), 1);

    // Held: nobody else may take it, and renewing keeps it.
    assert_eq!(s.adopt("batch_1", "r2", TTL).await.unwrap(), None);
    assert_eq!(
        s.renew(std::slice::from_ref(&first), short).await.unwrap(),
        Renewal::default()
    );
    assert!(s.unleased(&["batch_1".into()]).await.unwrap().is_empty());

    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(s.unleased(&["batch_1".into()]).await.unwrap(), ["batch_1"]);
    let second = s.adopt("batch_1", "r2", TTL).await.unwrap().unwrap();
    assert_eq!(second.epoch, first.epoch + 1);

    // The first holder wakes up: it has lost the job and cannot write for it.
    let renewal = s.renew(std::slice::from_ref(&first), TTL).await.unwrap();
    assert_eq!(renewal.lost, std::slice::from_ref(&first));
    assert!(renewal.regained.is_empty());
    assert!(!s.hold(&first, TTL).await.unwrap());
    assert_eq!(s.save_batch(&record, Some(&first)).await.unwrap(), 0);
    assert!(!s.save_checkpoint(&first, "{}").await.unwrap());
    assert!(!s.release(&first).await.unwrap());
    assert!(s.save_checkpoint(&second, r#"{"n":1}"#).await.unwrap());
    assert_eq!(
        s.checkpoint("batch_1").await.unwrap().as_deref(),
        Some(r#"{"n":1}"#)
    );
    assert_eq!(s.save_batch(&record, Some(&second)).await.unwrap(), 1);

    // A shutdown hands it over at once; a restarted r2 may take its own job back.
    s.release_lease(&second).await.unwrap();
    let third = s.adopt("batch_1", "r3", TTL).await.unwrap().unwrap();
    assert_eq!(third.epoch, 3);
    let again = s.adopt("batch_1", "r3", TTL).await.unwrap().unwrap();
    assert_eq!(again.epoch, 4, "the same replica after a restart");
    assert!(s.release(&again).await.unwrap());
    assert_eq!(s.adopt("batch_1", "r1", TTL).await.unwrap(), None, "ended");
}

#[tokio::test]
async fn a_lapsed_lease_nobody_took_is_held_again_by_its_replica() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    for id in ["batch_1", "batch_2", "batch_3"] {
        s.create_batch(&batch("a", id, 100)).await.unwrap();
    }
    let short = std::time::Duration::from_millis(200);
    let mut leases = Vec::new();
    for _ in 0..3 {
        leases.push(
            s.claim_queued("r1", short, &SlotShare::default())
                .await
                .unwrap()
                .unwrap(),
        );
    }
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let record = s.batch("batch_1").await.unwrap().unwrap();
    // Lapsed: writes are refused until the lease is held again.
    assert_eq!(s.save_batch(&record, Some(&leases[0])).await.unwrap(), 0);
    // batch_2 was taken by r2 meanwhile; batch_3 is nobody's any more.
    let taken = s.adopt("batch_2", "r2", TTL).await.unwrap().unwrap();
    s.forget_running("batch_3").await.unwrap();

    let renewal = s.renew(&leases, TTL).await.unwrap();
    assert_eq!(renewal.regained, [leases[0].clone()]);
    assert_eq!(renewal.lost, [leases[1].clone(), leases[2].clone()]);
    // Held again under the same epoch: writes go through, others are kept out.
    assert_eq!(s.save_batch(&record, Some(&leases[0])).await.unwrap(), 1);
    assert!(s.save_checkpoint(&leases[0], "{}").await.unwrap());
    assert_eq!(s.adopt("batch_1", "r2", TTL).await.unwrap(), None);
    assert!(s.unleased(&["batch_1".into()]).await.unwrap().is_empty());
    assert!(s.hold(&leases[0], TTL).await.unwrap());
    // The new holder of batch_2 is not disturbed.
    assert!(s.hold(&taken, TTL).await.unwrap());
    assert!(!s.hold(&leases[1], TTL).await.unwrap());
    assert!(s.release(&leases[0]).await.unwrap());
}

#[tokio::test]
async fn saving_moves_status_counts_and_lists_newest_first() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    for i in 0..5 {
        s.create_batch(&batch("a", &format!("batch_{i}"), 100))
            .await
            .unwrap();
    }
    let mut b = s.batch("batch_2").await.unwrap().unwrap();
    b.set_status(BatchStatus::InProgress, 5);
    s.save_batch(&b, None).await.unwrap();
    s.save_batch(&b, None).await.unwrap();
    let counts = s.status_counts().await.unwrap();
    assert_eq!(counts.get("validating"), Some(&4));
    assert_eq!(counts.get("in_progress"), Some(&1));

    let page = s.list_batches("a", None, 2).await.unwrap();
    let ids: Vec<_> = page.data.iter().map(|b| b.id.as_str()).collect();
    assert_eq!(ids, ["batch_4", "batch_3"]);
    assert!(page.has_more);
    let page = s
        .list_batches("a", Some(&Cursor::Id("batch_1".into())), 2)
        .await
        .unwrap();
    assert_eq!(page.data.len(), 1);
    assert!(!page.has_more);
    assert!(s.list_batches("b", None, 2).await.unwrap().data.is_empty());
    let page = s
        .list_batches("a", Some(&Cursor::Offset(3)), 2)
        .await
        .unwrap();
    let ids: Vec<_> = page.data.iter().map(|b| b.id.as_str()).collect();
    assert_eq!((ids, page.has_more), (vec!["batch_1", "batch_0"], false));
    assert!(matches!(
        s.list_batches("b", Some(&Cursor::Id("batch_1".into())), 2)
            .await,
        Err(StoreError::UnknownCursor(_))
    ));
}

#[test]
fn after_is_an_offset_when_all_digits() {
    assert_eq!(Cursor::parse("2"), Cursor::Offset(2));
    assert_eq!(Cursor::parse("0"), Cursor::Offset(0));
    assert_eq!(Cursor::parse("batch_01"), Cursor::Id("batch_01".into()));
    assert_eq!(Cursor::parse("-1"), Cursor::Id("-1".into()));
    assert_eq!(Cursor::parse("+1"), Cursor::Id("+1".into()));
    assert_eq!(Cursor::parse(""), Cursor::Id("".into()));
}

#[test]
fn ids_sort_by_creation_time() {
    let a = new_id("batch_");
    std::thread::sleep(std::time::Duration::from_millis(2));
    let b = new_id("batch_");
    assert!(a < b, "{a} {b}");
    assert_eq!(a.len(), "batch_".len() + 24);
}

/// Queues `n` batches of `tenant`, `batch_<tenant><i>`, due one second apart from `due`.
async fn queue_many(s: &Store, tenant: &str, n: i64, due: i64) {
    for i in 0..n {
        s.create_batch(&batch(tenant, &format!("batch_{tenant}{i:03}"), due + i))
            .await
            .unwrap();
    }
}

/// The ids `share` claims on `s`, one after another, until the queue is empty.
async fn claim_all(s: &Store, share: &SlotShare) -> Vec<String> {
    let mut order = Vec::new();
    while let Some(lease) = s.claim_queued("r1", TTL, share).await.unwrap() {
        order.push(lease.job);
    }
    order
}

#[tokio::test]
async fn free_slots_go_round_the_tenants_whatever_each_has_queued() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    // Tenant a's batches are all more urgent than tenant b's, and many more.
    queue_many(&s, "a", 5, 100).await;
    queue_many(&s, "b", 2, 500).await;
    // Equal shares: the earlier deadline; then whoever runs fewer; a tenant at the cap (2)
    // after every tenant under it.
    let share = SlotShare {
        cap: 2,
        ..SlotShare::default()
    };
    assert_eq!(
        claim_all(&s, &share).await,
        [
            "batch_a000",
            "batch_b000",
            "batch_a001",
            "batch_b001",
            "batch_a002",
            "batch_a003",
            "batch_a004"
        ]
    );
}

#[tokio::test]
async fn a_tenant_with_one_batch_queued_is_next_after_another_tenants_hundreds() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    queue_many(&s, "a", 400, 100).await;
    // Four slots, all a's; then b creates one batch, the least urgent of all.
    let share = SlotShare::default();
    for _ in 0..4 {
        s.claim_queued("r1", TTL, &share).await.unwrap().unwrap();
    }
    s.create_batch(&batch("b", "batch_b", 10_000))
        .await
        .unwrap();
    let next = s.claim_queued("r1", TTL, &share).await.unwrap().unwrap();
    assert_eq!(next.job, "batch_b");
}

/// The candidates of `leases`, all of tenant `tenant`.
fn candidates(leases: &[JobLease], tenant: &str) -> Vec<Candidate> {
    leases
        .iter()
        .map(|l| Candidate {
            job: l.job.clone(),
            tenant: tenant.to_owned(),
        })
        .collect()
}

#[tokio::test]
async fn a_slot_is_given_back_once_for_a_tenant_below_its_share_and_never_to_itself() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    queue_many(&s, "a", 40, 100).await;
    let share = SlotShare::default();
    // Two replicas of two slots each, all a's: a alone keeps them, whatever it has queued.
    let mut r1 = Vec::new();
    let mut r2 = Vec::new();
    for _ in 0..2 {
        r1.push(s.claim_queued("r1", TTL, &share).await.unwrap().unwrap());
        r2.push(s.claim_queued("r2", TTL, &share).await.unwrap().unwrap());
    }
    assert_eq!(
        s.preempt("r1", &share, &candidates(&r1, "a"))
            .await
            .unwrap(),
        None
    );
    // b queues one batch: one replica gives one slot back, the least urgent candidate of the
    // most served tenant; the other replica then sees b's share taken care of.
    s.create_batch(&batch("b", "batch_b", 10_000))
        .await
        .unwrap();
    let mut order = candidates(&r2, "a");
    order.reverse();
    let asked = s.preempt("r2", &share, &order).await.unwrap();
    assert_eq!(asked.as_deref(), Some(r2[1].job.as_str()));
    assert_eq!(
        s.preempt("r1", &share, &candidates(&r1, "a"))
            .await
            .unwrap(),
        None
    );
    assert_eq!(s.preempt("r2", &share, &order).await.unwrap(), None);
    // A job of another replica, or of the waiting tenant, is never asked.
    assert_eq!(
        s.preempt("r2", &share, &candidates(&r1, "a"))
            .await
            .unwrap(),
        None
    );
    // It is queued again by its deadline under its lease, once; the freed slot goes to b.
    assert!(s.requeue(&r2[1], "a", 100).await.unwrap());
    assert!(!s.requeue(&r2[1], "a", 100).await.unwrap());
    let next = s.claim_queued("r2", TTL, &share).await.unwrap().unwrap();
    assert_eq!(next.job, "batch_b");
    // b runs its one batch: nothing moves back, nor on.
    assert_eq!(
        s.preempt("r1", &share, &candidates(&r1, "a"))
            .await
            .unwrap(),
        None
    );
    // The queued-again job is a's most urgent, claimed again with a new epoch.
    let again = s.claim_queued("r2", TTL, &share).await.unwrap().unwrap();
    assert_eq!(again.job, r2[1].job);
    assert!(again.epoch > r2[1].epoch);
}

#[tokio::test]
async fn weights_give_a_tenant_slots_in_proportion() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    queue_many(&s, "a", 30, 100).await;
    queue_many(&s, "b", 30, 100).await;
    let share = SlotShare {
        cap: 0,
        weights: [("a".to_owned(), 3)].into_iter().collect(),
    };
    // Of the first 12 slots (none ends), a gets 9 and b 3.
    let mut a = 0;
    for _ in 0..12 {
        let lease = s.claim_queued("r1", TTL, &share).await.unwrap().unwrap();
        a += usize::from(lease.job.starts_with("batch_a"));
    }
    assert_eq!(a, 9);
    // The rest all run too: no slot is held back for a tenant with nothing queued.
    assert_eq!(claim_all(&s, &share).await.len(), 48);
}

#[tokio::test]
async fn unfinished_batches_and_stored_files_are_counted_against_quotas() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    for i in 0..2 {
        let b = batch("a", &format!("batch_{i}"), 100);
        assert_eq!(s.create_batch_within(&b, 2).await.unwrap(), Ok(()));
    }
    let third = batch("a", "batch_2", 100);
    assert_eq!(
        s.create_batch_within(&third, 2).await.unwrap(),
        Err(QuotaExceeded::Batches)
    );
    // Another tenant is not held back; a batch ending frees its tenant's place, once.
    let other = batch("b", "batch_b", 100);
    assert_eq!(s.create_batch_within(&other, 2).await.unwrap(), Ok(()));
    let mut ended = s.batch("batch_0").await.unwrap().unwrap();
    ended.status = BatchStatus::Completed;
    assert_eq!(s.save_batch(&ended, None).await.unwrap(), 1);
    assert_eq!(s.save_batch(&ended, None).await.unwrap(), 1);
    assert_eq!(s.unfinished("a").await.unwrap(), 1);
    assert_eq!(s.create_batch_within(&third, 2).await.unwrap(), Ok(()));
    assert_eq!(s.unfinished("a").await.unwrap(), 2);

    let quota = FileQuota {
        max_bytes: 25,
        max_files: 3,
    };
    for i in 0..2 {
        let f = file("a", &format!("file-{i}"), "batch", None);
        assert_eq!(s.put_file_within(&f, &quota).await.unwrap(), Ok(()));
    }
    let f = file("a", "file-2", "batch", None);
    assert_eq!(
        s.put_file_within(&f, &quota).await.unwrap(),
        Err(QuotaExceeded::StoredBytes)
    );
    assert_eq!(s.usage("a").await.unwrap(), (20, 2));
    // Stored again, a record counts once.
    let again = file("a", "file-1", "batch", None);
    assert_eq!(s.put_file_within(&again, &quota).await.unwrap(), Ok(()));
    assert_eq!(s.usage("a").await.unwrap(), (20, 2));
    assert!(s.delete_file(&again).await.unwrap());
    assert_eq!(s.usage("a").await.unwrap(), (10, 1));
    let few = FileQuota {
        max_bytes: 0,
        max_files: 1,
    };
    assert_eq!(
        s.put_file_within(&f, &few).await.unwrap(),
        Err(QuotaExceeded::Files)
    );
}

/// Everything a listing, the expiry index and the queues show, to compare before and after.
async fn view(s: &Store) -> Vec<String> {
    let mut out = Vec::new();
    for tenant in ["a", "b"] {
        let mut after: Option<String> = None;
        loop {
            let cursor = after.clone().map(Cursor::Id);
            let page = s.list_batches(tenant, cursor.as_ref(), 2).await.unwrap();
            out.push(format!(
                "{tenant} batches after {after:?}: {:?} more {}",
                page.data
                    .iter()
                    .map(|b| (&b.id, b.status.as_str()))
                    .collect::<Vec<_>>(),
                page.has_more
            ));
            after = page.data.last().map(|b| b.id.clone());
            if !page.has_more {
                break;
            }
        }
        let files = s
            .list_files(tenant, None, None, 100, Order::Asc)
            .await
            .unwrap();
        out.push(format!(
            "{tenant} files: {:?}",
            files.data.iter().map(|f| &f.file.id).collect::<Vec<_>>()
        ));
        out.push(format!(
            "{tenant} usage: {:?}",
            s.usage(tenant).await.unwrap()
        ));
        out.push(format!(
            "{tenant} unfinished: {}",
            s.unfinished(tenant).await.unwrap()
        ));
    }
    out.push(format!(
        "expired: {:?}",
        s.expired_files(1_000, 100).await.unwrap()
    ));
    out.push(format!("counts: {:?}", s.status_counts().await.unwrap()));
    out
}

#[tokio::test]
async fn a_flushed_redis_is_rebuilt_from_the_storage_copy() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let storage =
        batch_storage::Storage::from_url(&format!("file://{}", dir.path().display())).unwrap();
    let s = store(&redis).await.with_mirror(storage.clone());
    s.put_file(&file("a", "file-001", "batch", Some(500)))
        .await
        .unwrap();
    s.put_file(&file("a", "file-002", "batch_output", None))
        .await
        .unwrap();
    s.put_file(&file("b", "file-003", "batch", None))
        .await
        .unwrap();
    s.put_file(&file("a", "file-004", "batch", None))
        .await
        .unwrap();
    s.delete_file(&file("a", "file-004", "batch", None))
        .await
        .unwrap();
    // a: 5 batches; 0 done, 1 running with a checkpoint, 2 queued, 3 cancelled while queued,
    // 4 queued; b: one queued.
    for i in 0..5 {
        s.create_batch(&batch("a", &format!("batch_{i}"), 100 + i))
            .await
            .unwrap();
    }
    s.create_batch(&batch("b", "batch_9", 50)).await.unwrap();
    let ttl = Duration::from_secs(30);
    let l0 = s
        .claim_queued("r0", ttl, &SlotShare::default())
        .await
        .unwrap()
        .unwrap();
    let l1 = s
        .claim_queued("r0", ttl, &SlotShare::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((l0.job.as_str(), l1.job.as_str()), ("batch_9", "batch_0"));
    let l2 = s
        .claim_queued("r0", ttl, &SlotShare::default())
        .await
        .unwrap()
        .unwrap();
    let mut done = batch("a", "batch_1", 101);
    done.set_status(BatchStatus::Completed, 5);
    assert_eq!(s.save_batch(&done, Some(&l2)).await.unwrap(), 1);
    s.release(&l2).await.unwrap();
    // batch_0 runs (l1): in progress, checkpointed at its epoch.
    let mut running = batch("a", "batch_0", 100);
    running.set_status(BatchStatus::InProgress, 3);
    assert_eq!(s.save_batch(&running, Some(&l1)).await.unwrap(), 1);
    let checkpoint = format!(r#"{{"epoch":{},"at":3}}"#, l1.epoch);
    assert!(s.save_checkpoint(&l1, &checkpoint).await.unwrap());
    assert_eq!(
        s.request_cancel("batch_3").await.unwrap(),
        CancelRequest::WasQueued
    );
    // batch_9 goes back to the queue unstarted: its lease lapses unsaved.
    s.release_lease(&l0).await.unwrap();
    s.forget_running("batch_9").await.unwrap();
    let before = view(&s).await;
    s.mark_state().await.unwrap();

    assert_eq!(redis.command(&["FLUSHALL"]), "+OK");
    assert_eq!(s.state_generation().await.unwrap(), None);
    assert!(s.lock_rebuild("me", ttl).await.unwrap());
    assert!(!s.lock_rebuild("other", ttl).await.unwrap());
    let report = s.rebuild(&storage).await.unwrap();
    s.unlock_rebuild("me").await.unwrap();
    assert_eq!(
        report,
        RebuildReport {
            files: 3,
            batches: 6,
            finished: 1,
            queued: 4,
            resumed: 1,
            cancelling: 1,
            present: 0,
            unreadable: 0,
        }
    );
    // batch_9, claimed but never saved under its lease, counts as unstarted: queued again.
    assert_eq!(view(&s).await, before);
    assert!(s.cancel_requested("batch_3").await.unwrap());
    // The running one waits, unleased, to be adopted with its checkpoint and a newer epoch.
    assert_eq!(
        s.running().await.unwrap().keys().collect::<Vec<_>>(),
        ["batch_0"]
    );
    assert_eq!(s.checkpoint("batch_0").await.unwrap(), Some(checkpoint));
    let adopted = s.adopt("batch_0", "r1", ttl).await.unwrap().unwrap();
    assert!(adopted.epoch > l1.epoch, "{adopted:?} after {l1:?}");
    assert!(
        !s.hold(&l1, ttl).await.unwrap(),
        "the old holder passes no fence"
    );
    // The queue in deadline order, the cancelled one on the cancel queue.
    let order: Vec<String> = [
        s.claim_queued("r1", ttl, &SlotShare::default())
            .await
            .unwrap(),
        s.claim_queued("r1", ttl, &SlotShare::default())
            .await
            .unwrap(),
        s.claim_queued("r1", ttl, &SlotShare::default())
            .await
            .unwrap(),
        s.claim_queued("r1", ttl, &SlotShare::default())
            .await
            .unwrap(),
    ]
    .into_iter()
    .map(|l| l.map(|l| l.job).unwrap_or_default())
    .collect();
    assert_eq!(order, ["batch_9", "batch_2", "batch_4", ""]);
    let cancelled = s.claim_cancelled("r1", ttl).await.unwrap().unwrap();
    assert_eq!(cancelled.job, "batch_3");
    // Again: every record is there already.
    let again = s.rebuild(&storage).await.unwrap();
    assert_eq!((again.batches, again.files, again.present), (0, 0, 9));
}

/// Batch `id`'s record as the version before the flat record stored it: the API's Batch object
/// under `batch`, the service's fields beside it.
fn earlier_record(id: &str, status: &str) -> serde_json::Value {
    json!({
        "tenant": "a",
        "batch": {
            "id": id,
            "object": "batch",
            "endpoint": "/v1/chat/completions",
            "errors": null,
            "input_file_id": "file-x",
            "completion_window": "24h",
            "status": status,
            "output_file_id": null,
            "error_file_id": null,
            "created_at": 1,
            "in_progress_at": 2,
            "expires_at": 100,
            "finalizing_at": null,
            "completed_at": null,
            "failed_at": null,
            "expired_at": null,
            "cancelling_at": null,
            "cancelled_at": null,
            "request_counts": {"total": 4, "completed": 1, "failed": 0},
            "metadata": {"k": "v"},
            "model": "m",
            "usage": null,
            "x_request_counts": {
                "processing": 3, "succeeded": 1, "errored": 0, "cancelled": 0, "expired": 0
            }
        },
        "window_secs": 86_400,
        "output_expires_after": 3600,
        "headers": {"x-team": "blue"}
    })
}

/// What [`earlier_record`] reads as.
fn earlier_read(id: &str) -> StoredBatch {
    let mut b = StoredBatch::new(id, "a", "file-x", "24h", 86_400, 1, 100);
    b.status = BatchStatus::InProgress;
    b.endpoint = Some("/v1/chat/completions".into());
    b.output_expires_after = Some(3600);
    b.metadata.insert("k".into(), "v".into());
    b.headers.insert("x-team".into(), "blue".into());
    b.model = Some("m".into());
    b.times.in_progress = Some(2);
    b.counts = Counts {
        total: 4,
        completed: 1,
        failed: 0,
    };
    b.fine_counts = FineCounts {
        processing: 3,
        succeeded: 1,
        ..FineCounts::default()
    };
    b
}

#[test]
fn the_api_view_of_a_record_is_the_batch_object_stored_before() {
    let old = earlier_record("batch_1", "in_progress");
    let read = StoredBatch::from_json(&old.to_string()).unwrap();
    assert_eq!(read, earlier_read("batch_1"));
    assert_eq!(serde_json::to_value(read.view()).unwrap(), old["batch"]);
    // Written again flat, with the status at the top (where the scripts read it).
    let flat = serde_json::to_value(&read).unwrap();
    assert_eq!(flat["status"], "in_progress");
    assert_eq!(flat["input_file_id"], "file-x");
    assert!(flat.get("batch").is_none(), "{flat}");
    assert_eq!(StoredBatch::from_json(&flat.to_string()).unwrap(), read);
    // Neither shape: the flat shape's complaint.
    let bad = StoredBatch::from_json(r#"{"tenant": "a"}"#).unwrap_err();
    assert!(bad.to_string().contains("missing field `id`"), "{bad}");
}

#[tokio::test]
async fn a_record_stored_in_the_earlier_shape_is_read_saved_and_fanned_out() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    let keys = s.keys().clone();
    let lease = created_and_claimed(&s, "batch_1").await;
    let mut running = s.batch("batch_1").await.unwrap().unwrap();
    running.apply(Change::Running {
        status: BatchStatus::InProgress,
        counts: Default::default(),
    });
    assert_eq!(s.save_batch(&running, Some(&lease)).await.unwrap(), 1);
    // The previous version wrote the record (and a webhook endpoint wants its end).
    let old = earlier_record("batch_1", "in_progress").to_string();
    assert_eq!(redis.command(&["SET", &keys.batch("batch_1"), &old]), "+OK");
    let endpoint = StoredWebhook {
        tenant: "a".into(),
        endpoint: WebhookEndpoint {
            id: "we_1".into(),
            object: "webhook_endpoint".into(),
            created_at: 1,
            updated_at: None,
            name: None,
            url: "https://example.invalid/hook".into(),
            event_types: vec!["batch.completed".into()],
            status: "enabled".into(),
            signing_secret_hint: "wh…1".into(),
        },
    };
    assert!(s.create_webhook(&endpoint, "whsec_1", 10).await.unwrap());

    let mut record = s.batch("batch_1").await.unwrap().unwrap();
    assert_eq!(record, earlier_read("batch_1"));
    let page = s.list_batches("a", None, 10).await.unwrap();
    assert_eq!(page.data, [record.clone()]);
    // Its end is saved over it: the script read the status where the old record had it.
    let mut done = Batch::new("batch_1", "file-x", "24h", 1, 100);
    done.set_status(BatchStatus::Completed, 7);
    done.request_counts = batch_wire::RequestCounts {
        total: 4,
        completed: 4,
        failed: 0,
    };
    let ended = Change::Ended {
        batch: &done,
        output_file_id: Some("file-out"),
        error_file_id: None,
        usage: Usage::default(),
        cancelled: 0,
        expired: 0,
    };
    assert_eq!(
        s.advance(&mut record, ended, Some(&lease)).await.unwrap(),
        Advance::Saved
    );
    let counts = s.status_counts().await.unwrap();
    assert_eq!(
        (counts.get("in_progress"), counts.get("completed")),
        (Some(&0), Some(&1))
    );
    assert_eq!(s.unfinished("a").await.unwrap(), 0);
    let stored = redis.command(&["GET", &keys.batch("batch_1")]);
    let stored: serde_json::Value = serde_json::from_str(&stored).unwrap();
    assert_eq!(stored["status"], "completed", "{stored}");

    // A record of the earlier shape that ended is fanned out to its tenant's endpoints.
    let old = earlier_record("batch_2", "completed").to_string();
    assert_eq!(redis.command(&["SET", &keys.batch("batch_2"), &old]), "+OK");
    assert_eq!(
        redis.command(&["DEL", &keys.webhook_ended()]),
        ":1",
        "batch_1's end was queued for the webhooks"
    );
    assert_eq!(
        redis.command(&["RPUSH", &keys.webhook_ended(), "batch_2"]),
        ":1"
    );
    assert!(s.fan_out_webhook_events(1_000).await.unwrap());
    let (id, delivery) = s.claim_webhook_delivery(2_000, TTL).await.unwrap().unwrap();
    assert_eq!(id, "a/batch_2:we_1");
    let delivery = delivery.unwrap();
    assert_eq!(
        (delivery.kind.as_str(), delivery.batch.as_str()),
        ("batch.completed", "batch_2")
    );
}

#[tokio::test]
async fn a_storage_copy_in_the_earlier_shape_is_rebuilt() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    let dir = tempfile::tempdir().unwrap();
    let storage =
        batch_storage::Storage::from_url(&format!("file://{}", dir.path().display())).unwrap();
    let copy = json!({"epoch": 2, "record": earlier_record("batch_1", "in_progress")});
    storage
        .put_bytes(
            &layout::batch_copy("batch_1"),
            bytes::Bytes::from(copy.to_string()),
        )
        .await
        .unwrap();
    let report = s.rebuild(&storage).await.unwrap();
    assert_eq!(
        (report.batches, report.resumed, report.unreadable),
        (1, 1, 0)
    );
    assert_eq!(
        s.batch("batch_1").await.unwrap(),
        Some(earlier_read("batch_1"))
    );
    assert_eq!(
        s.running().await.unwrap().keys().collect::<Vec<_>>(),
        ["batch_1"]
    );
    // Adopted above the epoch that wrote the copy.
    let adopted = s.adopt("batch_1", "r1", TTL).await.unwrap().unwrap();
    assert!(adopted.epoch > 2, "{adopted:?}");
}

/// A delivery of `tenant`'s batch to endpoint `endpoint`, never tried.
fn delivery(batch: &str, endpoint: &str) -> Delivery {
    Delivery {
        event_id: format!("evt_{batch}"),
        endpoint: endpoint.into(),
        kind: "batch.completed".into(),
        batch: batch.into(),
        created_at: 1,
        attempt: 0,
    }
}

/// Tenant B's delivery is claimed at the next turn beside tenant A's 1,100 more overdue ones
/// (when every tenant's sat in one set, a claim weighed the 1,024 most overdue: B waited for A's
/// to drain), and A still gets every other turn; a tenant left with nothing due is no longer
/// weighed.
#[tokio::test]
async fn each_tenant_gets_its_turn_however_many_deliveries_another_has_due() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    let keys = s.keys().clone();
    for i in 0..1_100u64 {
        let id = format!("a/batch_{i}:we_a");
        let d = delivery(&format!("batch_{i}"), "we_a");
        s.retry_webhook_delivery(&id, &d, i).await.unwrap();
    }
    let b = delivery("batch_b", "we_b");
    s.retry_webhook_delivery("b/batch_b:we_b", &b, 5_000)
        .await
        .unwrap();
    let mut claimed = Vec::new();
    for now in 10_000..10_004 {
        let (id, d) = s.claim_webhook_delivery(now, TTL).await.unwrap().unwrap();
        assert_eq!(
            d.expect("its record").endpoint,
            id.rsplit(':').next().unwrap()
        );
        claimed.push(id);
    }
    // Both unserved: the most overdue of all first; then B, served never; then A's alone.
    assert_eq!(
        claimed,
        [
            "a/batch_0:we_a",
            "b/batch_b:we_b",
            "a/batch_1:we_a",
            "a/batch_2:we_a"
        ]
    );
    s.finish_webhook_delivery("b/batch_b:we_b").await.unwrap();
    assert_eq!(
        redis.command(&["SISMEMBER", &keys.webhook_due_tenants(), "b"]),
        ":1"
    );
    s.claim_webhook_delivery(10_010, TTL)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        redis.command(&["SISMEMBER", &keys.webhook_due_tenants(), "b"]),
        ":0",
        "a tenant with nothing due is dropped from the claim's"
    );
}

/// A delivery an earlier version queued in the shared due set is claimed beside the tenants'
/// own, moves to its tenant's set at its retry, and leaves both when it ends.
#[tokio::test]
async fn a_delivery_queued_by_an_earlier_version_is_claimed_and_moves_to_its_tenants_set() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    let keys = s.keys().clone();
    let old = delivery("batch_9", "we_c");
    let member = "c/batch_9:we_c";
    assert_eq!(
        redis.command(&["ZADD", &keys.webhook_due(), "1", member]),
        ":1"
    );
    let json = serde_json::to_string(&old).unwrap();
    assert_eq!(
        redis.command(&["SET", &keys.webhook_delivery(member), &json]),
        "+OK"
    );
    let (id, d) = s.claim_webhook_delivery(2_000, TTL).await.unwrap().unwrap();
    assert_eq!((id.as_str(), d), (member, Some(old.clone())));
    let tried = Delivery { attempt: 1, ..old };
    s.retry_webhook_delivery(member, &tried, 3_000)
        .await
        .unwrap();
    assert_eq!(
        redis.command(&["ZSCORE", &keys.webhook_due(), member]),
        "(nil)"
    );
    assert_eq!(
        redis.command(&["ZSCORE", &keys.webhook_due_of("c"), member]),
        "3000"
    );
    assert!(s
        .claim_webhook_delivery(2_999, TTL)
        .await
        .unwrap()
        .is_none());
    let (id, d) = s.claim_webhook_delivery(3_000, TTL).await.unwrap().unwrap();
    assert_eq!((id.as_str(), d), (member, Some(tried)));
    s.finish_webhook_delivery(member).await.unwrap();
    assert_eq!(redis.command(&["ZCARD", &keys.webhook_due_of("c")]), ":0");
    assert!(s
        .claim_webhook_delivery(100_000, TTL)
        .await
        .unwrap()
        .is_none());
}

/// Endpoint `n` of tenant `a`, wanting `batch.completed`.
fn endpoint(n: usize) -> StoredWebhook {
    StoredWebhook {
        tenant: "a".into(),
        endpoint: WebhookEndpoint {
            id: format!("we_{n:04}"),
            object: "webhook_endpoint".into(),
            created_at: n as i64,
            updated_at: None,
            name: None,
            url: format!("https://example.invalid/hook/{n}"),
            event_types: vec!["batch.completed".into()],
            status: "enabled".into(),
            signing_secret_hint: "wh…1".into(),
        },
    }
}

/// A tenant with 150 endpoints (past the 64 a fan-out script handles at once): its listing
/// pages by id and by offset, and a batch's end queues one delivery per endpoint, each once,
/// the batch leaving the ended list only with the last chunk.
#[tokio::test]
async fn a_tenant_with_many_endpoints_is_listed_and_fanned_out_in_pages() {
    let redis = RedisServer::start();
    let s = store(&redis).await;
    let keys = s.keys().clone();
    for n in 0..150 {
        assert!(s
            .create_webhook(&endpoint(n), "whsec_1", 1_000)
            .await
            .unwrap());
    }
    let first = s.list_webhooks_page("a", None, 100).await.unwrap();
    assert_eq!((first.data.len(), first.has_more), (100, true));
    assert_eq!(first.data[99].endpoint.id, "we_0099");
    let after = Cursor::Id("we_0099".into());
    let rest = s.list_webhooks_page("a", Some(&after), 100).await.unwrap();
    assert_eq!((rest.data.len(), rest.has_more), (50, false));
    assert_eq!(rest.data[0].endpoint.id, "we_0100");
    let skipped = s
        .list_webhooks_page("a", Some(&Cursor::Offset(140)), 5)
        .await
        .unwrap();
    let ids: Vec<_> = skipped
        .data
        .iter()
        .map(|w| w.endpoint.id.as_str())
        .collect();
    assert_eq!(
        (ids, skipped.has_more),
        (
            vec!["we_0140", "we_0141", "we_0142", "we_0143", "we_0144"],
            true
        )
    );
    assert!(matches!(
        s.list_webhooks_page("a", Some(&Cursor::Id("we_gone".into())), 5)
            .await,
        Err(StoreError::UnknownCursor(_))
    ));

    let ended = earlier_record("batch_2", "completed").to_string();
    assert_eq!(
        redis.command(&["SET", &keys.batch("batch_2"), &ended]),
        "+OK"
    );
    assert_eq!(
        redis.command(&["RPUSH", &keys.webhook_ended(), "batch_2"]),
        ":1"
    );
    assert!(s.fan_out_webhook_events(1_000).await.unwrap());
    assert_eq!(redis.command(&["ZCARD", &keys.webhook_due_of("a")]), ":150");
    assert_eq!(redis.command(&["LLEN", &keys.webhook_ended()]), ":0");
    assert!(!s.fan_out_webhook_events(1_000).await.unwrap());
    // Done again (a replica that died after its first chunks), it queues nothing twice.
    assert_eq!(
        redis.command(&["RPUSH", &keys.webhook_ended(), "batch_2"]),
        ":1"
    );
    assert!(s.fan_out_webhook_events(2_000).await.unwrap());
    assert_eq!(redis.command(&["ZCARD", &keys.webhook_due_of("a")]), ":150");
    assert_eq!(
        redis.command(&["ZSCORE", &keys.webhook_due_of("a"), "a/batch_2:we_0149"]),
        "1000"
    );
}
