//! The report: one row per figure, printed as a table and written as Markdown with plots.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use crate::machine::Machine;
use crate::online::{LatencySample, OnlineRun, PhaseFigures};
use crate::stats::Summary;
use crate::BenchError;

/// How a figure is expressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Events per second; the text names the events (`req/s`).
    PerSecond(&'static str),
    /// Seconds.
    Seconds,
    /// Mebibytes.
    MiB,
    /// A fraction shown as a percentage.
    Percent,
    /// A plain factor (`1.07×`).
    Factor,
    /// A count (a concurrency limit, requests).
    Count,
}

impl Unit {
    /// `value` written in this unit.
    pub fn format(self, value: f64) -> String {
        if value.is_nan() {
            return "–".into();
        }
        match self {
            Unit::PerSecond(what) => format!("{} {what}", thousands(value)),
            // Sub-millisecond latencies keep two decimals.
            Unit::Seconds if value < 0.01 => format!("{:.2} ms", value * 1000.0),
            Unit::Seconds if value < 1.0 => format!("{:.0} ms", value * 1000.0),
            Unit::Seconds => format!("{value:.2} s"),
            Unit::MiB => format!("{value:.1} MiB"),
            Unit::Percent => format!("{:.1} %", value * 100.0),
            Unit::Factor => format!("{value:.2}×"),
            Unit::Count => format!("{value:.1}"),
        }
    }

    /// The number alone, for spreads (`12,300–14,100`).
    fn bare(self, value: f64) -> String {
        match self {
            Unit::PerSecond(_) => thousands(value),
            _ => self.format(value),
        }
    }
}

/// `1234567.8` → `1,234,568`.
pub fn thousands(value: f64) -> String {
    let n = value.round() as i64;
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        out.insert(0, '-');
    }
    out
}

/// What a row stands for in the plots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A figure of the processor.
    Ours,
    /// A physical limit measured on this machine.
    Limit,
    /// A naive implementation, for comparison.
    Baseline,
}

/// The limit a figure is compared with.
#[derive(Debug, Clone, PartialEq)]
pub struct Limit {
    /// What the limit is.
    pub name: String,
    /// Its value, in the row's unit.
    pub value: f64,
}

/// What a figure must reach.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Target {
    /// median / limit ≥ this.
    RatioAtLeast(f64),
    /// median ≥ this.
    AtLeast(f64),
    /// median ≤ this.
    AtMost(f64),
}

/// One figure.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The scenario (`Enqueue`, `Drain`, …).
    pub scenario: String,
    /// What was measured.
    pub figure: String,
    /// Its unit.
    pub unit: Unit,
    /// The runs.
    pub value: Summary,
    /// What it is compared with.
    pub limit: Option<Limit>,
    /// What it must reach.
    pub target: Option<Target>,
    /// Its role in the plots.
    pub kind: Kind,
}

impl Row {
    /// A row of the processor's, without limit or target.
    pub fn new(scenario: &str, figure: impl Into<String>, unit: Unit, value: Summary) -> Self {
        Self {
            scenario: scenario.into(),
            figure: figure.into(),
            unit,
            value,
            limit: None,
            target: None,
            kind: Kind::Ours,
        }
    }

    /// Compares with `limit`.
    pub fn limit(mut self, name: impl Into<String>, value: f64) -> Self {
        self.limit = Some(Limit {
            name: name.into(),
            value,
        });
        self
    }

    /// Sets the target.
    pub fn target(mut self, target: Target) -> Self {
        self.target = Some(target);
        self
    }

    /// Sets the kind.
    pub fn kind(mut self, kind: Kind) -> Self {
        self.kind = kind;
        self
    }

    /// median / limit.
    pub fn ratio(&self) -> Option<f64> {
        let limit = self.limit.as_ref()?;
        (limit.value > 0.0).then(|| self.value.median() / limit.value)
    }

    /// Whether the target is met; `None` without target.
    pub fn met(&self) -> Option<bool> {
        let median = self.value.median();
        Some(match self.target? {
            Target::RatioAtLeast(r) => self.ratio().is_some_and(|x| x >= r),
            Target::AtLeast(v) => median >= v,
            Target::AtMost(v) => median <= v,
        })
    }

    fn target_text(&self) -> String {
        match self.target {
            None => String::new(),
            Some(Target::RatioAtLeast(r)) => format!("≥ {:.0} % of limit", r * 100.0),
            Some(Target::AtLeast(v)) => format!("≥ {}", self.unit.format(v)),
            Some(Target::AtMost(v)) => format!("≤ {}", self.unit.format(v)),
        }
    }

    fn cells(&self) -> [String; 8] {
        let v = &self.value;
        let spread = if v.runs.len() > 1 {
            format!("{}–{}", self.unit.bare(v.min()), self.unit.bare(v.max()))
        } else {
            "(1 run)".into()
        };
        [
            self.scenario.clone(),
            self.figure.clone(),
            self.unit.format(v.median()),
            spread,
            self.limit
                .as_ref()
                .map(|l| format!("{} ({})", self.unit.format(l.value), l.name))
                .unwrap_or_default(),
            self.ratio()
                .map(|r| format!("{:.0} %", r * 100.0))
                .unwrap_or_default(),
            self.target_text(),
            match self.met() {
                None => String::new(),
                Some(true) => "yes".into(),
                Some(false) => "**NO**".into(),
            },
        ]
    }
}

/// One sample of the sync AIMD run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AimdSample {
    /// Seconds since the job started.
    pub t: f64,
    /// The endpoint's AIMD limit.
    pub limit: usize,
    /// Requests the gateway was serving.
    pub in_flight: usize,
    /// The gateway's capacity then.
    pub capacity: usize,
}

/// The AIMD limit and the gateway's load over one run.
#[derive(Debug, Clone, PartialEq)]
pub struct AimdTrace {
    /// What the run was (`hard limit, aimd, backoff_factor 0.5`).
    pub label: String,
    /// The SVG file its panel goes to (one per gateway behaviour).
    pub plot: String,
    /// The gateway's usual capacity.
    pub capacity: usize,
    /// Samples, every ~10 ms.
    pub samples: Vec<AimdSample>,
}

/// Peak RSS of the processor for one mode and job size.
#[derive(Debug, Clone, PartialEq)]
pub struct RssPoint {
    /// `async` or `sync`.
    pub mode: String,
    /// Lines of the job.
    pub lines: usize,
    /// Peak RSS runs, MiB.
    pub mib: Summary,
}

/// A batch beside online traffic over time, for its plot.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// What ran (`online at 50 % of capacity, sync, load (headroom 0.15)`).
    pub label: String,
    /// The SVG file its panel goes to (one per shape of the online traffic).
    pub plot: String,
    /// When the online traffic started, in seconds since the batch started.
    pub online_from: f64,
    /// Each job's completed lines: (seconds since the batch started, lines).
    pub jobs: Vec<Vec<(f64, f64)>>,
    /// The online latency, its times in seconds since the online traffic started.
    pub latency: Vec<LatencySample>,
}

/// Everything a run found.
#[derive(Debug, Clone)]
pub struct Report {
    /// Where it ran.
    pub machine: Machine,
    /// Whether it was the small `--quick` run.
    pub quick: bool,
    /// The figures.
    pub rows: Vec<Row>,
    /// Explanations, by scenario.
    pub notes: Vec<(String, String)>,
    /// Scenarios that failed, with why.
    pub failures: Vec<(String, String)>,
    /// AIMD traces for the plot.
    pub aimd: Vec<AimdTrace>,
    /// Peak RSS points for the plot.
    pub rss: Vec<RssPoint>,
    /// The online traffic's figures by run and phase (the yield scenario's).
    pub online: Vec<(String, PhaseFigures)>,
    /// Batches beside online traffic over time, for their plots.
    pub timelines: Vec<Timeline>,
    /// How long the whole run took.
    pub elapsed: Duration,
}

/// The limit plots, by gateway behaviour: what each shows and its file.
pub const AIMD_PLOTS: [(&str, &str); 12] = [
    ("(a) Against a hard limit, fixed latency", "aimd-limit.svg"),
    (
        "(b) Against a hard limit, answers of lognormal length",
        "aimd-limit-lengths.svg",
    ),
    (
        "(c) Against a hard limit, lognormal lengths with 1 % of answers 20 × longer",
        "aimd-limit-tail.svg",
    ),
    (
        "(d) Against a hard limit changing 64 → 16 → 64, lognormal lengths",
        "aimd-limit-changing.svg",
    ),
    (
        "(e) Against a model server (time per token grows past C, 429 only past Q)",
        "aimd-limit-model-server.svg",
    ),
    (
        "(f) 16 at once, 50 ms × a lognormal factor the usage does not show",
        "aimd-limit-unseen-lognormal.svg",
    ),
    (
        "(g) 16 at once, two kinds of request (20 ms, 400 ms), the same usage",
        "aimd-limit-unseen-two-kinds.svg",
    ),
    (
        "(h) 16 at once, 10 % of the requests 10 × longer, the same usage",
        "aimd-limit-unseen-tail.svg",
    ),
    ("(i) 16 at once, 503 when full", "aimd-limit-503.svg"),
    (
        "(j) 16 at once, prompts of mixed lengths (20 ms + 0.25 ms per prompt word)",
        "aimd-limit-prompts.svg",
    ),
    (
        "(k) 16 at once, a fast and a slow pod behind one URL (50 ms, 150 ms)",
        "aimd-limit-pods.svg",
    ),
    (
        "(l) 50 ms, C drifting slowly 16 → 8 → 16",
        "aimd-limit-drifting.svg",
    ),
];

const HEADER: [&str; 8] = [
    "Scenario",
    "Figure",
    "Median",
    "Min–max",
    "Limit",
    "Ratio",
    "Target",
    "Met",
];

impl Report {
    /// An empty report.
    pub fn new(machine: Machine, quick: bool) -> Self {
        Self {
            machine,
            quick,
            rows: Vec::new(),
            notes: Vec::new(),
            failures: Vec::new(),
            aimd: Vec::new(),
            rss: Vec::new(),
            online: Vec::new(),
            timelines: Vec::new(),
            elapsed: Duration::ZERO,
        }
    }

    /// Adds a note to `scenario`.
    pub fn note(&mut self, scenario: &str, text: impl Into<String>) {
        self.notes.push((scenario.into(), text.into()));
    }

    /// Adds a line to the online figures for each phase of `run`, named `what`.
    pub fn online_lines(&mut self, what: &str, run: &OnlineRun) {
        for figures in run.figures() {
            self.online.push((what.to_owned(), figures));
        }
    }

    /// The plot files of [`Report::timelines`], each once, in order.
    pub fn timeline_plots(&self) -> Vec<&str> {
        let mut files: Vec<&str> = Vec::new();
        for t in &self.timelines {
            if !files.contains(&t.plot.as_str()) {
                files.push(&t.plot);
            }
        }
        files
    }

    /// Rows whose target is missed.
    pub fn missed(&self) -> Vec<&Row> {
        self.rows
            .iter()
            .filter(|r| r.met() == Some(false))
            .collect()
    }

    /// The table as plain text for a terminal.
    pub fn text_table(&self) -> String {
        let rows: Vec<[String; 8]> = self.rows.iter().map(Row::cells).collect();
        let mut widths = HEADER.map(|h| h.chars().count());
        for r in &rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, (c, w)) in cells.iter().zip(widths).enumerate() {
                if i > 0 {
                    s.push_str("  ");
                }
                let c = c.replace("**", "");
                let pad = w.saturating_sub(c.chars().count());
                s.push_str(&c);
                s.push_str(&" ".repeat(pad));
            }
            s.trim_end().to_owned() + "\n"
        };
        let mut out = line(&HEADER.map(String::from));
        out.push_str(&line(&widths.map(|w| "-".repeat(w))));
        for r in &rows {
            out.push_str(&line(r));
        }
        for (scenario, why) in &self.failures {
            out.push_str(&format!("{scenario}: FAILED: {why}\n"));
        }
        if !self.online.is_empty() {
            out.push_str("\nOnline traffic (Yield):\n");
            out.push_str(&crate::online::table(&self.online, false));
        }
        out
    }

    /// The whole report as Markdown (`docs/benchmarks.md`).
    pub fn markdown(&self) -> String {
        let m = &self.machine;
        let mut md = String::new();
        let _ = writeln!(md, "# Benchmarks\n");
        let _ = writeln!(
            md,
            "Written by `just bench` (`bash scripts/bench.sh`, which runs `target/release/bench --out docs`{}). \
             Every figure was measured in the same run, on the same machine, as the limit it is \
             compared with. Median of the runs, spread min–max.\n",
            if self.quick { "; this is a `--quick` run with small sizes and one run each: its figures are not meaningful" } else { "" }
        );
        let _ = writeln!(md, "| | |\n|---|---|");
        let _ = writeln!(md, "| Date | {} |", m.date);
        let _ = writeln!(md, "| CPU | {} |", m.cpu);
        let _ = writeln!(md, "| Cores | {} |", m.cores);
        let _ = writeln!(md, "| RAM | {:.1} GiB |", m.ram_mib as f64 / 1024.0);
        let _ = writeln!(md, "| OS | {} |", m.os);
        let _ = writeln!(md, "| rustc | {} |", m.rustc);
        let _ = writeln!(md, "| redis-server | {} |", m.redis);
        let _ = writeln!(
            md,
            "| batch processor | {} (commit {}) |",
            m.crate_version, m.commit
        );
        let _ = writeln!(md, "| Run time | {:.0} s |\n", self.elapsed.as_secs_f64());

        let _ = writeln!(md, "## Results\n");
        let _ = writeln!(md, "| {} |", HEADER.join(" | "));
        let _ = writeln!(md, "|{}", "---|".repeat(HEADER.len()));
        for r in &self.rows {
            let _ = writeln!(
                md,
                "| {} |",
                r.cells().map(|c| c.replace('|', "\\|")).join(" | ")
            );
        }
        if !self.online.is_empty() {
            let _ = writeln!(
                md,
                "\n## Online traffic\n\nThe yield scenario's online requests, by run and phase (see its notes): answers per second, errors, and p50 / p95 / p99 of the time to first token (TTFT), the inter-token latency (ITL), the time per output token (TPOT) and the end-to-end latency.\n"
            );
            md.push_str(&crate::online::table(&self.online, true));
        }
        let missed = self.missed();
        let _ = writeln!(md, "\n## Targets\n");
        if missed.is_empty() && self.failures.is_empty() {
            let _ = writeln!(md, "Every target is met.");
        }
        for r in missed {
            let [_, _, median, _, limit, ratio, target, _] = r.cells();
            let _ = writeln!(
                md,
                "- **Not met**: {} / {}: {median}{}{} against a target of {target}.",
                r.scenario,
                r.figure,
                if limit.is_empty() {
                    String::new()
                } else {
                    format!(", limit {limit}")
                },
                if ratio.is_empty() {
                    String::new()
                } else {
                    format!(", ratio {ratio}")
                },
            );
        }
        for (scenario, why) in &self.failures {
            let _ = writeln!(md, "- **Failed**: {scenario}: {why}");
        }
        let _ = writeln!(md, "\n## Notes\n");
        let mut last = "";
        for (scenario, text) in &self.notes {
            if scenario != last {
                let _ = writeln!(md, "\n### {scenario}\n");
                last = scenario;
            }
            let _ = writeln!(md, "- {text}");
        }
        let _ = writeln!(md, "\n## Plots\n");
        let _ = writeln!(md, "Rates against their limits:\n\n![rates](rates.svg)\n");
        let _ = writeln!(
            md,
            "Peak RSS of the processor by job size:\n\n![rss](rss.svg)\n"
        );
        let _ = writeln!(
            md,
            "Sync mode: the limit and the gateway's in-flight count, by gateway shape.\n"
        );
        for (what, file) in AIMD_PLOTS {
            let _ = writeln!(md, "{what}:\n\n![aimd]({file})\n");
        }
        let plots = self.timeline_plots();
        if !plots.is_empty() {
            let _ = writeln!(
                md,
                "Yield: each batch job's completed lines and the online latency over time (p95 of the requests sent in each half second), by shape of the online traffic.\n"
            );
        }
        for file in plots {
            let _ = writeln!(md, "![yield]({file})\n");
        }
        md
    }

    /// Writes `benchmarks.md`, `rates.svg`, `rss.svg`, the limit plots ([`AIMD_PLOTS`]) and
    /// the plots over time ([`Report::timeline_plots`]) into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), BenchError> {
        std::fs::create_dir_all(dir).map_err(|e| BenchError::io(dir, e))?;
        let md = dir.join("benchmarks.md");
        std::fs::write(&md, self.markdown()).map_err(|e| BenchError::io(&md, e))?;
        crate::plots::rates(self, &dir.join("rates.svg"))?;
        crate::plots::rss(self, &dir.join("rss.svg"))?;
        for (_, file) in AIMD_PLOTS {
            let traces: Vec<&AimdTrace> = self.aimd.iter().filter(|t| t.plot == file).collect();
            crate::plots::aimd(&traces, &dir.join(file))?;
        }
        for file in self.timeline_plots() {
            let timelines: Vec<&Timeline> =
                self.timelines.iter().filter(|t| t.plot == file).collect();
            crate::plots::timelines(&timelines, &dir.join(file))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(value: f64) -> Row {
        Row::new(
            "Enqueue",
            "rate",
            Unit::PerSecond("req/s"),
            Summary::new(vec![value, value * 0.9, value * 1.1]),
        )
        .limit("redis-benchmark", 100_000.0)
        .target(Target::RatioAtLeast(0.8))
    }

    #[test]
    fn targets_compare_the_median() {
        assert_eq!(row(80_000.0).met(), Some(true));
        assert_eq!(row(79_000.0).met(), Some(false));
        assert_eq!(row(90_000.0).ratio(), Some(0.9));
        let rss =
            Row::new("Memory", "rss", Unit::MiB, Summary::one(70.0)).target(Target::AtMost(64.0));
        assert_eq!(rss.met(), Some(false));
        let plain = Row::new("Cancel", "time", Unit::Seconds, Summary::one(0.5));
        assert_eq!((plain.met(), plain.ratio()), (None, None));
    }

    #[test]
    fn units_read_well() {
        assert_eq!(thousands(1_234_567.8), "1,234,568");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(Unit::PerSecond("req/s").format(12_345.0), "12,345 req/s");
        assert_eq!(Unit::Seconds.format(0.25), "250 ms");
        assert_eq!(Unit::Seconds.format(2.5), "2.50 s");
        assert_eq!(Unit::Seconds.format(0.000_42), "0.42 ms");
        assert_eq!(Unit::Percent.format(0.031), "3.1 %");
    }

    #[test]
    fn online_figures_and_timelines_go_into_the_report() {
        use crate::online::{Answer, Shape};
        let mut r = Report::new(Machine::probe(), true);
        let run = OnlineRun {
            shape: Shape::Steady { rate: 2.0 },
            duration: Duration::from_secs(1),
            answers: vec![Answer {
                sent: 0.1,
                failure: None,
                ttft: Some(0.1),
                gaps: vec![0.02],
                e2e: 0.12,
                tokens: 2,
            }],
        };
        r.online_lines("alone", &run);
        r.timelines.push(Timeline {
            label: "steady, sync".into(),
            plot: "yield-test.svg".into(),
            online_from: 1.0,
            jobs: vec![vec![(0.0, 0.0), (1.5, 30.0)]; 3],
            latency: run.over_time(Duration::from_millis(500)),
        });
        let md = r.markdown();
        assert!(md.contains("## Online traffic"), "{md}");
        assert!(
            md.contains("| alone | steady | 1.0 | 0 | 100 / 100 / 100 | 20 / 20 / 20 |"),
            "{md}"
        );
        assert!(md.contains("![yield](yield-test.svg)"), "{md}");
        assert!(r.text_table().contains("Online traffic (Yield):"));
        let dir = tempfile::tempdir().unwrap();
        r.write(dir.path()).unwrap();
        let svg = std::fs::read_to_string(dir.path().join("yield-test.svg")).unwrap();
        assert!(svg.contains("job 3") && svg.contains("<polyline"), "{svg}");
    }

    #[test]
    fn the_markdown_says_plainly_what_is_missed() {
        let mut r = Report::new(Machine::probe(), false);
        r.rows.push(row(50_000.0));
        r.rows.push(row(95_000.0));
        let md = r.markdown();
        assert!(
            md.contains("**Not met**: Enqueue / rate: 50,000 req/s"),
            "{md}"
        );
        assert_eq!(md.matches("**Not met**").count(), 1);
        assert!(r.text_table().contains("NO"));
        r.rows.remove(0);
        assert!(r.markdown().contains("Every target is met."));
    }
}
