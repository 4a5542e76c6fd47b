//! Reproducing the paper's LLEP figures: the routing profiles of its harness ([`Profile`]:
//! balanced, and a share of tokens on a few hot experts), its shape ([`PAPER_SHAPE`]), and the
//! per-rank peak model fitted to its measured LLEP peaks ([`PeakModel::paper_fit`]) with the
//! plan-only rows built on it ([`model_row`]). The schedule itself ([`crate::Plan`],
//! [`crate::Schedule`], the executors) needs none of this.

mod model;
mod workload;

pub use model::{
    ChunkStats, ModelRow, PAPER_SHAPE, PeakModel, PeakTerms, chunk_stats, crate_pair_cap, model_row,
};
pub use workload::{Profile, routing_weights};
