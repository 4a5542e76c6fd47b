//! The CPU executor against the dense f64 reference, over P ∈ {1, 2, 4, 8}, top-k 1..8, the
//! harness profiles (balanced, 50%:4, 95%:1, 100% on one expert), random ids with duplicates
//! (each the same as one route with the summed weight), and all three schemes, checkpointed and
//! saving activations; and bad input → typed errors.

mod common;

use common::{Ids, Problem, RankRun, run, run_saved, small_config};
use flatpeak_common::{DType, relative_error};
use llep::{Mode, Pass, Scheme, Shape};

use llep::paper::Profile;

const TOL: f64 = 1e-5;

fn shape(p: usize, k: usize) -> Shape {
    Shape { ranks: p, tokens: 13, hidden: 16, intermediate: 8, experts: 16, top_k: k, dtype: DType::F32 }
}

fn check(problem: &Problem, scheme: Scheme, what: &str) {
    let results = run(problem, &small_config(scheme));
    if results.iter().any(Result::is_err) {
        panic!("{what} {scheme:?}: {:?}", results.iter().map(|r| r.as_ref().err()).collect::<Vec<_>>());
    }
    let runs: Vec<_> = results.into_iter().flatten().collect();
    check_runs(problem, &runs, scheme, what);
}

fn check_runs(problem: &Problem, runs: &[RankRun], scheme: Scheme, what: &str) {
    let (y_ref, g_ref) = problem.reference();
    let y: Vec<f32> = runs.iter().flat_map(|r| r.y.iter().copied()).collect();
    let cat = |f: fn(&common::RankRun) -> &Vec<f32>| {
        runs.iter().flat_map(|r| f(r).iter().copied()).collect::<Vec<f32>>()
    };
    // Weight gradients in llep's own layout, whatever layout the problem ran in.
    let split: Vec<[Vec<f32>; 3]> = runs.iter().map(|r| problem.split_grads(&r.grads)).collect();
    let part = |p: usize| split.iter().flat_map(|g| g[p].iter().copied()).collect::<Vec<f32>>();
    let errors = [
        ("y", relative_error(&y, &y_ref)),
        ("dx", relative_error(&cat(|r| &r.grads.dx), &g_ref.dx)),
        ("d_weights", relative_error(&cat(|r| &r.grads.d_weights), &g_ref.d_weights)),
        ("d_gate", relative_error(&part(0), &g_ref.d_gate)),
        ("d_up", relative_error(&part(1), &g_ref.d_up)),
        ("d_down", relative_error(&part(2), &g_ref.d_down)),
    ];
    for (name, err) in errors {
        assert!(err <= TOL, "{what} {scheme:?}: {name} relative error {err:.3e}");
    }
    // Every rank planned the same thing.
    assert!(runs.iter().all(|r| r.plan == runs[0].plan), "{what}: plans differ across ranks");
    for (s, r) in runs.iter().enumerate() {
        if problem.tokens_of(s) == problem.shape.tokens {
            assert_eq!(r.high_water, r.workspace_bytes, "{what}: carved bytes differ from the plan's");
        } else {
            // Fewer tokens than planned: smaller route tables, within the same reservation.
            assert!(r.high_water <= r.workspace_bytes, "{what}: rank {s} carved more than the plan's");
        }
    }
}

/// Weights in torch's layout (gate_up `[M][2I][H]`, down `[M][H][I]`, read in place): every scheme
/// and both modes match the reference, with experts spilled to other ranks (their weights
/// fetched and their gradients returned in that layout), in f32.
#[test]
fn torch_weight_layout_matches_the_reference() {
    for profile in [Profile::Balanced, Profile::Hot { ratio: 0.95, experts: 1 }] {
        let problem = Problem::new(shape(4, 2), Ids::Profile(profile), 23).in_linear_layout();
        for scheme in [Scheme::PipelinedLlep, Scheme::Llep, Scheme::StandardEp] {
            let config = small_config(scheme).weight_layout(llep::WeightLayout::Linear);
            let runs = unwrap_all(run(&problem, &config), "linear");
            check_runs(&problem, &runs, scheme, &format!("linear {profile:?}"));
            if scheme == Scheme::PipelinedLlep {
                let saved = unwrap_all(run_saved(&problem, &config), "linear saved");
                check_runs(&problem, &saved, scheme, &format!("linear saved {profile:?}"));
                if matches!(profile, Profile::Hot { .. }) {
                    assert!(!runs[0].plan.assignment().transfers().is_empty(), "a spilled expert travels");
                }
            }
        }
    }
}

fn unwrap_all(results: Vec<llep::Result<RankRun>>, what: &str) -> Vec<RankRun> {
    if results.iter().any(Result::is_err) {
        panic!("{what}: {:?}", results.iter().map(|r| r.as_ref().err()).collect::<Vec<_>>());
    }
    results.into_iter().flatten().collect()
}

/// Each rank brings its own batch, up to the plan's N (one brings none): every scheme matches
/// the dense reference over all ranks' tokens, under balanced and hot-expert routing.
#[test]
fn ranks_with_different_token_counts_match_the_reference() {
    for profile in [Profile::Balanced, Profile::Hot { ratio: 0.95, experts: 1 }] {
        for scheme in [Scheme::PipelinedLlep, Scheme::Llep, Scheme::StandardEp] {
            let mut problem = Problem::new(shape(4, 2), Ids::Profile(profile), 17);
            for (s, n) in [(1, 0), (2, 5), (3, 12)] {
                problem.truncate(s, n);
            }
            check(&problem, scheme, &format!("ragged {profile:?}"));
        }
    }
}

#[test]
fn matches_reference_across_ranks_topk_and_profiles() {
    let profiles = [
        Ids::Profile(Profile::Balanced),
        Ids::Profile(Profile::Hot { ratio: 0.5, experts: 4 }),
        Ids::Profile(Profile::Hot { ratio: 0.95, experts: 1 }),
        Ids::Profile(Profile::Hot { ratio: 1.0, experts: 1 }),
        Ids::Random,
    ];
    for p in [1, 2, 4, 8] {
        for k in 1..=8 {
            for (n, ids) in profiles.iter().enumerate() {
                let problem = Problem::new(shape(p, k), *ids, (p * 100 + k * 10 + n) as u64);
                check(&problem, Scheme::PipelinedLlep, &format!("P={p} k={k} {ids:?}"));
            }
        }
    }
}

#[test]
fn saved_activations_match_reference_and_stay_in_their_bound() {
    let profiles = [
        Ids::Profile(Profile::Balanced),
        Ids::Profile(Profile::Hot { ratio: 0.5, experts: 4 }),
        Ids::Profile(Profile::Hot { ratio: 1.0, experts: 1 }),
        Ids::Random,
    ];
    let cases =
        [(Scheme::PipelinedLlep, vec![1, 2, 4, 8]), (Scheme::Llep, vec![4]), (Scheme::StandardEp, vec![4])];
    for (scheme, ranks) in cases {
        for p in ranks {
            for k in [1, 3, 8] {
                for (n, ids) in profiles.iter().enumerate() {
                    let what = format!("saved P={p} k={k} {ids:?}");
                    let problem = Problem::new(shape(p, k), *ids, (p * 100 + k * 10 + n) as u64);
                    let config = small_config(scheme);
                    let saved: Vec<_> =
                        run_saved(&problem, &config).into_iter().map(|r| r.unwrap()).collect();
                    check_runs(&problem, &saved, scheme, &what);
                    // Forward is the same call whatever it keeps: bitwise the same y.
                    let plain: Vec<_> = run(&problem, &config).into_iter().map(|r| r.unwrap()).collect();
                    for (me, (a, b)) in saved.iter().zip(&plain).enumerate() {
                        assert_eq!(a.y, b.y, "{what}: rank {me} y differs from the checkpointed run");
                        let plan = &a.plan;
                        let bound = plan
                            .buffers(me, Pass::Backward)
                            .saved_activation_bytes(Mode::SaveActivations, plan.rounds());
                        assert!(plan.saved_bytes(me) <= bound, "{what}: {} > {bound}", plan.saved_bytes(me));
                        assert_eq!(b.plan.saved_bytes(me), 0, "{what}: checkpointed keeps nothing");
                    }
                }
            }
        }
    }
}

#[test]
fn saved_activations_misuse_is_a_typed_error() {
    use flatpeak_common::{Communicator, Device, LocalGroup, LocalGroupOptions};
    use llep::{Error, Executor};
    let problem = Problem::new(shape(2, 2), Ids::Random, 11);
    let out = LocalGroup::run(2, LocalGroupOptions::default(), |comm| {
        let me = comm.rank();
        let inputs = problem.inputs(me);
        let checkpointed = small_config(Scheme::PipelinedLlep);
        let saving = checkpointed.mode(Mode::SaveActivations);
        let plain = llep::cpu::schedule(
            comm,
            &llep::Plan::new(&checkpointed, problem.shape, llep::Budget::Unlimited).expect("plan"),
            &inputs.routing,
        )
        .unwrap();
        let plan = llep::cpu::schedule(
            comm,
            &llep::Plan::new(&saving, problem.shape, llep::Budget::Unlimited).expect("plan"),
            &inputs.routing,
        )
        .unwrap();
        let launch = llep::Plan::new(&saving, problem.shape, llep::Budget::Unlimited).expect("plan");
        let mut layer = Executor::new(launch, Device::Cpu).unwrap();
        let store_for_checkpointed = llep::cpu::SavedActivations::new(&plain, me).map(|_| ());
        let mut saved = llep::cpu::SavedActivations::new(&plan, me).unwrap();
        let unfilled = layer.backward_saved(comm, &plan, &inputs, &problem.dy[me], &mut saved).map(|_| ());
        let recompute = layer.backward(comm, &plan, &inputs, &problem.dy[me]).map(|_| ());
        Ok((store_for_checkpointed, unfilled, recompute))
    });
    for r in out {
        let (store, unfilled, recompute) = r.unwrap();
        assert!(matches!(store, Err(Error::InvalidConfig { field: "mode", .. })), "{store:?}");
        assert!(matches!(unfilled, Err(Error::ScheduleMismatch { .. })), "{unfilled:?}");
        assert!(matches!(recompute, Err(Error::InvalidConfig { field: "mode", .. })), "{recompute:?}");
    }
}

/// A store over the caller's memory (`SavedActivations::from_raw`, how a framework keeps it as a
/// tensor) serves a backward from a copy of its bytes elsewhere (a saved tensor an offload hook
/// moved): y and the gradients are bitwise those of the crate's own store; a store too small is
/// a typed error.
#[test]
fn a_store_in_caller_memory_serves_a_backward_from_a_copy_of_its_bytes() {
    use flatpeak_common::{Communicator, Device, LocalGroup, LocalGroupOptions};
    use llep::Executor;
    use llep::cpu::SavedActivations;

    /// 64-byte aligned caller memory, as a tensor's.
    #[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
    #[repr(C, align(64))]
    struct Line([u8; 64]);
    fn lines(bytes: usize) -> Vec<Line> {
        vec![Line([0; 64]); bytes.div_ceil(64)]
    }
    fn bytes_of(v: &mut [Line]) -> &mut [u8] {
        bytemuck::cast_slice_mut(v)
    }

    let problem = Problem::new(shape(2, 2), Ids::Random, 17);
    let config = small_config(Scheme::PipelinedLlep).mode(Mode::SaveActivations);
    let out = LocalGroup::run(2, LocalGroupOptions::default(), |comm| {
        Ok((|| -> llep::Result<_> {
            let me = comm.rank();
            let inputs = problem.inputs(me);
            let launch = llep::Plan::new(&config, problem.shape, llep::Budget::Unlimited).expect("plan");
            let mut layer = Executor::new(launch, Device::Cpu)?;
            let plan = layer.schedule(comm, &inputs.routing)?;
            let bytes = SavedActivations::bytes_for(&plan, me);
            assert_eq!(bytes % 64, 0);
            let mut owned = SavedActivations::new(&plan, me)?;
            let y_owned = layer.forward_saving(comm, &plan, &inputs, &mut owned)?;
            let g_owned = layer.backward_saved(comm, &plan, &inputs, &problem.dy[me], &mut owned)?;
            let mut memory = lines(bytes);
            let mut lent = SavedActivations::over(&plan, me, bytes_of(&mut memory))?;
            let y_lent = layer.forward_saving(comm, &plan, &inputs, &mut lent)?;
            drop(lent);
            let mut moved = memory.clone();
            drop(memory);
            let mut from_copy = SavedActivations::over(&plan, me, bytes_of(&mut moved))?;
            let g_copy = layer.backward_saved(comm, &plan, &inputs, &problem.dy[me], &mut from_copy)?;
            drop(from_copy);
            let mut short = lines(bytes - 64);
            let too_small = SavedActivations::over(&plan, me, bytes_of(&mut short)).map(|_| ());
            let mut unaligned = lines(bytes + 64);
            let off_line = SavedActivations::over(&plan, me, &mut bytes_of(&mut unaligned)[1..]).map(|_| ());
            Ok((y_owned == y_lent, g_owned == g_copy, too_small, off_line))
        })())
    });
    for r in out {
        let (same_y, same_grads, too_small, off_line) = r.unwrap().unwrap();
        assert!(same_y && same_grads);
        assert!(matches!(too_small, Err(llep::Error::Common(flatpeak_common::Error::ShapeMismatch { .. }))));
        assert!(off_line.is_err(), "a store off a 64-byte line is refused");
    }
}

/// Duplicate ids in one token's top-k are routes of their own, and together they are the one
/// route with the summed weight: moving every duplicate's weight onto the token's first slot
/// with that expert (the duplicate keeps its id at weight 0) leaves y, dX, the expert
/// gradients and d(weights) the same (d(weights) of a slot is ⟨dY, expert(x)⟩ either way).
#[test]
fn duplicate_ids_are_one_route_with_the_summed_weight() {
    let k = 4;
    for p in [1, 4] {
        let mut problem = Problem::new(shape(p, k), Ids::Random, 31 + p as u64);
        for ids in &mut problem.ids {
            ids[1] = ids[0]; // at least one duplicate per rank, whatever the draw
        }
        let config = small_config(Scheme::PipelinedLlep);
        let split: Vec<RankRun> = run(&problem, &config).into_iter().map(|r| r.unwrap()).collect();
        let mut moved = 0;
        for (ids, weights) in problem.ids.iter().zip(&mut problem.weights) {
            for (token_ids, token_w) in ids.chunks(k).zip(weights.chunks_mut(k)) {
                for j in 1..k {
                    if let Some(first) = (0..j).find(|&i| token_ids[i] == token_ids[j]) {
                        token_w[first] += token_w[j];
                        token_w[j] = 0.0;
                        moved += 1;
                    }
                }
            }
        }
        assert!(moved >= p, "P={p}: only {moved} duplicates");
        let merged: Vec<RankRun> = run(&problem, &config).into_iter().map(|r| r.unwrap()).collect();
        for (me, (a, b)) in split.iter().zip(&merged).enumerate() {
            let what = format!("P={p} rank {me} ({moved} duplicates)");
            for (name, x, y) in [
                ("y", &a.y, &b.y),
                ("dx", &a.grads.dx, &b.grads.dx),
                ("d_weights", &a.grads.d_weights, &b.grads.d_weights),
                ("d_gate", &a.grads.d_gate, &b.grads.d_gate),
                ("d_up", &a.grads.d_up, &b.grads.d_up),
                ("d_down", &a.grads.d_down, &b.grads.d_down),
            ] {
                let err = relative_error(x, &y.iter().map(|&v| v as f64).collect::<Vec<_>>());
                assert!(err <= TOL, "{what}: {name} relative error {err:.3e}");
            }
        }
    }
}

#[test]
fn baselines_match_reference() {
    for scheme in [Scheme::StandardEp, Scheme::Llep] {
        for p in [1, 4] {
            for ids in [Ids::Profile(Profile::Hot { ratio: 1.0, experts: 1 }), Ids::Random] {
                let problem = Problem::new(shape(p, 3), ids, 7 + p as u64);
                check(&problem, scheme, &format!("P={p} {ids:?}"));
            }
        }
    }
}

/// An edit of rank 1's ids, weights, x and dY.
type Edit = dyn Fn(&mut Vec<i64>, &mut Vec<f32>, &mut Vec<f32>, &mut Vec<f32>) + Sync;

/// Runs plan + forward + backward on every rank, letting `edit` corrupt rank 1's ids, weights,
/// x or dY first; returns each rank's outcome.
fn run_edited(problem: &Problem, edit: &Edit) -> Vec<llep::Result<()>> {
    use flatpeak_common::{Communicator, Device, LocalGroup, LocalGroupOptions};
    LocalGroup::run(problem.shape.ranks, LocalGroupOptions::default(), |comm| {
        let me = comm.rank();
        let base = problem.inputs(me);
        let (mut ids, mut w, mut x, mut dy) = (
            base.routing.ids.to_vec(),
            base.routing.weights.to_vec(),
            base.x.to_vec(),
            problem.dy[me].clone(),
        );
        if me == 1 {
            edit(&mut ids, &mut w, &mut x, &mut dy);
        }
        let inputs = llep::RankInputs { x: &x, routing: llep::Routing { ids: &ids, weights: &w }, ..base };
        Ok((|| {
            let config = small_config(Scheme::PipelinedLlep);
            let launch = llep::Plan::new(&config, problem.shape, llep::Budget::Unlimited).expect("plan");
            let mut layer = llep::Executor::new(launch, Device::Cpu)?;
            let plan = layer.schedule(comm, &inputs.routing)?;
            layer.forward(comm, &plan, &inputs)?;
            layer.backward(comm, &plan, &inputs, &dy)?;
            Ok(())
        })())
    })
    .into_iter()
    .map(|r| r.map_err(llep::Error::from).and_then(|inner| inner))
    .collect()
}

#[test]
fn bad_input_is_a_typed_error_on_its_rank_and_fails_the_group() {
    use flatpeak_common::Error as Common;
    use llep::Error;
    let problem = Problem::new(shape(4, 2), Ids::Random, 5);
    let cases: Vec<(&str, Box<Edit>, Error)> = vec![
        (
            "id ≥ E",
            Box::new(|ids, _, _, _| ids[5] = 16),
            Error::ExpertOutOfRange { token: 2, slot: 1, expert: 16, experts: 16 },
        ),
        (
            "negative id",
            Box::new(|ids, _, _, _| ids[0] = -3),
            Error::NegativeExpert { token: 0, slot: 0, expert: -3 },
        ),
        (
            "NaN weight",
            Box::new(|_, w, _, _| w[3] = f32::NAN),
            Error::NonFiniteWeight { token: 1, slot: 1, value: f32::NAN },
        ),
        (
            "short ids",
            Box::new(|ids, _, _, _| {
                ids.pop();
            }),
            Error::ShapeMismatch { what: "top-k ids (n·k, for n ≤ N tokens)", expected: 26, got: 25 },
        ),
        (
            "short x",
            Box::new(|_, _, x, _| {
                x.pop();
            }),
            Error::ShapeMismatch { what: "x (N·H)", expected: 208, got: 207 },
        ),
        (
            "short dY",
            Box::new(|_, _, _, dy| {
                dy.pop();
            }),
            Error::ShapeMismatch { what: "dY (n·H)", expected: 208, got: 207 },
        ),
    ];
    for (what, edit, want) in cases {
        let out = run_edited(&problem, &*edit);
        match (&out[1], &want) {
            (
                Err(Error::NonFiniteWeight { token, slot, value }),
                Error::NonFiniteWeight { token: t, slot: s, .. },
            ) => {
                assert!(token == t && slot == s && value.is_nan(), "{what}: {:?}", out[1]);
            }
            (got, want) => assert_eq!(got.as_ref().unwrap_err(), want, "{what}"),
        }
        // A bad routing is agreed on before the first exchange: every peer gets rank 1's error
        // (with its message); a bad x or dY is found later, and the peers see rank 1 leave.
        let message = out[1].as_ref().unwrap_err().to_string();
        for r in [0, 2, 3] {
            match &out[r] {
                Err(Error::Common(Common::PeerInput { rank: 1, message: m, .. })) => {
                    assert!(what.contains("ids") || what.contains("weight") || what.contains("id"), "{what}");
                    assert_eq!(m, &message, "{what}: rank {r}");
                }
                Err(Error::Common(Common::PeerLost { rank: 1 })) => {
                    assert!(what.contains("x") || what.contains("dY"), "{what}: rank {r} was left waiting");
                }
                other => panic!("{what}: rank {r}: {other:?}"),
            }
        }
    }
}

#[test]
fn misuse_is_a_typed_error() {
    use flatpeak_common::{Device, LocalGroup, LocalGroupOptions};
    use llep::{Config, Error, Executor, PairCap, Schedule};
    let problem = Problem::new(shape(2, 2), Ids::Random, 9);
    let other = Problem::new(shape(2, 2), Ids::Profile(Profile::Hot { ratio: 1.0, experts: 1 }), 9);
    let config = small_config(Scheme::PipelinedLlep);
    let launch = llep::Plan::new(&config, problem.shape, llep::Budget::Unlimited).expect("plan");
    let wider = llep::Plan::new(&config.pair_cap(PairCap::Rows(5)), problem.shape, llep::Budget::Unlimited);
    let wider = wider.expect("plan");
    let views: Vec<&[i64]> = other.ids.iter().map(Vec::as_slice).collect();
    let stale = Schedule::from_top_k(&launch, &views).unwrap();
    let out = LocalGroup::run(2, LocalGroupOptions::default(), |comm| {
        use flatpeak_common::Communicator;
        let inputs = problem.inputs(comm.rank());
        let mut layer = Executor::new(launch, Device::Cpu).unwrap();
        let stale_run = layer.forward(comm, &stale, &inputs).map(|_| ());
        let plan = layer.schedule(comm, &inputs.routing).unwrap();
        let mut tiny = Executor::with_workspace_bytes(launch, Device::Cpu, 1024).unwrap();
        let tiny_run = tiny.forward(comm, &plan, &inputs).map(|_| ());
        let other_plan = Executor::new(wider, Device::Cpu).unwrap().schedule(comm, &inputs.routing).unwrap();
        let foreign_run = layer.forward(comm, &other_plan, &inputs).map(|_| ());
        Ok((stale_run, tiny_run, foreign_run))
    });
    for r in out {
        let (stale_run, tiny_run, foreign_run) = r.unwrap();
        assert!(matches!(stale_run, Err(Error::ScheduleMismatch { .. })), "{stale_run:?}");
        assert!(
            matches!(tiny_run, Err(Error::Common(flatpeak_common::Error::WorkspaceExhausted { .. }))),
            "{tiny_run:?}"
        );
        assert!(matches!(foreign_run, Err(Error::ScheduleMismatch { .. })), "{foreign_run:?}");
    }
    // A plan for another group size, an uneven expert split, a dtype the CPU does not run.
    let one = LocalGroup::run(1, LocalGroupOptions::default(), |comm| {
        let inputs = problem.inputs(0);
        Ok(llep::cpu::schedule(
            comm,
            &llep::Plan::new(&config, problem.shape, llep::Budget::Unlimited).expect("plan"),
            &inputs.routing,
        )
        .map(|_| ()))
    });
    assert!(matches!(one[0], Ok(Err(Error::ScheduleMismatch { what: "ranks", planned: 2, found: 1 }))));
    let uneven = Shape { ranks: 3, ..problem.shape };
    assert!(matches!(uneven.validate(), Err(Error::ExpertsNotDivisible { experts: 16, ranks: 3 })));
    // f32 tensors handed to a bf16 plan, and an f16 plan (no backend runs f16).
    for (dtype, want) in [(DType::Bf16, "mismatch"), (DType::F16, "unsupported")] {
        let shape = Shape { dtype, ..problem.shape };
        let plan = Schedule::from_top_k(
            &llep::Plan::new(&Config::default(), shape, llep::Budget::Unlimited).expect("plan"),
            &views,
        )
        .unwrap();
        let run = LocalGroup::run(2, LocalGroupOptions::default(), |comm| {
            use flatpeak_common::Communicator;
            let launch = llep::Plan::new(&Config::default(), shape, llep::Budget::Unlimited).expect("plan");
            let mut layer = Executor::new(launch, Device::Cpu).unwrap();
            Ok(layer.forward(comm, &plan, &problem.inputs(comm.rank())).map(|_| ()))
        });
        for r in &run {
            match (want, r) {
                (
                    "mismatch",
                    Ok(Err(Error::DtypeMismatch { expected: DType::Bf16, found: DType::F32, .. })),
                ) => {}
                ("unsupported", Ok(Err(Error::UnsupportedDtype { dtype: DType::F16, .. }))) => {}
                _ => panic!("{dtype}: expected a {want} error, got {r:?}"),
            }
        }
    }
}

/// Fault injection: one rank's communicator fails at each of its operations in turn (routing
/// exchange, dispatch rounds, combine, backward). The failing rank returns the injected error,
/// every rank returns (a short group timeout fails a hang), and a run on a fresh group
/// afterwards matches the reference.
#[test]
fn a_rank_failing_at_any_dispatch_step_fails_promptly_and_the_next_run_is_exact() {
    use flatpeak_common::testing::FaultyComm;
    use flatpeak_common::{Communicator, Device, LocalGroup, LocalGroupOptions};
    let problem = Problem::new(shape(4, 2), Ids::Random, 41);
    let config = small_config(Scheme::PipelinedLlep);
    let options = LocalGroupOptions::with_timeout(std::time::Duration::from_secs(20));
    for failing in 0..4 {
        let mut fail_at = 0;
        loop {
            let endpoints = LocalGroup::endpoints(4, options).expect("group");
            let results: Vec<llep::Result<usize>> = std::thread::scope(|scope| {
                let handles: Vec<_> = endpoints
                    .into_iter()
                    .map(|comm| {
                        let (problem, config) = (&problem, &config);
                        scope.spawn(move || {
                            let me = comm.rank();
                            let comm =
                                FaultyComm::new(comm, if me == failing { fail_at } else { usize::MAX });
                            let inputs = problem.inputs(me);
                            let launch = llep::Plan::new(config, problem.shape, llep::Budget::Unlimited)?;
                            let mut layer = llep::Executor::new(launch, Device::Cpu)?;
                            let plan = layer.schedule(&comm, &inputs.routing)?;
                            layer.forward(&comm, &plan, &inputs)?;
                            layer.backward(&comm, &plan, &inputs, &problem.dy[me])?;
                            Ok(comm.ops())
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().expect("no panic")).collect()
            });
            let what = format!("rank {failing} failing at operation {fail_at}");
            match &results[failing] {
                Ok(ops) => {
                    assert!(*ops <= fail_at && fail_at > 2, "{what}");
                    assert!(results.iter().all(|r| r.is_ok()), "{what}");
                    break;
                }
                Err(e) => assert!(
                    matches!(e, llep::Error::InvalidConfig { field: "injected fault", .. }),
                    "{what}: {e:?}"
                ),
            }
            fail_at += 1;
            assert!(fail_at < 10_000, "{what}: the run never ends");
        }
    }
    check(&problem, Scheme::PipelinedLlep, "after the injected faults");
}
