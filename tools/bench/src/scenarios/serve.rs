//! `processor serve` through its HTTP API: a large upload against the disk, `GET
//! /v1/batches/{id}` under load, and many batches submitted at once through the simulator.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::simulator::Simulator;
use super::{blocking, Ctx};
use crate::inputs::write_input;
use crate::lab::{info, info_field, Lab};
use crate::report::{Kind, Report, Row, Target, Unit};
use crate::service::{
    create_batches, load_average, rss_mib, stop, upload_for_batches, wait_completed, Api,
    ServeSetup, Service,
};
use crate::stats::Summary;
use crate::BenchError;

const SERVE: &str = "Serve";
/// Bytes of one line of the upload (with its newline): 50,000 lines make 200 MB, so the file
/// is within both default limits (200 MiB, 50,000 lines).
const UPLOAD_LINE: usize = 4_000;
/// 100 MB, the RSS target.
const RSS_LIMIT_MIB: f64 = 100e6 / (1024.0 * 1024.0);
/// The upload must reach this share of the disk's write rate.
const UPLOAD_RATIO: f64 = 0.5;
/// Redis connections the service may hold while every batch runs: far below one per job.
const CONNECTION_LIMIT: f64 = 32.0;
/// `serve.state_prefix` of the services.
const STATE_PREFIX: &str = "bench-serve";
/// Requests sent at once while submitting the batches.
const SUBMITTERS: usize = 64;
/// How often the completion of the submitted batches is polled.
const POLL: Duration = Duration::from_millis(100);

/// One upload run.
struct Upload {
    disk_mbps: f64,
    upload_mbps: f64,
    hwm_mib: f64,
}

/// One run of many batches at once, and the GET load on them afterwards.
struct Fanout {
    submitted: f64,
    last_completed: f64,
    clients_before: u64,
    clients_max: u64,
    load: Load,
}

/// `GET /v1/batches/{id}` under load.
struct Load {
    rps: f64,
    p50: f64,
    p99: f64,
    requests: usize,
}

pub(crate) async fn run(cx: Ctx<'_>, report: &mut Report) -> Result<(), BenchError> {
    let Ctx { lab, s, .. } = cx;
    s.require_processor()?;
    let load_before = load_average();
    let big = lab.path("serve-upload.jsonl");
    let upload_lines = (s.serve_upload_bytes as usize / UPLOAD_LINE).max(1);
    let big_bytes = {
        let big = big.clone();
        blocking(move || write_input(&big, upload_lines, UPLOAD_LINE - 1)).await?
    };
    let small = lab.path("serve-batch.jsonl");
    write_input(&small, s.serve_batch_lines, s.request_bytes)?;
    lab.flush_redis().await?;
    let sim = Simulator::fast(lab).await?;
    let uploads = uploads(cx, &big, big_bytes).await;
    let _ = std::fs::remove_file(&big);
    let fanouts = match uploads {
        Ok(_) => fanouts(cx, &small).await,
        Err(_) => Ok(Vec::new()),
    };
    sim.stop().await;
    let (uploads, fanouts) = (uploads?, fanouts?);
    let load_after = load_average();

    let mb = big_bytes as f64 / 1e6;
    let col = |f: &dyn Fn(&Upload) -> f64| Summary::new(uploads.iter().map(f).collect());
    let disk = col(&|u| u.disk_mbps);
    report.rows.push(
        Row::new(
            SERVE,
            format!("upload of {mb:.0} MB: POST /v1/files, multipart streamed from disk"),
            Unit::PerSecond("MB/s"),
            col(&|u| u.upload_mbps),
        )
        .limit("write + fsync, same disk", disk.median())
        .target(Target::RatioAtLeast(UPLOAD_RATIO)),
    );
    report.rows.push(
        Row::new(
            SERVE,
            format!("write + fsync of the same {mb:.0} MB to the same disk"),
            Unit::PerSecond("MB/s"),
            disk,
        )
        .kind(Kind::Limit),
    );
    report.rows.push(
        Row::new(
            SERVE,
            "peak RSS of the service, start + upload (VmHWM)",
            Unit::MiB,
            col(&|u| u.hwm_mib),
        )
        .target(Target::AtMost(RSS_LIMIT_MIB)),
    );

    let n = s.serve_batches;
    let col = |f: &dyn Fn(&Fanout) -> f64| Summary::new(fanouts.iter().map(f).collect());
    let get = format!(
        "GET /v1/batches/{{id}}, {} clients, {} batches stored",
        s.serve_clients,
        super::lines(n)
    );
    report.rows.push(Row::new(
        SERVE,
        get.clone(),
        Unit::PerSecond("req/s"),
        col(&|f| f.load.rps),
    ));
    report.rows.push(Row::new(
        SERVE,
        format!("{get}: p50 latency"),
        Unit::Seconds,
        col(&|f| f.load.p50),
    ));
    report.rows.push(Row::new(
        SERVE,
        format!("{get}: p99 latency"),
        Unit::Seconds,
        col(&|f| f.load.p99),
    ));
    let fan = format!(
        "{} batches of {} lines at once",
        super::lines(n),
        s.serve_batch_lines
    );
    report.rows.push(Row::new(
        SERVE,
        format!("{fan}: first POST → last batch completed"),
        Unit::Seconds,
        col(&|f| f.last_completed),
    ));
    report.rows.push(Row::new(
        SERVE,
        format!("{fan}: first → last POST /v1/batches answered"),
        Unit::Seconds,
        col(&|f| f.submitted),
    ));
    report.rows.push(Row::new(
        SERVE,
        format!("{fan}: requests through the service"),
        Unit::PerSecond("req/s"),
        col(&|f| (n * s.serve_batch_lines) as f64 / f.last_completed),
    ));
    report.rows.push(
        Row::new(
            SERVE,
            format!("{fan}: Redis connections of the service, max"),
            Unit::Count,
            col(&|f| f.clients_max.saturating_sub(f.clients_before) as f64),
        )
        .target(Target::AtMost(CONNECTION_LIMIT)),
    );

    report.note(SERVE, format!(
        "`processor serve` ({}) as a child process, async mode, against the same redis-server and the in-process dispatcher simulator with its instant gateway (as in End to end async); every run starts a fresh service with empty storage and stops it with SIGTERM. The bench's client (hyper-util, keep-alive) shares the machine's cores with the service.",
        s.processor.display()
    ));
    report.note(SERVE, format!(
        "Upload: a {mb:.0} MB file of {} lines of {UPLOAD_LINE} B (within the default limits of 200 MiB and 50,000 lines), sent as one multipart request read from disk in chunks of 256 KiB (the client never holds it), timed until the File object comes back. The limit is the same bytes copied from that file to a new file on the same disk plus fsync, in the same run, just before each upload. Peak RSS is the service's VmHWM from /proc/<pid>/status after the upload: its peak over its whole life until then, start-up included. The target of 100 MB is {RSS_LIMIT_MIB:.1} MiB. The service answers once its storage has the bytes; its local storage (object_store's LocalFileSystem) does not fsync them, so its rate is not bounded by the fsync the limit includes.",
        super::lines(upload_lines)
    ));
    report.note(SERVE, format!(
        "Many batches: one input file of {} lines of {} B uploaded once and named by {} batches (`completion_window` 24h), {SUBMITTERS} POST /v1/batches in flight at a time, with `serve.max_active_jobs` {} so every job runs at once. Completion is polled every {} ms through GET /v1/batches (cursor pages of 100); each batch must complete with every line a success. Redis connections: the largest `connected_clients` of INFO clients, sampled every 50 ms from before the service starts until its last batch completes, less the connections open before it started (the bench's own and the simulator's).",
        s.serve_batch_lines, s.request_bytes, super::lines(n), n, POLL.as_millis()
    ));
    report.note(SERVE, format!(
        "GET load: right after the batches completed (so exactly {} batches stored), {} clients each sending GET /v1/batches/{{id}} over the batches in turn, one request at a time, for {:.0} s after a warm-up of {:.1} s; requests per second and the latency of each request ({} requests per run, median run).",
        super::lines(n), s.serve_clients, s.serve_load.as_secs_f64(), warm_up(s).as_secs_f64(),
        super::lines(fanouts.get(Summary::new(fanouts.iter().map(|f| f.load.rps).collect()).median_run().unwrap_or(0)).map_or(0, |f| f.load.requests)),
    ));
    report.note(SERVE, format!(
        "The other load on this machine counts here more than elsewhere (several processes share its cores): the 1-minute load average was {load_before} when the scenario started and {load_after} when it ended, on {} cores.",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    Ok(())
}

fn warm_up(s: &crate::Settings) -> Duration {
    (s.serve_load / 10).min(Duration::from_millis(500))
}

/// The directory of one service's work files and storage.
fn service_dir(lab: &Lab, name: &str) -> Result<PathBuf, BenchError> {
    lab.fresh_dir(&format!("serve-{name}"))
}

/// Starts a service in `dir`, its storage in `dir/storage`.
async fn start(
    lab: &Lab,
    s: &crate::Settings,
    dir: &Path,
    max_active_jobs: usize,
) -> Result<Service, BenchError> {
    ServeSetup::new(dir, max_active_jobs, STATE_PREFIX)
        .start(lab, &s.processor)
        .await
}

async fn uploads(cx: Ctx<'_>, big: &Path, bytes: u64) -> Result<Vec<Upload>, BenchError> {
    let Ctx { lab, s, progress } = cx;
    let mut runs = Vec::new();
    for run in 0..s.short_runs {
        let dir = service_dir(lab, &format!("upload-{run}"))?;
        let disk_secs = {
            let (from, to) = (big.to_owned(), dir.join("disk-copy"));
            blocking(move || copy_and_sync(&from, &to)).await?
        };
        let service = start(lab, s, &dir, 16).await?;
        let api = Api::new(service.base(), 4);
        let started = Instant::now();
        let file = api
            .upload(big, Duration::from_secs(600 + bytes / 1_000_000))
            .await;
        let upload_secs = started.elapsed().as_secs_f64();
        let hwm = rss_mib(service.pid()).map_or(f64::NAN, |(_, hwm)| hwm);
        let file = file?;
        if file["bytes"].as_u64().is_some_and(|b| b != bytes) {
            return Err(BenchError::Check(format!(
                "POST /v1/files stored {} bytes of {bytes}",
                file["bytes"]
            )));
        }
        let id = file["id"].as_str().unwrap_or_default().to_owned();
        api.delete(&format!("/v1/files/{id}"))
            .await?
            .json(&format!("DELETE /v1/files/{id}"))?;
        stop(service).await?;
        let _ = std::fs::remove_dir_all(&dir);
        let u = Upload {
            disk_mbps: bytes as f64 / 1e6 / disk_secs,
            upload_mbps: bytes as f64 / 1e6 / upload_secs,
            hwm_mib: hwm,
        };
        progress(&format!(
            "   upload run {run}: {:.0} MB/s (disk {:.0} MB/s), peak RSS {:.1} MiB",
            u.upload_mbps, u.disk_mbps, u.hwm_mib
        ));
        runs.push(u);
    }
    Ok(runs)
}

/// Copies `from` to a new file `to` and fsyncs it; the seconds it took. Removes `to`.
fn copy_and_sync(from: &Path, to: &Path) -> Result<f64, BenchError> {
    let mut input = std::fs::File::open(from).map_err(|e| BenchError::io(from, e))?;
    let started = Instant::now();
    let mut output = std::fs::File::create(to).map_err(|e| BenchError::io(to, e))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = input.read(&mut buf).map_err(|e| BenchError::io(from, e))?;
        if n == 0 {
            break;
        }
        output
            .write_all(&buf[..n])
            .map_err(|e| BenchError::io(to, e))?;
    }
    output.sync_all().map_err(|e| BenchError::io(to, e))?;
    let secs = started.elapsed().as_secs_f64();
    drop(output);
    std::fs::remove_file(to).map_err(|e| BenchError::io(to, e))?;
    Ok(secs)
}

async fn fanouts(cx: Ctx<'_>, input: &Path) -> Result<Vec<Fanout>, BenchError> {
    let Ctx { lab, s, progress } = cx;
    let mut runs = Vec::new();
    for run in 0..s.long_runs {
        lab.flush_redis().await?;
        let dir = service_dir(lab, &format!("fanout-{run}"))?;
        let clients_before = connected_clients(lab).await?;
        let sampling = CancellationToken::new();
        let sampler = tokio::spawn(sample_clients(lab.client().clone(), sampling.clone()));
        let service = start(lab, s, &dir, s.serve_batches).await;
        let measured = match &service {
            Ok(service) => fanout(s, service, input).await,
            Err(_) => Ok((0.0, 0.0, Vec::new())),
        };
        sampling.cancel();
        let clients_max = sampler.await.unwrap_or(Ok(0))?;
        let service = service?;
        let (submitted, last_completed, ids) = measured?;
        let api = Api::new(service.base(), s.serve_clients);
        let load = get_load(&api, ids, s).await?;
        stop(service).await?;
        let _ = std::fs::remove_dir_all(&dir);
        progress(&format!(
            "   batches run {run}: {} batches submitted in {submitted:.2} s, last completed at {last_completed:.2} s, Redis connections {clients_before} → max {clients_max}; GET: {:.0} req/s, p50 {:.2} ms, p99 {:.2} ms",
            super::lines(s.serve_batches), load.rps, load.p50 * 1e3, load.p99 * 1e3
        ));
        runs.push(Fanout {
            submitted,
            last_completed,
            clients_before,
            clients_max,
            load,
        });
    }
    Ok(runs)
}

/// Submits the batches and waits for them: (seconds until the last was accepted, seconds
/// until the last completed, the batch ids).
async fn fanout(
    s: &crate::Settings,
    service: &Service,
    input: &Path,
) -> Result<(f64, f64, Vec<String>), BenchError> {
    let api = Api::new(service.base(), SUBMITTERS);
    let body = upload_for_batches(&api, input).await?;
    let started = Instant::now();
    let ids = create_batches(
        std::slice::from_ref(&api),
        &body,
        s.serve_batches,
        SUBMITTERS,
    )
    .await?;
    let submitted = started.elapsed().as_secs_f64();
    let limit = Duration::from_secs(300 + (s.serve_batches * s.serve_batch_lines) as u64 / 100);
    let last = wait_completed(&api, &ids, s.serve_batch_lines, started, POLL, limit).await?;
    Ok((submitted, last, ids))
}

/// `connected_clients` of INFO clients.
async fn connected_clients(lab: &Lab) -> Result<u64, BenchError> {
    clients_of(lab.client()).await
}

async fn clients_of(client: &fred::clients::Client) -> Result<u64, BenchError> {
    let info = info(client, "clients").await?;
    info_field(&info, "connected_clients:")
        .ok_or_else(|| BenchError::Check(format!("INFO clients without connected_clients: {info}")))
}

/// The largest `connected_clients` seen every 50 ms until `stop`.
async fn sample_clients(
    client: fred::clients::Client,
    stop: CancellationToken,
) -> Result<u64, BenchError> {
    let mut max = 0;
    loop {
        max = max.max(clients_of(&client).await?);
        tokio::select! {
            _ = stop.cancelled() => return Ok(max.max(clients_of(&client).await?)),
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
}

/// `s.serve_clients` clients sending `GET /v1/batches/{id}` over `ids` for `s.serve_load`.
async fn get_load(api: &Api, ids: Vec<String>, s: &crate::Settings) -> Result<Load, BenchError> {
    let ids = Arc::new(ids);
    let started = Instant::now();
    let warm = started + warm_up(s);
    let end = warm + s.serve_load;
    let mut tasks = Vec::new();
    for k in 0..s.serve_clients {
        let (api, ids) = (api.clone(), ids.clone());
        tasks.push(tokio::spawn(async move {
            // (started after the warm-up, latency, when it ended)
            let mut seen: Vec<(bool, f64, Instant)> = Vec::new();
            let mut i = k;
            while Instant::now() < end {
                let id = &ids[i % ids.len()];
                i += 7;
                let path = format!("/v1/batches/{id}");
                let t = Instant::now();
                let reply = api.get(&path).await?;
                let done = Instant::now();
                if reply.status != hyper::StatusCode::OK || !reply.body.starts_with(b"{") {
                    return Err(BenchError::Check(format!(
                        "GET {path} under load: {} {}",
                        reply.status,
                        String::from_utf8_lossy(&reply.body[..reply.body.len().min(300)])
                    )));
                }
                seen.push((t >= warm, (done - t).as_secs_f64(), done));
            }
            Ok::<_, BenchError>(seen)
        }));
    }
    let mut latencies = Vec::new();
    let mut last = warm;
    for task in tasks {
        let seen = task
            .await
            .map_err(|e| BenchError::Check(format!("a GET client failed: {e}")))??;
        for (measured, latency, done) in seen {
            if measured {
                latencies.push(latency);
                last = last.max(done);
            }
        }
    }
    if latencies.is_empty() {
        return Err(BenchError::Check(
            "no GET finished after the warm-up".into(),
        ));
    }
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| {
        latencies[((latencies.len() as f64 * q).ceil() as usize).clamp(1, latencies.len()) - 1]
    };
    Ok(Load {
        rps: latencies.len() as f64 / (last - warm).as_secs_f64(),
        p50: at(0.50),
        p99: at(0.99),
        requests: latencies.len(),
    })
}
