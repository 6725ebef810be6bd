//! What a run leaves behind: the [`summary`] table, `results.json` (every request of every run) and a
//! self-contained HTML report with SVG plots ([`html`]): TTFT and TPOT CDFs, hit rate and goodput over time,
//! requests per worker over time.

pub mod html;
pub mod summary;
pub mod svg;

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::client::RequestRecord;
pub use summary::{Slo, Summary};

/// One run: its label (a policy, or `run`), summary and records.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub label: String,
    pub summary: Summary,
    pub records: Vec<RequestRecord>,
}

/// Everything written to disk.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub workload: String,
    /// The command line that produced it.
    pub command: String,
    pub runs: Vec<RunReport>,
}

impl Report {
    /// Writes `results.json` and `report.html` into `dir` (created); returns the HTML path.
    pub fn write(&self, dir: &Path) -> Result<PathBuf, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let json = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        let results = dir.join("results.json");
        std::fs::write(&results, json).map_err(|e| format!("{}: {e}", results.display()))?;
        let html_path = dir.join("report.html");
        std::fs::write(&html_path, html::render(self))
            .map_err(|e| format!("{}: {e}", html_path.display()))?;
        Ok(html_path)
    }
}
