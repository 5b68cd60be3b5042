//! The `processor serve` tests' usual start: an env, the binary serving one or two tenants, and
//! a tenant's client, on the helpers of `batch_testkit::e2e::tenants` (re-exported here).

use std::path::Path;

pub use batch_testkit::e2e::tenants::*;

use super::serve::{Api, Service};

impl ServiceUnderTest for Service {
    async fn start_on(config: &Path) -> Self {
        Service::start(config)
    }

    fn client_of(&self, key: Option<&str>) -> Api {
        self.client(key)
    }
}

batch_testkit::tenant_starts!(Service);
