//! What the binaries' settings share: each default is written once, as its flag's clap `default_value` (shown by
//! `--help`), and read back from there by the layering of flags > environment > TOML file > default (`Layers`);
//! the configuration references (`docs/reference/*.md`) are generated from the same clap command
//! ([`reference_markdown`]) and a test in each binary's crate fails when the committed page and the code disagree.

use std::collections::BTreeSet;
use std::str::FromStr;

use clap::parser::ValueSource;
use clap::{ArgMatches, Command};

/// Why a setting or a reference could not be had (configuration and build-time errors: a retry cannot help).
#[derive(Debug, thiserror::Error)]
pub enum SettingError {
    /// Neither the flags, the environment, the file nor a declared default gives it (a default that does not parse
    /// as its type is this too: the reference test catches it).
    #[error("--{flag}: no value and no default")]
    NoValue { flag: String },
    /// A committed reference page is not what the code declares.
    #[error("{path} is not what the code declares; regenerate it with KVGATE_BLESS=1 and the same test")]
    Stale { path: String },
    /// The page could not be written.
    #[error("{path}: {error}")]
    Write { path: String, error: std::io::Error },
}

/// A constant's text as a `&'static str`, for a clap `default_value` (clap's `default_value_t` does not fit the
/// `Option` fields the TOML layering needs): `default_value = kvgate_shared::default_text!(MY_CONST)`.
#[macro_export]
macro_rules! default_text {
    ($c:expr) => {{
        static TEXT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| $c.to_string());
        TEXT.as_str()
    }};
}

/// Which value of a setting wins: the flags' and environment's unless clap filled it in from its default, then the
/// TOML file's, then the default.
#[derive(Clone, Debug, Default)]
pub struct Layers {
    /// Ids (field names) of the arguments whose value clap took from its `default_value`.
    pub defaulted: BTreeSet<String>,
}

impl Layers {
    /// The ids of `m` whose value is clap's default (not a flag, not the environment).
    pub fn from_matches(m: &ArgMatches) -> Self {
        let defaulted = m
            .ids()
            .filter(|id| m.value_source(id.as_str()) == Some(ValueSource::DefaultValue))
            .map(|id| id.to_string())
            .collect();
        Self { defaulted }
    }

    /// Whether setting `id` was given as a flag or in the environment (not filled in from its default).
    pub fn given(&self, id: &str) -> bool {
        !self.defaulted.contains(id)
    }

    /// The winning value of setting `id` that declares no default: `flag` (flags or environment) unless clap
    /// filled it in, else `file`.
    pub fn value<T: Clone>(&self, id: &str, flag: &Option<T>, file: &Option<T>) -> Option<T> {
        flag.clone().filter(|_| self.given(id)).or_else(|| file.clone())
    }

    /// The winning value of setting `id` with a declared default: [`Layers::value`], else the default declared on
    /// `cmd`.
    pub fn setting<T: FromStr + Clone>(
        &self,
        cmd: &Command,
        id: &str,
        flag: &Option<T>,
        file: &Option<T>,
    ) -> Result<T, SettingError> {
        self.value(id, flag, file)
            .or_else(|| default_of(cmd, id))
            .ok_or_else(|| SettingError::NoValue { flag: id.replace('_', "-") })
    }
}

/// The default declared for argument `id` of `cmd`, parsed (`None`: it declares none).
pub fn default_of<T: FromStr>(cmd: &Command, id: &str) -> Option<T> {
    let arg = cmd.get_arguments().find(|a| a.get_id() == id)?;
    arg.get_default_values().first()?.to_str()?.parse().ok()
}

/// A Markdown reference of `cmd`'s arguments: for each, its flag, environment variable, TOML key, default and
/// help text (the long help where there is one).
pub fn reference_markdown(cmd: &Command, title: &str, intro: &str) -> String {
    let mut out = format!(
        "# {title}\n\n<!-- Generated from the code's flag definitions; do not edit. -->\n\n{intro}\n"
    );
    for a in cmd.get_arguments() {
        let Some(long) = a.get_long() else { continue };
        if a.is_hide_set() || long == "help" || long == "version" {
            continue;
        }
        out.push_str(&format!("\n### `--{long}`\n\n"));
        let mut facts = Vec::new();
        if let Some(env) = a.get_env() {
            facts.push(format!("env `{}`", env.to_string_lossy()));
        }
        if long != "config" {
            facts.push(format!("TOML `{}`", a.get_id().as_str().replace('_', "-")));
        }
        let defaults: Vec<String> =
            a.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
        facts.push(match defaults.as_slice() {
            [] => "no default".to_owned(),
            d => format!("default `{}`", d.join(",")),
        });
        out.push_str(&facts.join(" · "));
        out.push_str("\n\n");
        let help = a.get_long_help().or(a.get_help()).map(|h| h.to_string()).unwrap_or_default();
        out.push_str(help.trim());
        out.push('\n');
    }
    out
}

/// Compares a generated reference with the committed file at `path`; with `KVGATE_BLESS=1` writes it instead.
/// The error says how to regenerate.
pub fn check_reference(path: &std::path::Path, generated: &str) -> Result<(), SettingError> {
    if std::env::var_os("KVGATE_BLESS").is_some_and(|v| v == "1") {
        return std::fs::write(path, generated)
            .map_err(|error| SettingError::Write { path: path.display().to_string(), error });
    }
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    if committed == generated {
        return Ok(());
    }
    Err(SettingError::Stale { path: path.display().to_string() })
}
