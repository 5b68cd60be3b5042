//! The report's SVG plots.

use std::path::Path;

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::online::LatencySample;
use crate::report::{AimdSample, AimdTrace, Kind, Report, Timeline, Unit};
use crate::BenchError;

const OURS: RGBColor = RGBColor(31, 119, 180);
const LIMIT: RGBColor = RGBColor(127, 127, 127);
const BASELINE: RGBColor = RGBColor(255, 127, 14);
const SECOND: RGBColor = RGBColor(44, 160, 44);
const TARGET: RGBColor = RGBColor(214, 39, 40);

/// A line of the limit plot: label, colour, stroke width and the value it draws.
type Series = (&'static str, RGBColor, u32, fn(&AimdSample) -> usize);

/// A chart whose both axes are numbers.
type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

fn plot_error(path: &Path) -> impl Fn(String) -> BenchError + '_ {
    move |e| BenchError::Plot(format!("{}: {e}", path.display()))
}

/// A chart of `x` × `y` on `area`, under `caption` (text, font size), with `margin` and
/// label areas of `labels` (x, y) pixels.
fn chart<'a, 'b>(
    area: &'a DrawingArea<SVGBackend<'b>, Shift>,
    caption: (&str, u32),
    margin: u32,
    labels: (u32, u32),
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
    err: &impl Fn(String) -> BenchError,
) -> Result<Chart<'a, 'b>, BenchError> {
    ChartBuilder::on(area)
        .caption(caption.0, ("sans-serif", caption.1))
        .margin(margin)
        .x_label_area_size(labels.0)
        .y_label_area_size(labels.1)
        .build_cartesian_2d(x, y)
        .map_err(|e| err(e.to_string()))
}

/// The series' labels, lower right on a white ground.
fn legend<'a, 'b: 'a>(
    chart: &mut Chart<'a, 'b>,
    err: &impl Fn(String) -> BenchError,
) -> Result<(), BenchError> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))
}

/// Horizontal bars of every rate (each per-second row), ours in blue, limits in grey, baselines
/// in orange, each labelled with its median; a black tick marks the limit a rate is compared
/// with.
pub fn rates(report: &Report, path: &Path) -> Result<(), BenchError> {
    let bars: Vec<(String, f64, Kind, Option<f64>)> = report
        .rows
        .iter()
        .filter(|r| matches!(r.unit, Unit::PerSecond(_)) && !r.value.median().is_nan())
        .map(|r| {
            (
                format!("{}: {}", r.scenario, r.figure),
                r.value.median(),
                r.kind,
                r.limit.as_ref().map(|l| l.value),
            )
        })
        .collect();
    let err = plot_error(path);
    let height = 80 + 34 * bars.len().max(1) as u32;
    let root = SVGBackend::new(path, (900, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let top = bars
        .iter()
        .map(|b| b.1.max(b.3.unwrap_or(0.0)))
        .fold(1.0, f64::max)
        * 1.05;
    let n = bars.len().max(1) as f64;
    let caption = "Rates (median); black ticks: the limit each is compared with";
    let mut chart = chart(&root, (caption, 18), 12, (36, 10), 0.0..top, 0.0..n, &err)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .x_desc("per second")
        .x_label_formatter(&|x| crate::report::thousands(*x))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, (label, value, kind, limit)) in bars.iter().enumerate() {
        // First row at the top.
        let y = n - i as f64 - 1.0;
        let color = match kind {
            Kind::Ours => OURS,
            Kind::Limit => LIMIT,
            Kind::Baseline => BASELINE,
        };
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(0.0, y + 0.1), (*value, y + 0.55)],
                color.filled(),
            )))
            .map_err(|e| err(e.to_string()))?;
        if let Some(limit) = limit {
            // The limit this rate is compared with, as a black tick across its bar.
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![(*limit, y + 0.02), (*limit, y + 0.63)],
                    BLACK.stroke_width(3),
                )))
                .map_err(|e| err(e.to_string()))?;
        }
        chart
            .draw_series(std::iter::once(Text::new(
                format!("{label}: {}", crate::report::thousands(*value)),
                (top * 0.005, y + 0.95),
                ("sans-serif", 13).into_font(),
            )))
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))
}

/// Peak RSS against job size, one line per mode, with the 64 MiB target.
pub fn rss(report: &Report, path: &Path) -> Result<(), BenchError> {
    let err = plot_error(path);
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let max_lines = report.rss.iter().map(|p| p.lines).max().unwrap_or(1) as f64;
    let top = report
        .rss
        .iter()
        .map(|p| p.mib.max())
        .filter(|v| !v.is_nan())
        .fold(64.0, f64::max)
        * 1.15;
    let caption = ("Peak RSS of the processor by job size", 18);
    let x = 0.0..max_lines * 1.05;
    let mut chart = chart(&root, caption, 12, (40, 56), x, 0.0..top, &err)?;
    chart
        .configure_mesh()
        .x_desc("lines in the job")
        .y_desc("peak RSS (MiB)")
        .x_label_formatter(&|x| crate::report::thousands(*x))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    chart
        .draw_series(LineSeries::new(
            [(0.0, 64.0), (max_lines * 1.05, 64.0)],
            TARGET.stroke_width(1),
        ))
        .map_err(|e| err(e.to_string()))?
        .label("target: 64 MiB")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], TARGET));
    for (mode, color) in [("async", OURS), ("sync", SECOND)] {
        let points: Vec<(f64, f64)> = report
            .rss
            .iter()
            .filter(|p| p.mode == mode)
            .map(|p| (p.lines as f64, p.mib.median()))
            .collect();
        if points.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(format!("{mode} mode (median)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| err(e.to_string()))?;
    }
    legend(&mut chart, &err)?;
    root.present().map_err(|e| err(e.to_string()))
}

/// One panel per limiter trace: the limit and the gateway's in-flight count over time, with
/// the gateway's capacity as it was at each sample.
pub fn aimd(traces: &[&AimdTrace], path: &Path) -> Result<(), BenchError> {
    let err = plot_error(path);
    let panels = traces.len().max(1);
    let root = SVGBackend::new(path, (900, 300 * panels as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let areas = root.split_evenly((panels, 1));
    for (trace, area) in traces.iter().zip(&areas) {
        let end = trace.samples.last().map_or(1.0, |s| s.t).max(0.01);
        let top = trace
            .samples
            .iter()
            .map(|s| s.limit.max(s.in_flight))
            .max()
            .unwrap_or(1)
            .max(trace.capacity) as f64
            * 1.1;
        let caption = format!("{}: limit and gateway in-flight", trace.label);
        let mut chart = chart(area, (&caption, 16), 10, (36, 48), 0.0..end, 0.0..top, &err)?;
        chart
            .configure_mesh()
            .x_desc("seconds since the job started")
            .y_desc("requests")
            .draw()
            .map_err(|e| err(e.to_string()))?;
        let series: [Series; 3] = [
            ("gateway in-flight", LIMIT, 1, |s| s.in_flight),
            ("limit", OURS, 2, |s| s.limit),
            ("gateway capacity", TARGET, 1, |s| s.capacity),
        ];
        for (label, color, width, value) in series {
            chart
                .draw_series(LineSeries::new(
                    trace.samples.iter().map(|s| (s.t, value(s) as f64)),
                    color.stroke_width(width),
                ))
                .map_err(|e| err(e.to_string()))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        legend(&mut chart, &err)?;
    }
    root.present().map_err(|e| err(e.to_string()))
}

/// A line of the online latency plot: label, colour and the value it draws.
type LatencySeries = (&'static str, RGBColor, fn(&LatencySample) -> f64);

/// The colours of the batch jobs' lines, in job order.
const JOBS: [RGBColor; 3] = [OURS, SECOND, BASELINE];

/// One row of panels per timeline: each batch job's completed lines on the left, the online
/// latency (p95 end to end and to the first token) on the right, both against the seconds
/// since the batch started, the online traffic's start marked.
pub fn timelines(timelines: &[&Timeline], path: &Path) -> Result<(), BenchError> {
    let err = plot_error(path);
    let rows = timelines.len().max(1);
    let root = SVGBackend::new(path, (1200, 300 * rows as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    for (timeline, row) in timelines.iter().zip(root.split_evenly((rows, 1))) {
        let row = row
            .titled(&timeline.label, ("sans-serif", 15))
            .map_err(|e| err(e.to_string()))?;
        let halves = row.split_evenly((1, 2));
        let (left, right) = (&halves[0], &halves[1]);
        let at = |t: f64| t + timeline.online_from;
        let end = timeline
            .jobs
            .iter()
            .flatten()
            .map(|p| p.0)
            .chain(timeline.latency.iter().map(|s| at(s.t)))
            .fold(1.0, f64::max);
        let most = timeline
            .jobs
            .iter()
            .flatten()
            .map(|p| p.1)
            .fold(1.0, f64::max);
        let caption = "batch: completed lines per job";
        let y = 0.0..most * 1.1;
        let mut jobs = chart(left, (caption, 13), 8, (32, 52), 0.0..end, y, &err)?;
        jobs.configure_mesh()
            .x_desc("seconds since the batch started")
            .y_desc("completed lines")
            .draw()
            .map_err(|e| err(e.to_string()))?;
        online_start(&mut jobs, timeline.online_from, most * 1.1, &err)?;
        for (k, (job, color)) in timeline.jobs.iter().zip(JOBS.iter().cycle()).enumerate() {
            let color = *color;
            jobs.draw_series(LineSeries::new(job.iter().copied(), color.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?
                .label(format!("job {}", k + 1))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        legend(&mut jobs, &err)?;

        let top = timeline
            .latency
            .iter()
            .flat_map(|s| [s.e2e_p95, s.ttft_p95])
            .filter(|v| !v.is_nan())
            .fold(0.1, f64::max)
            * 1.1;
        let caption = "online latency: p95 of the requests sent in each half second";
        let mut latency = chart(right, (caption, 13), 8, (32, 52), 0.0..end, 0.0..top, &err)?;
        latency
            .configure_mesh()
            .x_desc("seconds since the batch started")
            .y_desc("seconds")
            .draw()
            .map_err(|e| err(e.to_string()))?;
        online_start(&mut latency, timeline.online_from, top, &err)?;
        let series: [LatencySeries; 2] = [
            ("end to end", OURS, |s| s.e2e_p95),
            ("first token", TARGET, |s| s.ttft_p95),
        ];
        for (label, color, value) in series {
            let points = timeline
                .latency
                .iter()
                .filter(|s| !value(s).is_nan())
                .map(|s| (at(s.t), value(s)));
            latency
                .draw_series(LineSeries::new(points, color.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        legend(&mut latency, &err)?;
    }
    root.present().map_err(|e| err(e.to_string()))
}

/// A grey vertical line where the online traffic started.
fn online_start(
    chart: &mut Chart<'_, '_>,
    at: f64,
    top: f64,
    err: &impl Fn(String) -> BenchError,
) -> Result<(), BenchError> {
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(at, 0.0), (at, top)],
            LIMIT.stroke_width(1),
        )))
        .map_err(|e| err(e.to_string()))?;
    Ok(())
}
