//! A TCP proxy on loopback that injects network faults between a client and a server, for
//! the fault suites: the kinds of fault toxiproxy offers, in-process, with nothing to install.
//!
//! Each accepted connection is piped both ways to the upstream port; the proxy's current
//! [`Fault`] decides what happens to every chunk and connection from then on:
//!
//! - [`Fault::Latency`]: each chunk waits `base ± jitter` before it is passed on (order kept);
//! - [`Fault::Cut`]: every open connection is closed and new ones are reset at once, as when
//!   a link goes down (toxiproxy's disabled proxy);
//! - [`Fault::ResetPeer`]: every connection, open or new, is reset (RST) when it next carries
//!   data;
//! - [`Fault::Blackhole`]: data is accepted and held, nothing is passed on nor answered, until
//!   the fault changes: a partitioned link, where TCP keeps what it could not deliver (bytes
//!   dropped from the middle of a live stream would be no network's behaviour);
//! - [`Fault::HoldReplies`]: the same for the server's replies only, while requests pass;
//! - [`Fault::Slow`]: chunks are cut into `slice` bytes and passed on at `bytes_per_sec`
//!   (toxiproxy's `slicer` and `bandwidth` together).
//!
//! The proxy runs on a thread of its own, so it works under any test runtime and keeps
//! running while the test's runtime is busy. It stops when dropped.
//!
//! ```no_run
//! use std::time::Duration;
//! use batch_testkit::{Fault, FaultProxy, RedisServer};
//!
//! let redis = RedisServer::start();
//! let proxy = FaultProxy::start(redis.port());
//! // Clients connect to proxy.port(); then, for five seconds, the link is down:
//! proxy.set(Fault::Cut);
//! std::thread::sleep(Duration::from_secs(5));
//! proxy.set(Fault::None);
//! ```

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to the traffic it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fault {
    /// Passes everything on at once.
    #[default]
    None,
    /// Each chunk waits `base` plus a uniform draw in `[-jitter, +jitter]`.
    Latency {
        /// Mean delay.
        base: Duration,
        /// Half-width of the spread around it.
        jitter: Duration,
    },
    /// The link is down: open connections are closed, new ones reset.
    Cut,
    /// Every connection is reset (RST) when it next carries data.
    ResetPeer,
    /// Data is taken and held until the fault changes; nothing comes back meanwhile.
    Blackhole,
    /// Requests pass, replies are held until the fault changes: an asymmetric partition, where
    /// the server acts on what the client sends while the client hears nothing.
    HoldReplies,
    /// Chunks cut into `slice` bytes, passed on at `bytes_per_sec`.
    Slow {
        /// Bytes per piece.
        slice: usize,
        /// Rate of each direction of each connection.
        bytes_per_sec: u64,
    },
}

/// A fault-injecting TCP proxy on 127.0.0.1; see the module documentation.
pub struct FaultProxy {
    port: u16,
    fault: watch::Sender<Fault>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    stats: Arc<Mutex<ProxyStats>>,
}

/// What the proxy has carried.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Connections accepted.
    pub connections: u64,
    /// Connections closed or reset by a fault.
    pub broken: u64,
}

impl FaultProxy {
    /// A proxy to `127.0.0.1:upstream` on a free loopback port, passing everything on.
    pub fn start(upstream: u16) -> FaultProxy {
        let (fault, watched) = watch::channel(Fault::None);
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let (ready, port) = std::sync::mpsc::channel();
        let stats = Arc::new(Mutex::new(ProxyStats::default()));
        let counted = stats.clone();
        let thread = std::thread::Builder::new()
            .name(format!("fault-proxy-{upstream}"))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for the proxy");
                runtime.block_on(async move {
                    let listener = TcpListener::bind(("127.0.0.1", 0))
                        .await
                        .expect("a loopback port for the proxy");
                    let _ = ready.send(listener.local_addr().expect("bound").port());
                    tokio::select! {
                        _ = stopped => {}
                        _ = serve(listener, upstream, watched, counted) => {}
                    }
                });
            })
            .expect("a thread for the proxy");
        let port = port.recv().expect("the proxy's port");
        FaultProxy {
            port,
            fault,
            stop: Some(stop),
            thread: Some(thread),
            stats,
        }
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>`: a Redis URL through the proxy.
    pub fn redis_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Applies `fault` from now on, to open connections as to new ones.
    pub fn set(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// The fault in force.
    pub fn fault(&self) -> Fault {
        *self.fault.borrow()
    }

    /// What it has carried so far.
    pub fn stats(&self) -> ProxyStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve(
    listener: TcpListener,
    upstream: u16,
    fault: watch::Receiver<Fault>,
    stats: Arc<Mutex<ProxyStats>>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        stats.lock().unwrap_or_else(|e| e.into_inner()).connections += 1;
        let now = *fault.borrow();
        if matches!(now, Fault::Cut | Fault::ResetPeer) {
            reset(client);
            broke(&stats);
            continue;
        }
        let fault = fault.clone();
        let stats = stats.clone();
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                reset(client);
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            connection(client, server, fault, stats).await;
        });
    }
}

/// Pipes one connection both ways until either side closes or a fault breaks it.
async fn connection(
    client: TcpStream,
    server: TcpStream,
    fault: watch::Receiver<Fault>,
    stats: Arc<Mutex<ProxyStats>>,
) {
    use std::os::fd::AsRawFd;
    let fds = [client.as_raw_fd(), server.as_raw_fd()];
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pipe(client_read, server_write, fault.clone(), fds, false);
    let down = pipe(server_read, client_write, fault.clone(), fds, true);
    let mut watch = fault;
    let broken = async move {
        // A cut closes what is open; a reset waits for data (the pipes see to it).
        loop {
            if *watch.borrow_and_update() == Fault::Cut {
                return;
            }
            if watch.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    };
    let outcome = tokio::select! {
        r = up => r,
        r = down => r,
        _ = broken => Ended::Broken,
    };
    if let Ended::Broken = outcome {
        broke(&stats);
    }
}

/// How one direction of a connection ended.
enum Ended {
    /// A side closed or failed.
    Closed,
    /// A fault broke it.
    Broken,
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    fault: watch::Receiver<Fault>,
    fds: [std::os::fd::RawFd; 2],
    replies: bool,
) -> Ended {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return Ended::Closed,
            Ok(n) => n,
        };
        let chunk = &buf[..n];
        let mut watch = fault.clone();
        let mut now = *watch.borrow_and_update();
        while now == Fault::Blackhole || (replies && now == Fault::HoldReplies) {
            // Held, as TCP holds what a partitioned link cannot carry, until the fault changes.
            if watch.changed().await.is_err() {
                return Ended::Closed;
            }
            now = *watch.borrow_and_update();
        }
        let sent = match now {
            Fault::None | Fault::Blackhole | Fault::HoldReplies => to.write_all(chunk).await,
            Fault::Latency { base, jitter } => {
                tokio::time::sleep(spread(base, jitter)).await;
                to.write_all(chunk).await
            }
            Fault::Cut => return Ended::Broken,
            Fault::ResetPeer => {
                // Both sockets are still open here (the halves live until this returns).
                fds.into_iter().for_each(linger_zero);
                return Ended::Broken;
            }
            Fault::Slow {
                slice,
                bytes_per_sec,
            } => slowly(&mut to, chunk, slice.max(1), bytes_per_sec.max(1)).await,
        };
        if sent.is_err() {
            return Ended::Closed;
        }
    }
}

async fn slowly(
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    chunk: &[u8],
    slice: usize,
    bytes_per_sec: u64,
) -> std::io::Result<()> {
    for piece in chunk.chunks(slice) {
        let wait = Duration::from_secs_f64(piece.len() as f64 / bytes_per_sec as f64);
        tokio::time::sleep(wait).await;
        to.write_all(piece).await?;
    }
    Ok(())
}

/// `base ± jitter`, uniform, never below zero.
fn spread(base: Duration, jitter: Duration) -> Duration {
    if jitter.is_zero() {
        return base;
    }
    let draw = rand_unit() * 2.0 - 1.0;
    Duration::from_secs_f64((base.as_secs_f64() + draw * jitter.as_secs_f64()).max(0.0))
}

/// A cheap uniform draw in [0, 1): the spread of a test's latency needs no better.
fn rand_unit() -> f64 {
    use std::cell::Cell;
    use std::hash::{BuildHasher, Hasher};
    thread_local! {
        static STATE: Cell<u64> = Cell::new(
            std::collections::hash_map::RandomState::new().build_hasher().finish() | 1,
        );
    }
    STATE.with(|s| {
        // xorshift64
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        (x >> 11) as f64 / (1u64 << 53) as f64
    })
}

/// Closes `stream` with a reset (RST), not an orderly close: what a peer sees when the other
/// end's connection is torn down.
fn reset(stream: TcpStream) {
    use std::os::fd::AsRawFd;
    linger_zero(stream.as_raw_fd());
    drop(stream);
}

/// Makes the socket `fd` close with a reset.
fn linger_zero(fd: std::os::fd::RawFd) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: `fd` is an open socket owned by a live connection of the caller, and `linger`
    // is a valid option value of the size given.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

fn broke(stats: &Mutex<ProxyStats>) {
    stats.lock().unwrap_or_else(|e| e.into_inner()).broken += 1;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::Instant;

    /// An echo server on loopback, for the proxy to carry.
    fn echo() -> u16 {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = stream.read(&mut buf) {
                        if n == 0 || stream.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        port
    }

    fn round_trip(port: u16, timeout: Duration) -> std::io::Result<Vec<u8>> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(timeout))?;
        s.write_all(b"ping")?;
        let mut got = [0u8; 4];
        s.read_exact(&mut got)?;
        Ok(got.to_vec())
    }

    #[test]
    fn carries_delays_cuts_and_blackholes() {
        let proxy = FaultProxy::start(echo());
        let long = Duration::from_secs(5);
        assert_eq!(round_trip(proxy.port(), long).unwrap(), b"ping");

        proxy.set(Fault::Latency {
            base: Duration::from_millis(150),
            jitter: Duration::from_millis(50),
        });
        let t = Instant::now();
        assert_eq!(round_trip(proxy.port(), long).unwrap(), b"ping");
        assert!(
            t.elapsed() >= Duration::from_millis(200),
            "both ways delayed"
        );

        let mut open = std::net::TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
        proxy.set(Fault::Cut);
        std::thread::sleep(Duration::from_millis(100));
        open.set_read_timeout(Some(long)).unwrap();
        let mut buf = [0u8; 1];
        assert!(
            matches!(open.read(&mut buf), Ok(0) | Err(_)),
            "an open connection is closed by a cut"
        );
        assert!(round_trip(proxy.port(), long).is_err(), "a new one fails");

        proxy.set(Fault::Blackhole);
        let err = round_trip(proxy.port(), Duration::from_millis(300)).unwrap_err();
        assert!(
            matches!(
                err.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "nothing comes back: {err}"
        );
        let mut held = std::net::TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
        held.write_all(b"late").unwrap();
        std::thread::sleep(Duration::from_millis(100));
        proxy.set(Fault::None);
        held.set_read_timeout(Some(long)).unwrap();
        let mut got = [0u8; 4];
        held.read_exact(&mut got).unwrap();
        assert_eq!(
            &got, b"late",
            "what was held is delivered once the link heals"
        );

        // Replies held: the request reaches the server, the answer comes once it heals.
        let mut asked = std::net::TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
        proxy.set(Fault::HoldReplies);
        asked.write_all(b"half").unwrap();
        asked
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        assert!(asked.read(&mut got).is_err(), "no reply while held");
        proxy.set(Fault::None);
        asked.set_read_timeout(Some(long)).unwrap();
        asked.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"half");

        proxy.set(Fault::ResetPeer);
        assert!(round_trip(proxy.port(), long).is_err(), "reset");

        proxy.set(Fault::Slow {
            slice: 1,
            bytes_per_sec: 20,
        });
        let t = Instant::now();
        assert_eq!(round_trip(proxy.port(), long).unwrap(), b"ping");
        // 4 one-byte pieces at 20 B/s up; the echo comes back piece by piece behind them.
        assert!(
            t.elapsed() >= Duration::from_millis(240),
            "4 bytes at 20 B/s: {:?}",
            t.elapsed()
        );

        proxy.set(Fault::None);
        assert_eq!(round_trip(proxy.port(), long).unwrap(), b"ping");
        assert!(proxy.stats().broken >= 2);
    }
}
