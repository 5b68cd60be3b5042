//! Helpers for the gateway's integration tests: plain HTTP and polling, from the shared test kit.
#![allow(unused_imports)]

pub use batch_testkit::http::{eventually, get, post};
