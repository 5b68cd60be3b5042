//! A walker over figment's merged value tree that converts leaves and keeps every error.
//!
//! figment's own `extract` stops at the first error and its dotted `find_value` cannot address map
//! keys such as `Qwen/Qwen3-0.6B`; walking the tree ourselves gives all errors at once, each with the
//! file or environment variable its value came from (through the value's tag).

use std::fmt::Display;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::value::{Dict, Num, Tag, Value};
use figment::{Figment, Source};

use crate::error::ConfigError;

/// The longest duration any setting takes: a deadline or timer computed from it (an `Instant`
/// plus it) can then never overflow.
pub(crate) const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);
use crate::values::{closest, parse_byte_size, parse_duration};

/// One mapping of the tree (possibly absent), with where it sits.
#[derive(Clone)]
pub(crate) struct Table<'v> {
    dict: Option<&'v Dict>,
    tag: Tag,
    path: Vec<String>,
}

impl<'v> Table<'v> {
    /// A set value under `key`; YAML `null` counts as unset.
    pub(crate) fn get(&self, key: &str) -> Option<&'v Value> {
        self.dict?
            .get(key)
            .filter(|value| !matches!(value, Value::Empty(..)))
    }

    /// The tag that best explains `key`: its own when set, else the enclosing mapping's.
    pub(crate) fn tag_of(&self, key: &str) -> Tag {
        self.get(key).map_or(self.tag, Value::tag)
    }

    /// The tag of the mapping itself (of its parent when the mapping is unset).
    pub(crate) fn tag(&self) -> Tag {
        self.tag
    }

    /// Where the mapping sits.
    pub(crate) fn path(&self) -> &[String] {
        &self.path
    }

    pub(crate) fn path_of(&self, key: &str) -> Vec<String> {
        let mut path = self.path.clone();
        path.push(key.to_owned());
        path
    }

    /// The entries of this mapping, in key order.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (&'v String, &'v Value)> {
        self.dict.into_iter().flat_map(|dict| dict.iter())
    }
}

/// Converts leaves of the tree and records every problem instead of stopping at the first.
pub(crate) struct Collector<'f> {
    figment: &'f Figment,
    fallback_source: String,
    errors: Vec<ConfigError>,
}

impl<'f> Collector<'f> {
    pub(crate) fn new(figment: &'f Figment) -> Self {
        // Values nobody set (defaults, the root) are blamed on the first config file, if any.
        let fallback_source = figment
            .metadata()
            .find_map(|md| md.source.as_ref().and_then(Source::file_path))
            .map_or_else(|| "configuration".to_owned(), |p| p.display().to_string());
        Self {
            figment,
            fallback_source,
            errors: Vec::new(),
        }
    }

    pub(crate) fn into_errors(self) -> Vec<ConfigError> {
        self.errors
    }

    pub(crate) fn fallback_source(&self) -> &str {
        &self.fallback_source
    }

    /// The file, or the environment variable, a value with `tag` at `path` came from.
    pub(crate) fn source(&self, tag: Tag, path: &[String]) -> String {
        let Some(md) = self.figment.get_metadata(tag) else {
            return self.fallback_source.clone();
        };
        if let Some(file) = md.source.as_ref().and_then(Source::file_path) {
            return file.display().to_string();
        }
        if md.name.contains("environment variable") {
            // figment names a prefixed provider "`PREFIX_` environment variable(s)".
            let prefix = md.name.split('`').nth(1).unwrap_or_default();
            return format!("{prefix}{}", path.join("__").to_ascii_uppercase());
        }
        md.name.to_string()
    }

    /// The directory a relative path set by a value with `tag` is relative to.
    fn base_dir(&self, tag: Tag) -> PathBuf {
        let file = self
            .figment
            .get_metadata(tag)
            .and_then(|md| md.source.as_ref())
            .and_then(Source::file_path);
        match file.and_then(Path::parent) {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
            _ => PathBuf::from("."),
        }
    }

    pub(crate) fn error(&mut self, tag: Tag, path: &[String], problem: impl Display) {
        self.errors.push(ConfigError {
            source: self.source(tag, path),
            path: display_path(path),
            problem: problem.to_string(),
        });
    }

    /// Records a problem with `key` of `table`.
    pub(crate) fn at(&mut self, table: &Table<'_>, key: &str, problem: impl Display) {
        self.error(table.tag_of(key), &table.path_of(key), problem);
    }

    /// The root mapping, checked for unknown keys.
    pub(crate) fn root<'v>(&mut self, root: &'v Value, allowed: &[&str]) -> Table<'v> {
        let table = Table {
            dict: None,
            tag: root.tag(),
            path: Vec::new(),
        };
        self.as_table(table, root, allowed)
    }

    /// The mapping under `key` (empty when unset), checked for unknown keys.
    pub(crate) fn table<'v>(
        &mut self,
        parent: &Table<'v>,
        key: &str,
        allowed: &[&str],
    ) -> Table<'v> {
        let table = Table {
            dict: None,
            tag: parent.tag_of(key),
            path: parent.path_of(key),
        };
        match parent.get(key) {
            Some(value) => self.as_table(table, value, allowed),
            None => table,
        }
    }

    /// Views `value` as a mapping for an entry of a map such as `model_gateways`.
    pub(crate) fn entry<'v>(
        &mut self,
        parent: &Table<'v>,
        key: &str,
        value: &'v Value,
        allowed: &[&str],
    ) -> Table<'v> {
        let table = Table {
            dict: None,
            tag: value.tag(),
            path: parent.path_of(key),
        };
        self.as_table(table, value, allowed)
    }

    fn as_table<'v>(
        &mut self,
        mut table: Table<'v>,
        value: &'v Value,
        allowed: &[&str],
    ) -> Table<'v> {
        match value {
            Value::Dict(_, dict) => {
                table.dict = Some(dict);
                if !allowed.is_empty() {
                    self.unknown_keys(&table, allowed);
                }
            }
            Value::Empty(..) => {}
            other => self.error(
                other.tag(),
                &table.path,
                format!("expected a mapping, got {}", describe(other)),
            ),
        }
        table
    }

    fn unknown_keys(&mut self, table: &Table<'_>, allowed: &[&str]) {
        for (key, _) in table.entries() {
            if allowed.contains(&key.as_str()) {
                continue;
            }
            let problem = match closest(key, allowed) {
                Some(near) => format!("unknown key (did you mean {near}?)"),
                None => format!("unknown key (expected one of: {})", allowed.join(", ")),
            };
            self.at(table, key, problem);
        }
    }

    /// A string; integers and booleans are taken as written (env values arrive parsed).
    pub(crate) fn string(&mut self, table: &Table<'_>, key: &str) -> Option<String> {
        match table.get(key)? {
            Value::String(_, s) => Some(s.clone()),
            Value::Char(_, c) => Some(c.to_string()),
            Value::Bool(_, b) => Some(b.to_string()),
            Value::Num(_, n) if integer(*n).is_some() => integer(*n).map(|i| i.to_string()),
            other => {
                self.at(
                    table,
                    key,
                    format!("expected a string, got {}", describe(other)),
                );
                None
            }
        }
    }

    /// A non-empty string.
    pub(crate) fn text(&mut self, table: &Table<'_>, key: &str) -> Option<String> {
        let text = self.string(table, key)?;
        if text.trim().is_empty() {
            self.at(table, key, "is empty");
            return None;
        }
        Some(text)
    }

    /// A duration with a unit, at most [`MAX_DURATION`]; `default` when unset or invalid.
    pub(crate) fn duration(&mut self, table: &Table<'_>, key: &str, default: Duration) -> Duration {
        let parsed = match table.get(key) {
            None => return default,
            Some(Value::String(_, s)) => parse_duration(s),
            Some(Value::Num(_, n)) => parse_duration(&describe_num(*n)),
            Some(other) => Err(format!(
                "expected a duration such as 5s, got {}",
                describe(other)
            )),
        };
        let bounded = parsed.and_then(|d| match d <= MAX_DURATION {
            true => Ok(d),
            false => Err("must be at most 365d".to_owned()),
        });
        bounded.unwrap_or_else(|problem| {
            self.at(table, key, problem);
            default
        })
    }

    /// A duration that must be greater than zero.
    pub(crate) fn positive_duration(
        &mut self,
        table: &Table<'_>,
        key: &str,
        default: Duration,
    ) -> Duration {
        let value = self.duration(table, key, default);
        if value.is_zero() {
            self.at(table, key, "must be greater than 0");
            return default;
        }
        value
    }

    /// A whole number of at least `min`; `default` when unset or invalid.
    pub(crate) fn count<T>(&mut self, table: &Table<'_>, key: &str, default: T, min: u128) -> T
    where
        T: TryFrom<u128> + Copy,
    {
        let number = match table.get(key) {
            None => return default,
            Some(Value::Num(_, n)) => integer(*n).ok_or_else(|| describe_num(*n)),
            Some(Value::String(_, s)) => s.trim().parse::<i128>().map_err(|_| format!("{s:?}")),
            Some(other) => Err(describe(other)),
        };
        let problem = match number {
            Err(got) => format!("expected a whole number, got {got}"),
            Ok(n) if n < 0 || (n as u128) < min => format!("must be at least {min}, got {n}"),
            Ok(n) => match T::try_from(n as u128) {
                Ok(value) => return value,
                Err(_) => format!("{n} is too large"),
            },
        };
        self.at(table, key, problem);
        default
    }

    /// A whole number, negative or not; `None` when unset or invalid.
    pub(crate) fn signed(&mut self, table: &Table<'_>, key: &str) -> Option<i64> {
        let number = match table.get(key)? {
            Value::Num(_, n) => integer(*n).ok_or_else(|| describe_num(*n)),
            Value::String(_, s) => s.trim().parse::<i128>().map_err(|_| format!("{s:?}")),
            other => Err(describe(other)),
        };
        let problem = match number {
            Ok(n) => match i64::try_from(n) {
                Ok(n) => return Some(n),
                Err(_) => format!("{n} is out of range"),
            },
            Err(got) => format!("expected a whole number, got {got}"),
        };
        self.at(table, key, problem);
        None
    }

    /// A list of non-empty strings; a single string is a list of one (as an environment
    /// variable gives it). Empty when unset or invalid.
    pub(crate) fn strings(&mut self, table: &Table<'_>, key: &str) -> Vec<String> {
        let items = match table.get(key) {
            None => return Vec::new(),
            Some(Value::String(_, s)) => return vec![s.clone()],
            Some(Value::Array(_, items)) => items,
            Some(other) => {
                let problem = format!("expected a list of strings, got {}", describe(other));
                self.at(table, key, problem);
                return Vec::new();
            }
        };
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            match item {
                Value::String(_, s) if !s.trim().is_empty() => out.push(s.clone()),
                other => {
                    let problem = format!(
                        "[{i}]: expected a non-empty string, got {}",
                        describe(other)
                    );
                    self.at(table, key, problem);
                }
            }
        }
        out
    }

    /// A number, whole or not; `default` when unset or invalid.
    pub(crate) fn float(&mut self, table: &Table<'_>, key: &str, default: f64) -> f64 {
        let number = match table.get(key) {
            None => return default,
            Some(Value::Num(_, n)) => Ok(num_to_f64(*n)),
            Some(Value::String(_, s)) => s.trim().parse::<f64>().map_err(|_| format!("{s:?}")),
            Some(other) => Err(describe(other)),
        };
        number.unwrap_or_else(|got| {
            self.at(table, key, format!("expected a number, got {got}"));
            default
        })
    }

    /// `true` or `false`; `default` when unset or invalid.
    pub(crate) fn boolean(&mut self, table: &Table<'_>, key: &str, default: bool) -> bool {
        match table.get(key) {
            None => default,
            Some(Value::Bool(_, b)) => *b,
            Some(Value::String(_, s)) if s == "true" || s == "false" => s == "true",
            Some(other) => {
                let problem = format!("expected true or false, got {}", describe(other));
                self.at(table, key, problem);
                default
            }
        }
    }

    /// A file path, made absolute: relative paths are relative to the config file's directory,
    /// or to the current directory when the value came from the environment.
    pub(crate) fn path(&mut self, table: &Table<'_>, key: &str) -> Option<PathBuf> {
        let text = self.text(table, key)?;
        let path = Path::new(&text);
        let joined = if path.is_absolute() {
            path.to_path_buf()
        } else {
            self.base_dir(table.tag_of(key)).join(path)
        };
        match std::path::absolute(&joined) {
            Ok(absolute) => Some(absolute),
            Err(e) => {
                self.at(
                    table,
                    key,
                    format!("cannot resolve {}: {e}", joined.display()),
                );
                None
            }
        }
    }

    /// A byte count (`1048576`, `200MiB`) of at least 1; `default` when unset or invalid.
    pub(crate) fn byte_size(&mut self, table: &Table<'_>, key: &str, default: u64) -> u64 {
        let parsed = match table.get(key) {
            None => return default,
            Some(Value::Num(_, n)) => integer(*n)
                .and_then(|i| u64::try_from(i).ok())
                .ok_or_else(|| format!("expected a size such as 200MiB, got {}", describe_num(*n))),
            Some(Value::String(_, s)) => parse_byte_size(s),
            Some(other) => Err(format!(
                "expected a size such as 200MiB, got {}",
                describe(other)
            )),
        };
        match parsed {
            Ok(0) => self.at(table, key, "must be at least 1 byte"),
            Ok(bytes) => return bytes,
            Err(problem) => self.at(table, key, problem),
        }
        default
    }

    /// A duration greater than zero and at most `max`; `default` when unset or invalid.
    pub(crate) fn bounded_duration(
        &mut self,
        table: &Table<'_>,
        key: &str,
        default: Duration,
        max: Duration,
    ) -> Duration {
        let value = self.positive_duration(table, key, default);
        if value > max {
            let problem = format!("must be at most {}", humantime::format_duration(max));
            self.at(table, key, problem);
            return default;
        }
        value
    }

    /// A whole number from `min` to `max`; `default` when unset or invalid.
    pub(crate) fn bounded_count<T>(
        &mut self,
        table: &Table<'_>,
        key: &str,
        default: T,
        min: u128,
        max: u128,
    ) -> T
    where
        T: TryFrom<u128> + PartialOrd + Copy,
    {
        let value = self.count(table, key, default, min);
        if T::try_from(max).is_ok_and(|max| value > max) {
            self.at(table, key, format!("must be at most {max}"));
            return default;
        }
        value
    }

    /// A byte count from 1 to `max`; `default` when unset or invalid.
    pub(crate) fn bounded_byte_size(
        &mut self,
        table: &Table<'_>,
        key: &str,
        default: u64,
        max: u64,
    ) -> u64 {
        let value = self.byte_size(table, key, default);
        if value > max {
            self.at(table, key, format!("must be at most {max} bytes"));
            return default;
        }
        value
    }

    /// A socket address such as `127.0.0.1:9090`.
    pub(crate) fn socket_addr(&mut self, table: &Table<'_>, key: &str) -> Option<SocketAddr> {
        let text = self.string(table, key)?;
        match text.trim().parse() {
            Ok(addr) => Some(addr),
            Err(_) => {
                let problem = format!("expected an address such as 127.0.0.1:9090, got {text:?}");
                self.at(table, key, problem);
                None
            }
        }
    }
}

/// `a.b.c`, with segments that hold a `.`, `:` or space quoted so the path stays readable.
pub(crate) fn display_path(path: &[String]) -> String {
    path.iter()
        .map(|segment| {
            if segment.is_empty() || segment.contains(['.', ':', ' ', '"']) {
                format!("{segment:?}")
            } else {
                segment.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

fn integer(n: Num) -> Option<i128> {
    match n {
        Num::F32(_) | Num::F64(_) => None,
        other => other
            .to_i128()
            .or_else(|| other.to_u128().and_then(|u| i128::try_from(u).ok())),
    }
}

fn num_to_f64(n: Num) -> f64 {
    match n.to_f64() {
        Some(f) => f,
        None => integer(n).map_or(f64::NAN, |i| i as f64),
    }
}

fn describe_num(n: Num) -> String {
    match integer(n) {
        Some(i) => i.to_string(),
        None => num_to_f64(n).to_string(),
    }
}

/// A user-facing description of what a value is.
fn describe(value: &Value) -> String {
    match value {
        Value::String(_, s) => format!("the string {s:?}"),
        Value::Char(_, c) => format!("the character {c:?}"),
        Value::Bool(_, b) => format!("{b}"),
        Value::Num(_, n) => format!("the number {}", describe_num(*n)),
        Value::Empty(..) => "nothing".to_owned(),
        Value::Dict(..) => "a mapping".to_owned(),
        Value::Array(..) => "a list".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_quote_awkward_segments() {
        let path = ["model_gateways", "Qwen/Qwen3-0.6B", "url"].map(String::from);
        assert_eq!(
            display_path(&path),
            r#"model_gateways."Qwen/Qwen3-0.6B".url"#
        );
        let path = ["model_gateways", "llama-3", "url"].map(String::from);
        assert_eq!(display_path(&path), "model_gateways.llama-3.url");
    }
}
