//! Durations in JSON as human strings (`"20ms"`, `"1s 500ms"`), or as integer milliseconds.

use std::time::Duration;

use serde::{de, Deserializer, Serializer};

pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    struct Visitor;
    impl de::Visitor<'_> for Visitor {
        type Value = Duration;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a duration such as \"20ms\" or a number of milliseconds")
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
            humantime::parse_duration(v.trim()).map_err(|e| E::custom(format!("{v:?}: {e}")))
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
            Ok(Duration::from_millis(v))
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
            u64::try_from(v)
                .map(Duration::from_millis)
                .map_err(|_| E::custom(format!("negative duration: {v}")))
        }

        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Duration, E> {
            Duration::try_from_secs_f64(v / 1000.0).map_err(|e| E::custom(format!("{v}: {e}")))
        }
    }
    d.deserialize_any(Visitor)
}
