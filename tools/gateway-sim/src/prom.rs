//! A tiny Prometheus text-format writer and reader: the simulators must not install a global
//! recorder.

use std::fmt::Write;

/// Accumulates one exposition page.
#[derive(Default)]
pub struct Page {
    text: String,
}

impl Page {
    /// Starts a metric family.
    pub fn family(&mut self, name: &str, kind: &str, help: &str) -> &mut Self {
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
        self
    }

    /// One sample; `labels` are `(name, value)` pairs.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) -> &mut Self {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                let v = v
                    .replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n");
                let _ = write!(self.text, "{k}=\"{v}\"");
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {value}");
        self
    }

    /// The finished page.
    pub fn finish(self) -> String {
        self.text
    }
}

/// Reads the value of an unlabelled sample from a Prometheus text page.
pub fn read_sample(page: &str, name: &str) -> Option<f64> {
    page.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok()).flatten()
    })
}

/// The sum of every sample of metric `name`, whatever its labels (`None` when it has none): a
/// pool's total as a PromQL `sum(name)` gives it.
pub fn sum_samples(page: &str, name: &str) -> Option<f64> {
    let mut total = None;
    for line in page.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let metric = series.split('{').next().unwrap_or(series);
        if metric == name {
            if let Ok(v) = value.trim().parse::<f64>() {
                total = Some(total.unwrap_or(0.0) + v);
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_and_reads_back() {
        let mut p = Page::default();
        p.family("a_total", "counter", "A.")
            .sample("a_total", &[("s", "x\"y")], 3.0)
            .family("b", "gauge", "B.")
            .sample("b", &[], 2.5);
        let text = p.finish();
        assert!(text.contains("a_total{s=\"x\\\"y\"} 3\n"), "{text}");
        assert_eq!(read_sample(&text, "b"), Some(2.5));
        assert_eq!(sum_samples(&text, "a_total"), Some(3.0));
        assert_eq!(sum_samples(&text, "c"), None);
        assert_eq!(read_sample(&text, "a_total"), None);
    }
}
