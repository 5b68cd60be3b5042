//! The service's API in process: `batch_service::Service` started in this test binary on a
//! loopback port, against a real Redis, file storage and the simulated dispatcher, and driven
//! over HTTP as a client would. One test binary for them all: each costs a link.
//!
//! What needs the `processor serve` process itself (signals, kill -9 and a restart, several
//! replicas, its logs and memory, the metrics of one process) stays in the workspace's `tests/`.

mod support;

mod serve;
mod serve_edges;
