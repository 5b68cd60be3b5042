//! The service started in this process, and the usual start of a test: an env, the service of
//! one or two tenants, a tenant's client. The rest is `batch_testkit::e2e` (re-exported here).

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;

use batch_config::ProcessorConfig;
pub use batch_testkit::e2e::api::*;
pub use batch_testkit::e2e::tenants::*;
pub use batch_testkit::e2e::*;

/// A service running in this process, as `processor serve --config CONFIG --listen
/// 127.0.0.1:0` runs it. Its tasks end with the test's runtime.
pub struct Service {
    /// Held so that the service lives as long as the test holds this.
    _service: batch_service::Service,
    /// `http://127.0.0.1:PORT` (or `https://`).
    pub base: String,
}

impl Service {
    /// Loads the service config at `config` and starts the service on a free loopback port.
    pub async fn start(config: &Path) -> Service {
        let config = ProcessorConfig::load_service(config)
            .unwrap_or_else(|errors| panic!("the service config: {errors}"));
        let options = batch_service::ServiceOptions {
            listen: Some(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))),
            ..Default::default()
        };
        let service = batch_service::Service::start(config, options)
            .await
            .unwrap_or_else(|e| panic!("starting the service: {e}"));
        let scheme = if service.https() { "https" } else { "http" };
        let base = format!("{scheme}://{}", service.local_addr());
        Service {
            _service: service,
            base,
        }
    }

    /// A client sending `key` as its bearer token (none when `None`).
    pub fn client(&self, key: Option<&str>) -> Api {
        Api::new(&self.base, key)
    }
}

impl ServiceUnderTest for Service {
    async fn start_on(config: &Path) -> Self {
        Service::start(config).await
    }

    fn client_of(&self, key: Option<&str>) -> Api {
        self.client(key)
    }
}

batch_testkit::tenant_starts!(Service);
