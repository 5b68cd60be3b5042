//! OpenTelemetry traces: `tracing` spans exported over OTLP (HTTP/protobuf), and the W3C
//! `traceparent` of a span, to carry a batch's trace to the inference gateway.
//!
//! Off unless configured: [`trace_layer`] gives a layer only when `observability.otlp_endpoint`
//! or one of the standard `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
//! variables is set, and not when `OTEL_SDK_DISABLED=true`. The other standard variables are
//! the SDK's own: `OTEL_SERVICE_NAME` (default `batch-processor`), `OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_EXPORTER_OTLP_[TRACES_]HEADERS` and `_TIMEOUT`,
//! `OTEL_BSP_*`. Without a layer, [`traceparent`] is `None` and nothing is sent.

use std::collections::HashMap;
use std::time::Duration;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::{OpenTelemetryLayer, OpenTelemetrySpanExt};
use tracing_subscriber::Registry;

/// The W3C trace-context header.
pub const TRACEPARENT: &str = "traceparent";

/// The service name in the exported resource when `OTEL_SERVICE_NAME` is not set.
const SERVICE_NAME: &str = "batch-processor";

/// The `tracing` layer that turns spans into OpenTelemetry spans, on the bottom of a
/// [`Registry`].
pub type TraceLayer = OpenTelemetryLayer<Registry, SdkTracer>;

/// Keeps the exporter running; [`Traces::shutdown`] sends the spans still buffered.
#[derive(Debug)]
pub struct Traces {
    provider: SdkTracerProvider,
    endpoint: String,
}

impl Traces {
    /// Where spans go (the OTLP traces URL).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Sends the spans still buffered (waiting at most a few seconds) and stops the exporter.
    /// Call it outside an async runtime: the exporter's client blocks.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown_with_timeout(Duration::from_secs(5)) {
            tracing::warn!(error = %e, "traces: the last spans could not be sent");
        }
    }
}

/// What went wrong setting the exporter up.
#[derive(Debug, thiserror::Error)]
#[error("traces: {0}")]
pub struct TraceError(String);

/// The traces URL for a collector's base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` is read: the
/// signal's path is added.
fn traces_url(base: &str) -> String {
    format!("{}/v1/traces", base.trim_end_matches('/'))
}

fn env_set(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.trim().is_empty())
}

/// The layer exporting spans to `otlp_endpoint` (a collector's base URL, such as
/// `http://127.0.0.1:4318`; `/v1/traces` is added) or, without it, to the endpoint the
/// standard variables name; `None` when neither is set or `OTEL_SDK_DISABLED=true`. Also makes
/// W3C trace context the process's propagator. Build it outside an async runtime (the
/// exporter's blocking client).
pub fn trace_layer(
    otlp_endpoint: Option<&str>,
) -> Result<Option<(TraceLayer, Traces)>, TraceError> {
    if std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let from_env =
        env_set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") || env_set("OTEL_EXPORTER_OTLP_ENDPOINT");
    let configured = otlp_endpoint.map(str::trim).filter(|e| !e.is_empty());
    if configured.is_none() && !from_env {
        return Ok(None);
    }
    let mut builder = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
    let endpoint = match configured {
        Some(base) => {
            let url = traces_url(base);
            builder = builder.with_endpoint(url.clone());
            url
        }
        None => std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .ok()
            .filter(|v| !v.trim().is_empty())
            .or_else(|| {
                std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
                    .ok()
                    .map(|b| traces_url(&b))
            })
            .unwrap_or_default(),
    };
    let exporter = builder.build().map_err(|e| {
        TraceError(format!(
            "cannot set up the OTLP exporter for {endpoint}: {e}"
        ))
    })?;
    let mut resource = Resource::builder();
    if !env_set("OTEL_SERVICE_NAME") {
        resource = resource.with_service_name(SERVICE_NAME);
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("batch-processor"));
    Ok(Some((layer, Traces { provider, endpoint })))
}

/// The W3C `traceparent` of `span`, when it is part of an exported trace.
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove(TRACEPARENT)
}

/// Makes `span` a child of the span `traceparent` names (a client's, or the batch's from an
/// earlier run), when it parses; otherwise `span` starts a trace of its own.
pub fn set_parent(span: &tracing::Span, traceparent: &str) {
    let carrier = HashMap::from([(TRACEPARENT.to_owned(), traceparent.to_owned())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_collector_base_gets_the_traces_path() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
    }

    #[test]
    fn without_a_layer_no_span_has_a_traceparent() {
        let span = tracing::info_span!("batch");
        assert_eq!(traceparent(&span), None);
        set_parent(&span, "not a traceparent");
        assert_eq!(traceparent(&span), None);
    }
}
