//! The plan-only row at the paper's shape. The peak model's multipliers are *fitted* to the
//! paper's balanced LLEP → PipelinedLLEP pair (52.66 → 21.43 GiB), so this test does not check
//! them against those figures (that could not fail); it checks what the crate computes on its
//! own: its plan's rounds, that its exact buffer bytes stay below the fitted model of the
//! paper's pipelined schedule, and the chunk send ratios of LLEP's plan under strided and
//! contiguous chunking.

use llep::Config;

use llep::paper::{PAPER_SHAPE, PeakModel, Profile, crate_pair_cap, model_row};

#[test]
fn paper_row() {
    let config = Config::default();
    let q = crate_pair_cap(&PAPER_SHAPE, Profile::Balanced, 10, &config).unwrap();
    let model = PeakModel::paper_fit();
    for spec in ["balanced", "95:16", "80:16", "50:4"] {
        let profile: Profile = spec.parse().unwrap();
        let row = model_row(&PAPER_SHAPE, profile, 10, q, &config, &model).unwrap();
        println!(
            "{spec:>9}: EP {:7.2} GiB | LLEP {:6.2} → paper PipelinedLLEP {:6.2} GiB (−{:.1}%) | crate {:6.2} GiB \
             buffers (−{:.1}%), formula {:6.2} | K={} q={} | LLEP foreign {} | send ratio strided {:.2} \
             contiguous {:.2} | max chunk recv {} / {}",
            row.ep_gib,
            row.llep_gib,
            row.paper_pipelined_gib,
            100.0 * row.paper_reduction(),
            row.crate_buffers_gib,
            100.0 * row.crate_reduction(),
            row.crate_formula_gib,
            row.crate_rounds,
            row.pair_cap,
            row.llep_foreign_experts,
            row.strided.worst_send_ratio,
            row.contiguous.worst_send_ratio,
            row.strided.max_chunk_recv,
            row.contiguous.max_chunk_recv,
        );
        if spec == "balanced" {
            assert_eq!(row.crate_rounds, 10);
        }
        assert!(row.crate_buffers_gib < row.paper_pipelined_gib, "{row:?}");
        assert!(row.strided.worst_send_ratio <= row.contiguous.worst_send_ratio + 1e-9, "{row:?}");
    }
}
