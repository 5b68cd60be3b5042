//! The executor's jobs end to end, in process: sync mode against the simulated gateway, async
//! mode against a real Redis and the simulated dispatcher (both releases, Redis Cluster and
//! Sentinel, injected faults). One test binary for them all: each costs a link.
//!
//! What needs the `processor` binary itself (signals, kill -9 and a rerun, several processes,
//! the CLI's output) stays in the workspace's `tests/`.

mod support;

mod async_mode;
mod dispatcher_versions;
mod faults;
mod sharing;
mod sync;
mod topologies;
