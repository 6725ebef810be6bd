//! Small statistics shared by the simulator and the load generator: the workspace's one percentile
//! (`kvgate_shared::stats`).

pub use kvgate_shared::stats::percentile;
