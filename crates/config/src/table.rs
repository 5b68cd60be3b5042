//! [`config_table!`]: a table of the config file, its struct and its keys in one place.

/// Defines the struct of one table (mapping) of the config file and, beside it, `KEYS`: the
/// keys the table accepts, which are its fields in their order. Adding an option is adding a
/// field; the unknown-key check and its suggestions follow.
///
/// - A field written `@derived pub name: T` is not a key of the file: a secret read from the
///   file another key names, or a flag derived from other keys.
/// - `struct Name flat "prefix"` also defines `FLAT_KEYS`, the keys with that prefix, for a
///   table its parent also accepts written flat (`tls_ca_cert_file` beside `tls:`).
macro_rules! config_table {
    (
        $(#[$attr:meta])*
        $vis:vis struct $name:ident flat $prefix:literal {
            $(
                $(#[$fattr:meta])*
                $(@$derived:ident)? $fvis:vis $field:ident : $fty:ty
            ),* $(,)?
        }
    ) => {
        config_table! {
            $(#[$attr])*
            $vis struct $name {
                $( $(#[$fattr])* $(@$derived)? $fvis $field : $fty, )*
            }
        }

        impl $name {
            /// The keys of this table as its parent accepts them written flat.
            pub(crate) const FLAT_KEYS: &'static [&'static str] =
                config_table!(@keys $prefix [] $( $(@$derived)? $field, )*);
        }
    };
    (
        $(#[$attr:meta])*
        $vis:vis struct $name:ident {
            $(
                $(#[$fattr:meta])*
                $(@$derived:ident)? $fvis:vis $field:ident : $fty:ty
            ),* $(,)?
        }
    ) => {
        $(#[$attr])*
        $vis struct $name {
            $( $(#[$fattr])* $fvis $field : $fty, )*
        }

        impl $name {
            /// The keys of this table in the config file: its fields but the derived ones.
            pub(crate) const KEYS: &'static [&'static str] =
                config_table!(@keys "" [] $( $(@$derived)? $field, )*);
        }
    };
    (@keys $prefix:literal [$($key:expr,)*]) => { &[$($key,)*] };
    (@keys $prefix:literal [$($key:expr,)*] @derived $field:ident, $($rest:tt)*) => {
        config_table!(@keys $prefix [$($key,)*] $($rest)*)
    };
    (@keys $prefix:literal [$($key:expr,)*] $field:ident, $($rest:tt)*) => {
        config_table!(@keys $prefix [$($key,)* concat!($prefix, stringify!($field)),] $($rest)*)
    };
}
