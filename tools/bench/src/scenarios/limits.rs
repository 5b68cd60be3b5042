//! The `redis-benchmark` limits that enqueue and drain compare with, on one server and on a
//! cluster.

use super::blocking;
use crate::lab::Lab;
use crate::redis_benchmark::RedisBenchmark;
use crate::report::{Kind, Report, Row, Unit};
use crate::stats::Summary;
use crate::{BenchError, Settings};

/// `command` run as `bench` says at `-P 1` and at `-P 32`, `s.long_runs` times each, each run on
/// an emptied Redis and after `fill` at `-P 32` when given; each pipeline's runs. Redis is
/// emptied again after the last.
pub(crate) async fn by_pipeline(
    lab: &Lab,
    s: &Settings,
    bench: &RedisBenchmark,
    fill: Option<&[&str]>,
    command: &[&str],
) -> Result<Vec<(usize, Summary)>, BenchError> {
    // Owned, for the blocking task.
    let owned = |words: &[&str]| words.iter().map(|w| w.to_string()).collect::<Vec<_>>();
    let (fill, command) = (fill.map(owned), owned(command));
    let mut limits = Vec::new();
    for pipeline in [1, 32] {
        let mut runs = Vec::new();
        for _ in 0..s.long_runs {
            lab.flush_redis().await?;
            let filler = fill.clone().map(|fill| {
                let filler = RedisBenchmark {
                    pipeline: 32,
                    ..bench.clone()
                };
                (filler, fill)
            });
            let bench = RedisBenchmark {
                pipeline,
                ..bench.clone()
            };
            let command = command.clone();
            runs.push(
                blocking(move || {
                    if let Some((filler, fill)) = &filler {
                        filler.run(&words(fill))?;
                    }
                    bench.run(&words(&command))
                })
                .await?,
            );
        }
        limits.push((pipeline, Summary::new(runs)));
    }
    lab.flush_redis().await?;
    Ok(limits)
}

/// The words of an owned command, as `RedisBenchmark::run` takes them.
fn words(owned: &[String]) -> Vec<&str> {
    owned.iter().map(String::as_str).collect()
}

/// A limit row of `scenario` for each pipeline's runs, its figure `figure(pipeline)`.
pub(crate) fn push_rows(
    report: &mut Report,
    scenario: &str,
    unit: Unit,
    limits: Vec<(usize, Summary)>,
    figure: impl Fn(usize) -> String,
) {
    for (pipeline, runs) in limits {
        report
            .rows
            .push(Row::new(scenario, figure(pipeline), unit, runs).kind(Kind::Limit));
    }
}
