//! Planner invariants over random and skewed routing: every route assigned exactly once, every
//! round's receive within P·q, foreign experts within F_max, spill chunks of at least m unless
//! they finish their expert, the same plan on every rank, and PipelinedLLEP's buffers identical
//! whatever the routing.

use flatpeak_common::testing::proptest_config;
use flatpeak_common::{DType, LocalGroup, LocalGroupOptions, SplitMix64};
use llep::{Buffers, Chunking, Config, PairCap, Pass, Schedule, Scheme, Shape, SpillSplit, cpu};

use llep::paper::Profile;
use proptest::prelude::*;

/// Ids with a fraction `hot` of routes on the first `h` experts, the rest uniform.
fn skewed_ids(shape: &Shape, hot: f64, h: usize, seed: u64) -> Vec<Vec<i64>> {
    let mut rng = SplitMix64::new(seed);
    let e = shape.experts as u64;
    (0..shape.ranks)
        .map(|_| {
            (0..shape.tokens * shape.top_k)
                .map(|_| if rng.next_f64() < hot { rng.below(h.min(shape.experts) as u64) } else { rng.below(e) } as i64)
                .collect()
        })
        .collect()
}

fn check_invariants(config: &Config, shape: &Shape, ids: &[Vec<i64>]) -> Result<Schedule, TestCaseError> {
    let views: Vec<&[i64]> = ids.iter().map(Vec::as_slice).collect();
    let plan = Schedule::from_top_k(&llep::Plan::new(config, *shape, llep::Budget::Unlimited)?, &views)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let a = plan.assignment();
    let (p, m) = (shape.ranks, shape.local_experts());
    // Every route exactly once: pieces cover each expert's load, shares cover each source's count,
    // and mapping every source's routes succeeds with nothing left over.
    for e in 0..shape.experts {
        let pieces = a.pieces(e);
        prop_assert_eq!(pieces.iter().map(|x| x.routes).sum::<usize>(), a.counts().load(e));
        for s in 0..p {
            prop_assert_eq!((0..pieces.len()).map(|q| a.share(e, s, q)).sum::<usize>(), a.counts().get(s, e));
        }
        // Spill chunks: at least m unless they are the expert's last piece.
        for (q, piece) in pieces.iter().enumerate() {
            if piece.rank != e / m && q + 1 < pieces.len() {
                prop_assert!(piece.routes >= config.min_chunk, "expert {e} piece {q}: {piece:?}");
            }
        }
    }
    prop_assert_eq!((0..p).map(|d| a.rank_load(d)).sum::<usize>(), a.counts().total());
    for (s, rank_ids) in ids.iter().enumerate() {
        let mut mapper = a.mapper(s);
        let mut per_dest = vec![0usize; p];
        for &id in rank_ids {
            per_dest[mapper.next(id as usize).map_err(|e| TestCaseError::fail(e.to_string()))?] += 1;
        }
        for (d, &routes) in per_dest.iter().enumerate() {
            prop_assert_eq!(routes, a.pair_routes(s, d));
        }
        for e in 0..shape.experts {
            prop_assert!(mapper.next(e).is_err(), "source {s} expert {e}: an extra route was mapped");
        }
    }
    // Foreign experts within F_max (PipelinedLLEP), and each transfer lands in its slot.
    if config.scheme == Scheme::PipelinedLlep {
        prop_assert!(a.max_foreign() <= config.foreign_slots);
    }
    for t in a.transfers() {
        prop_assert_eq!(a.local_slot(t.helper, t.expert), Some(m + t.slot));
    }
    // Rounds: every pair ≤ q, every receive ≤ P·q, and the rounds deal each pair's rows once.
    let q = plan.pair_cap();
    for j in 0..plan.rounds() {
        let round = plan.round_matrix(j);
        prop_assert!(round.iter().all(|&r| r <= q));
        for d in 0..p {
            prop_assert!((0..p).map(|s| round[s * p + d]).sum::<usize>() <= p * q);
        }
    }
    for s in 0..p {
        for d in 0..p {
            let mut seen = vec![false; plan.pair_rows(s, d)];
            for j in 0..plan.rounds() {
                for r in plan.round_row_indices(s, d, j) {
                    prop_assert!(!seen[r]);
                    seen[r] = true;
                }
            }
            prop_assert!(seen.iter().all(|&x| x));
        }
    }
    prop_assert!(plan.max_rows_per_round() <= p * q);
    // PipelinedLLEP's buffers are the launch-time ones, whatever the routing.
    if config.scheme == Scheme::PipelinedLlep {
        for pass in [Pass::Forward, Pass::Backward] {
            let launch = llep::Plan::new(config, *shape, llep::Budget::Unlimited)
                .map(|plan| plan.buffers(pass))
                .unwrap();
            for d in 0..p {
                prop_assert_eq!(plan.buffers(d, pass), launch);
            }
        }
    }
    Ok(plan)
}

fn config_strategy() -> impl Strategy<Value = Config> {
    (
        prop_oneof![Just(Scheme::PipelinedLlep), Just(Scheme::Llep), Just(Scheme::StandardEp)],
        1usize..24,
        0usize..4,
        1usize..12,
        prop_oneof![Just(0.5), Just(1.0), Just(1.5)],
        prop_oneof![Just(0.0), Just(1.3)],
        prop_oneof![Just(SpillSplit::Proportional), Just(SpillSplit::Position)],
        prop_oneof![Just(Chunking::Strided), Just(Chunking::Contiguous)],
    )
        .prop_map(|(scheme, m, f, q, alpha, lambda, split, chunking)| {
            Config::with_scheme(scheme)
                .min_chunk(m)
                .foreign_slots(f)
                .pair_cap(PairCap::Rows(q))
                .alpha(alpha)
                .imbalance_threshold(lambda)
                .spill_split(split)
                .chunking(chunking)
        })
}

fn shape_strategy() -> impl Strategy<Value = Shape> {
    (prop_oneof![Just(1usize), Just(2), Just(3), Just(4), Just(8)], 1usize..5, 1usize..9, 0usize..48)
        .prop_map(|(p, m, k, n)| Shape {
            ranks: p,
            tokens: n,
            hidden: 8,
            intermediate: 4,
            experts: p * m,
            top_k: k,
            dtype: DType::F32,
        })
}

proptest! {
    #![proptest_config(proptest_config(256))]

    #[test]
    fn planner_invariants(
        config in config_strategy(),
        shape in shape_strategy(),
        hot in prop_oneof![Just(0.0), Just(0.5), Just(0.95), Just(1.0)],
        h in 1usize..4,
        seed in any::<u64>(),
    ) {
        let ids = skewed_ids(&shape, hot, h, seed);
        check_invariants(&config, &shape, &ids)?;
    }
}

proptest! {
    #![proptest_config(proptest_config(24))]

    /// Each rank plans from its own ids and the all-gathered counts: all plans are equal, and
    /// equal to the plan made from every rank's ids at once.
    #[test]
    fn same_plan_from_every_rank(config in config_strategy(), shape in shape_strategy(), seed in any::<u64>()) {
        let ids = skewed_ids(&shape, 0.6, 2, seed);
        let weights: Vec<Vec<f32>> = (0..shape.ranks).map(|_| vec![0.5; shape.tokens * shape.top_k]).collect();
        let views: Vec<&[i64]> = ids.iter().map(Vec::as_slice).collect();
        let plan = llep::Plan::new(&config, shape, llep::Budget::Unlimited).expect("plan");
        let whole = Schedule::from_top_k(&plan, &views).unwrap();
        let plans = LocalGroup::run(shape.ranks, LocalGroupOptions::default(), |comm| {
            use flatpeak_common::Communicator;
            let r = comm.rank();
            Ok(cpu::schedule(comm, &plan, &llep::Routing { ids: &ids[r], weights: &weights[r] }))
        });
        for plan in plans {
            prop_assert_eq!(&plan.unwrap().unwrap(), &whole);
        }
    }
}

/// The bench shape: balanced, 50%:4, 95%:1 and 100%:1 all fit the same launch-time buffers;
/// skew costs rounds, not bytes.
#[test]
fn skew_costs_rounds_not_bytes() {
    let shape = Shape {
        ranks: 8,
        tokens: 4096,
        hidden: 512,
        intermediate: 256,
        experts: 64,
        top_k: 8,
        dtype: DType::F32,
    };
    let config = Config::default().pair_cap(PairCap::Rows(256));
    let mut rounds = Vec::new();
    for profile in ["balanced", "50:4", "95:1", "100:1"] {
        let profile: Profile = profile.parse().unwrap();
        let ids: Vec<Vec<i64>> = (0..8).map(|_| profile.ids(&Shape { ranks: 1, ..shape }).unwrap()).collect();
        let plan = check_invariants(&config, &shape, &ids).unwrap();
        rounds.push((profile.to_string(), plan.rounds(), plan.assignment().max_foreign()));
    }
    println!("(profile, K, foreign experts): {rounds:?}");
    let launch = llep::Plan::new(&config, shape, llep::Budget::Unlimited)
        .map(|plan| plan.buffers(Pass::Backward))
        .unwrap();
    assert_eq!(launch.recv_rows(), 8 * 256);
    assert!(rounds.iter().all(|&(_, k, f)| k >= 1 && f <= config.foreign_slots), "{rounds:?}");
}

/// `PairCap::FitBudget` (the default) gives the largest q whose workspace — both passes, every
/// pipeline copy — fits the plan's budget (never more than N), `PairCap::Rows` is checked
/// against it, and a budget below one row per pair is `Error::BudgetTooSmall` with both figures.
#[test]
fn a_budget_gives_the_largest_pair_cap_that_fits() {
    let shape = Shape {
        ranks: 4,
        tokens: 1000,
        hidden: 64,
        intermediate: 32,
        experts: 8,
        top_k: 2,
        dtype: DType::F32,
    };
    for depth in [1, 2, 3] {
        let base = Config::default().pipeline_depth(depth);
        let bytes_at = |q: usize| {
            let pass = |pass| Buffers::pipelined(&base, &shape, q, pass).workspace_bytes();
            pass(Pass::Forward).max(pass(Pass::Backward))
        };
        let one_row = bytes_at(1);
        assert_eq!(llep::Plan::least_workspace_bytes(&base, &shape), Ok(one_row));
        for bytes in [one_row, 7 * one_row + 5, 1 << 20, 1 << 30] {
            let plan = llep::Plan::new(&base, shape, llep::Budget::Bytes(bytes)).expect("plan");
            let q = plan.pair_cap();
            assert_eq!(plan.buffers(Pass::Backward).recv_rows(), shape.ranks * q);
            assert!(
                plan.workspace_bytes() <= bytes,
                "depth {depth}, {bytes} B: q = {q} needs {}",
                bytes_at(q)
            );
            assert_eq!(plan.workspace_bytes(), bytes_at(q));
            assert!(
                q == shape.tokens || bytes_at(q + 1) > bytes,
                "depth {depth}, {bytes} B: q = {q} is not the largest"
            );
            assert_eq!(plan.buffers(Pass::Forward).depth(), depth);
        }
        let unlimited = llep::Plan::new(&base, shape, llep::Budget::Unlimited).expect("plan");
        assert_eq!(unlimited.pair_cap(), shape.tokens, "a pair never needs more than N rows");
        let err = llep::Plan::new(&base, shape, llep::Budget::Bytes(one_row - 1)).unwrap_err();
        assert_eq!(
            err,
            llep::Error::BudgetTooSmall {
                budget: one_row - 1,
                needed: one_row,
                what: "one row per rank pair"
            }
        );
        let fixed = base.pair_cap(PairCap::Rows(8));
        assert_eq!(
            llep::Plan::new(&fixed, shape, llep::Budget::Bytes(bytes_at(8))).expect("plan").pair_cap(),
            8
        );
        assert!(matches!(
            llep::Plan::new(&fixed, shape, llep::Budget::Bytes(bytes_at(8) - 1)),
            Err(llep::Error::BudgetTooSmall { what: "the pair cap's buffers", .. })
        ));
    }
    let huge = Shape { tokens: usize::MAX / 2, hidden: usize::MAX / 4, ..shape };
    assert!(matches!(
        llep::Plan::new(&Config::default(), huge, llep::Budget::Unlimited),
        Err(llep::Error::Common(flatpeak_common::Error::SizeOverflow { .. }))
    ));
}

/// Sizes past `usize`: a shape whose output (N·H·4 bytes) or route tables (8·N·k) overflow is
/// refused by every scheme's plan, and a baseline plan (sized per call) or a rounds count past
/// `usize` reads `usize::MAX` from the byte accessors instead of panicking or wrapping.
#[test]
fn sizes_past_usize_are_refused_or_saturate() {
    let base = Shape {
        ranks: 2,
        tokens: 1 << 62,
        hidden: 8,
        intermediate: 4,
        experts: 4,
        top_k: 2,
        dtype: DType::F32,
    };
    for scheme in [Scheme::PipelinedLlep, Scheme::Llep, Scheme::StandardEp] {
        let config = Config::default().scheme(scheme);
        let err = llep::Plan::new(&config, base, llep::Budget::Unlimited).unwrap_err();
        assert!(
            matches!(
                err,
                llep::Error::Common(flatpeak_common::Error::SizeOverflow {
                    what: "llep output (N·H·4 bytes)"
                })
            ),
            "{scheme:?}: {err}"
        );
    }
    // The output fits, the experts' weights and the per-row bytes do not: a baseline's plan is
    // made (its buffers are sized per call) and its accessors saturate.
    let wide = Shape { tokens: 1, hidden: 1 << 60, intermediate: 1 << 60, ..base };
    let plan = llep::Plan::new(&Config::default().scheme(Scheme::Llep), wide, llep::Budget::Unlimited)
        .expect("plan");
    for pass in [Pass::Forward, Pass::Backward] {
        let b = plan.buffers(pass);
        assert_eq!(b.foreign_weight_bytes(), usize::MAX, "{pass:?}");
        assert_eq!(b.expert_intermediate_bytes(), usize::MAX, "{pass:?}");
        assert_eq!(b.workspace_bytes(), usize::MAX, "{pass:?}");
        assert!(b.checked_workspace_bytes().is_err());
        assert_eq!(b.saved_activation_bytes(llep::Mode::SaveActivations, usize::MAX), usize::MAX);
    }
    assert_eq!(wide.expert_elems(), usize::MAX);
    assert_eq!(Buffers::dispatch_bytes_per_row(&wide, Pass::Backward), usize::MAX);
}
