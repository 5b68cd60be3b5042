//! The dispatcher simulator and its gateway, in the bench's process, for the scenarios that
//! send requests through them.

use std::time::Duration;

use dispatcher_sim::{
    Dispatcher, DispatcherConfig, DispatcherHandle, Gateway, GatewayConfig, GatewayHandle,
    QueueEntry,
};

use crate::inputs::POOL;
use crate::lab::Lab;
use crate::BenchError;

/// A simulated gateway on a free loopback port.
pub(crate) async fn gateway(config: GatewayConfig) -> Result<GatewayHandle, BenchError> {
    Ok(Gateway::start(([127, 0, 0, 1], 0).into(), config).await?)
}

/// A gateway and a simulated dispatcher sending the pool's requests to it.
pub(crate) struct Simulator {
    /// The gateway answering the requests.
    pub(crate) gateway: GatewayHandle,
    /// The dispatcher taking them from the lab's Redis.
    pub(crate) dispatcher: DispatcherHandle,
}

impl Simulator {
    /// An instant gateway and a dispatcher polling every 10 ms, up to 5,000 messages per poll,
    /// with 256 HTTP workers: as fast as the simulator goes.
    pub(crate) async fn fast(lab: &Lab) -> Result<Self, BenchError> {
        Self::new(lab, Duration::ZERO, 256).await
    }

    /// A gateway answering after `latency` and a dispatcher polling every 10 ms, up to 5,000
    /// messages per poll, with `concurrency` HTTP workers.
    pub(crate) async fn new(
        lab: &Lab,
        latency: Duration,
        concurrency: usize,
    ) -> Result<Self, BenchError> {
        let gateway = GatewayConfig {
            latency_fixed: latency,
            ..GatewayConfig::default()
        };
        Self::with(lab, gateway, 5_000, concurrency).await
    }

    /// A gateway of `gateway_config` and a dispatcher for the pool's queue, polling every 10 ms
    /// for up to `batch_size` messages, with `concurrency` HTTP workers, at time scale 0.01.
    pub(crate) async fn with(
        lab: &Lab,
        gateway_config: GatewayConfig,
        batch_size: usize,
        concurrency: usize,
    ) -> Result<Self, BenchError> {
        let gateway = gateway(gateway_config).await?;
        let mut queue = QueueEntry::new(batch_keys::request_queue_name(POOL)?);
        queue.igw_base_url = Some(gateway.base_url());
        queue.request_path_url = Some("/v1/chat/completions".into());
        let mut config = DispatcherConfig::new(lab.redis_url(), vec![queue]);
        config.poll_interval = Duration::from_millis(10);
        config.batch_size = batch_size;
        config.concurrency = concurrency;
        config.sim.time_scale = 0.01;
        match Dispatcher::start(config, None).await {
            Ok(dispatcher) => Ok(Self {
                gateway,
                dispatcher,
            }),
            Err(e) => {
                gateway.shutdown().await;
                Err(e.into())
            }
        }
    }

    /// Stops the dispatcher, then the gateway.
    pub(crate) async fn stop(self) {
        self.dispatcher.shutdown().await;
        self.gateway.shutdown().await;
    }
}
