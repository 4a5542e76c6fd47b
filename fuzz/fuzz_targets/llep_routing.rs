#![no_main]
//! llep's per-call schedule from arbitrary top-k expert ids on small shapes: a typed error, or a
//! schedule whose rounds carry every pair's rows exactly once within the launch plan's pair cap.

use flatpeak::{DType, llep};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Case {
    ranks: u8,
    tokens: u8,
    experts_per_rank: u8,
    top_k: u8,
    pair_cap: Option<u8>,
    scheme: u8,
    ids: Vec<i8>,
}

fuzz_target!(|case: Case| {
    let ranks = usize::from(case.ranks % 8) + 1;
    let tokens = usize::from(case.tokens % 48);
    let experts = ranks * (usize::from(case.experts_per_rank % 4) + 1);
    let top_k = usize::from(case.top_k % 4) + 1;
    let shape = llep::Shape { ranks, tokens, hidden: 4, intermediate: 2, experts, top_k, dtype: DType::F32 };
    let scheme = [llep::Scheme::PipelinedLlep, llep::Scheme::Llep, llep::Scheme::StandardEp]
        [usize::from(case.scheme) % 3];
    let cap = case.pair_cap.map_or(llep::PairCap::FitBudget, |q| llep::PairCap::Rows(usize::from(q)));
    let config = llep::Config::default().scheme(scheme).pair_cap(cap);
    let Ok(plan) = llep::Plan::new(&config, shape, llep::Budget::mib(1)) else { return };
    // Each rank's ids: N·k of them, from the fuzzer's bytes (out-of-range ids included).
    let need = ranks * tokens * top_k;
    let ids: Vec<i64> = (0..need).map(|i| i64::from(case.ids.get(i).copied().unwrap_or(0))).collect();
    let per_rank: Vec<&[i64]> =
        (0..ranks).map(|r| &ids[r * tokens * top_k..(r + 1) * tokens * top_k]).collect();
    let Ok(schedule) = llep::Schedule::from_top_k(&plan, &per_rank) else { return };
    let q = schedule.pair_cap();
    for s in 0..ranks {
        for d in 0..ranks {
            let total: usize = (0..schedule.rounds()).map(|j| schedule.round_pair_rows(s, d, j)).sum();
            assert_eq!(total, schedule.pair_rows(s, d), "pair ({s}, {d}) rows split over the rounds");
            for j in 0..schedule.rounds() {
                assert!(schedule.round_pair_rows(s, d, j) <= q, "pair ({s}, {d}) round {j} over q = {q}");
            }
        }
    }
    if scheme == llep::Scheme::PipelinedLlep {
        assert_eq!(q, plan.pair_cap());
        assert!(schedule.max_rows_per_round() <= ranks * q);
    }
});
