//! Configuration errors: each names where the value came from and which field it is.

use std::fmt;

/// One problem in the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The config file as given, or the environment variable that set the value.
    pub source: String,
    /// The field path, e.g. `model_gateways.llama-3.url`; empty for whole-file problems.
    pub path: String,
    /// What is wrong, e.g. `missing (every model needs a url in sync mode)`.
    pub problem: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}: {}", self.source, self.problem)
        } else {
            write!(f, "{}: {}: {}", self.source, self.path, self.problem)
        }
    }
}

impl std::error::Error for ConfigError {}

/// Every problem found in one configuration, in the order they were found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors {
    /// The problems; never empty when returned by the loader.
    pub errors: Vec<ConfigError>,
}

impl ConfigErrors {
    /// A single whole-source problem (the file cannot be read or parsed).
    pub fn single(source: impl Into<String>, problem: impl Into<String>) -> Self {
        Self {
            errors: vec![ConfigError {
                source: source.into(),
                path: String::new(),
                problem: problem.into(),
            }],
        }
    }

    /// How many problems there are.
    pub fn len(&self) -> usize {
        self.errors.len()
    }

    /// True when there is no problem.
    pub fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }
}

/// One `source: path: problem` line per error.
impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}
