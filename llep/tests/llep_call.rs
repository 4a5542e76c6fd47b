//! [`Layer`]: a framework's call on each rank's own tensors. Ranks with uneven token counts get
//! bitwise what the executor gives on the agreed plan; every disagreement between ranks (device
//! kind, dtype, sizes, options, what backward runs from, E) is an error on every rank naming the
//! rank that differs, and the group stays usable after it; the layer keeps one executor between
//! calls of one plan.

use flatpeak_common::comm::Refusal;
use flatpeak_common::{DTypeNames, Error as CommonError, ErrorKind, SplitMix64};
use llep::{
    Backward, CallOptions, Communicator, Config, DType, Device, Error, Executor, ExpertWeights, Gradients,
    Layer, LayerBudget, LocalGroup, LocalGroupOptions, Plan, RankCall, RankInputs, RankSizes, Routing, Shape,
    WeightLayout,
};

const H: usize = 12;
const I: usize = 6;
const K: usize = 2;
const LOCAL: usize = 2;

/// One rank's tensors: `tokens` rows, routes over `experts` experts.
struct Data {
    sizes: RankSizes,
    x: Vec<f32>,
    ids: Vec<i64>,
    weights: Vec<f32>,
    gate_up: Vec<f32>,
    down: Vec<f32>,
    dy: Vec<f32>,
}

impl Data {
    fn new(rank: usize, tokens: usize, experts: usize) -> Self {
        let mut rng = SplitMix64::new(17 + rank as u64);
        let ids = (0..tokens * K).map(|j| ((j * 7 + rank * 3) % experts) as i64).collect();
        Self {
            sizes: RankSizes { tokens, hidden: H, intermediate: I, local_experts: LOCAL, top_k: K },
            x: rng.normal_f32(tokens * H, 0.0, 1.0),
            ids,
            weights: rng.normal_f32(tokens * K, 0.5, 0.1),
            gate_up: rng.normal_f32(LOCAL * 2 * I * H, 0.0, 0.3),
            down: rng.normal_f32(LOCAL * H * I, 0.0, 0.3),
            dy: rng.normal_f32(tokens * H, 0.0, 1.0),
        }
    }
    fn routing(&self) -> Routing<'_> {
        Routing { ids: &self.ids, weights: &self.weights }
    }
    fn inputs(&self) -> RankInputs<'_, f32> {
        RankInputs {
            x: &self.x,
            routing: self.routing(),
            experts: ExpertWeights::linear(&self.gate_up, &self.down),
        }
    }
    fn call(&self) -> RankCall<'_> {
        RankCall { sizes: self.sizes, dtype: DType::F32, device: Device::Cpu, routing: self.routing() }
    }
}

fn config() -> Config {
    Config::default().min_chunk(4).weight_layout(WeightLayout::Linear)
}

/// Tokens of rank r in a group of p: uneven, one rank with none.
fn tokens_of(r: usize) -> usize {
    [7, 0, 11, 3][r % 4]
}

#[test]
fn uneven_ranks_get_bitwise_what_the_executor_gives_on_the_agreed_plan() {
    let p = 4;
    let out = LocalGroup::run(p, LocalGroupOptions::default(), |comm| {
        let d = Data::new(comm.rank(), tokens_of(comm.rank()), LOCAL * p);
        let run = || -> llep::Result<_> {
            let mut layer = Layer::new(config(), LayerBudget::Default)?;
            let mut call = layer.call(comm, Ok::<_, Error>(d.call()), CallOptions::default())?;
            let shape = *call.shape();
            let y = call.forward(comm, &d.inputs())?;
            let grads = call.backward(comm, &d.inputs(), &d.dy)?;
            let stats = call.stats();
            // The executor, by hand, on the plan of N = the most tokens any rank brought.
            let want_shape = Shape {
                ranks: p,
                tokens: 11,
                hidden: H,
                intermediate: I,
                experts: LOCAL * p,
                top_k: K,
                dtype: DType::F32,
            };
            let plan = Plan::new(
                &config(),
                want_shape,
                LayerBudget::Default.of(&config(), &want_shape, Device::Cpu)?,
            )?;
            let mut executor = Executor::new(plan, Device::Cpu)?;
            let schedule = executor.schedule(comm, &d.routing())?;
            let want_y = executor.forward(comm, &schedule, &d.inputs())?;
            let want_grads: Gradients = executor.backward(comm, &schedule, &d.inputs(), &d.dy)?;
            Ok((
                shape == want_shape,
                y == want_y,
                grads == want_grads,
                stats,
                layer.held_bytes(),
                plan.workspace_bytes(),
            ))
        };
        Ok(run())
    });
    for (r, out) in out.into_iter().enumerate() {
        let (shape, y, grads, stats, held, planned) = out.unwrap().unwrap();
        assert!(shape && y && grads, "rank {r}: shape {shape}, y {y}, grads {grads}");
        assert_eq!(
            stats.expert_routes.iter().sum::<usize>(),
            [7, 0, 11, 3].iter().sum::<usize>() * K,
            "rank {r}"
        );
        assert!(stats.rounds >= 1 && stats.recv_high_water_bytes == stats.recv_high_water_rows * H * 4);
        assert_eq!((stats.workspace_bytes, held), (planned, planned), "rank {r}");
    }
}

/// Runs one call per rank, `edit` changing what rank `bad` brings; returns each rank's error and
/// whether a good call on every rank ran afterwards.
fn refused(
    p: usize,
    bad: usize,
    edit: impl Fn(&mut RankCall<'_>, &mut Config, &mut CallOptions) + Sync,
) -> Vec<Error> {
    let out = LocalGroup::run(p, LocalGroupOptions::default(), |comm| {
        let d = Data::new(comm.rank(), 5, LOCAL * p);
        let (mut me, mut config, mut options) =
            (d.call(), config(), CallOptions::default().names(DTypeNames::Torch));
        if comm.rank() == bad {
            edit(&mut me, &mut config, &mut options);
        }
        let run = || -> llep::Result<_> {
            let mut layer = Layer::new(config, LayerBudget::Default)?;
            let err = layer.call(comm, Ok::<_, Error>(me), options).map(drop).unwrap_err();
            // The group is intact: a good call runs on every rank.
            let mut good = Layer::new(self::config(), LayerBudget::Default)?;
            good.call(comm, Ok::<_, Error>(d.call()), CallOptions::default())?.forward(comm, &d.inputs())?;
            Ok(err)
        };
        Ok(run())
    });
    out.into_iter().map(|r| r.unwrap().unwrap()).collect()
}

/// `errors[bad]` is the rank's own refusal and every other rank's a `PeerInput` naming it, of
/// `kind`, each message containing `text`.
fn named(errors: &[Error], bad: usize, kind: ErrorKind, text: &str) {
    for (r, e) in errors.iter().enumerate() {
        let ok = match e {
            Error::Common(CommonError::Refused { kind: k, message }) => {
                r == bad && *k == kind && message.contains(text)
            }
            Error::Common(CommonError::PeerInput { rank, kind: k, message }) => {
                r != bad && *rank == bad && *k == kind && message.contains(text)
            }
            _ => false,
        };
        assert!(ok, "rank {r}: {e:?} (expected rank {bad}'s {kind:?} refusal containing {text:?})");
        assert_eq!(e.kind(), kind);
    }
}

#[test]
fn a_disagreement_between_ranks_is_an_error_on_every_rank_naming_the_rank() {
    let errors = refused(3, 1, |me, _, _| me.dtype = DType::Bf16);
    named(
        &errors,
        1,
        ErrorKind::Type,
        "rank 1 passed torch.bfloat16 tensors where rank 0 passed torch.float32",
    );
    let errors = refused(3, 2, |me, _, _| me.device = Device::Cuda(0));
    named(&errors, 2, ErrorKind::Type, "rank 2 passed CUDA tensors where rank 0 passed CPU tensors");
    let errors = refused(3, 2, |me, _, _| me.sizes.hidden = H + 1);
    named(&errors, 2, ErrorKind::Value, &format!("rank 2 passed hidden={}, intermediate={I}", H + 1));
    let errors = refused(2, 1, |_, config, _| *config = config.min_chunk(5));
    named(&errors, 1, ErrorKind::Value, "rank 1 passed other options than rank 0");
    let errors = refused(2, 1, |_, _, options| options.backward = Backward::FromSaved);
    named(
        &errors,
        1,
        ErrorKind::Value,
        "rank 1's backward runs from saved activations where rank 0's runs recomputing",
    );
    // Rank 0 differing is named by the first rank that differs from it.
    let errors = refused(3, 0, |me, _, _| me.sizes.top_k = 3);
    named(&errors, 1, ErrorKind::Value, "rank 1 passed hidden=12, intermediate=6, E_local=2, top_k=2");
}

#[test]
fn a_local_refusal_and_a_wrong_expert_count_reach_every_rank() {
    let out = LocalGroup::run(3, LocalGroupOptions::default(), |comm| {
        let d = Data::new(comm.rank(), 4, LOCAL * 3);
        let run = || -> llep::Result<_> {
            let mut layer = Layer::new(config(), LayerBudget::Default)?;
            let local = if comm.rank() == 2 {
                Err(Refusal { kind: ErrorKind::Type, message: "topk_ids: expected dtype torch.int64".into() })
            } else {
                Ok(d.call())
            };
            let refused = layer.call(comm, local, CallOptions::default()).map(drop).unwrap_err();
            let options = CallOptions::default().experts(Some(LOCAL * 3 + 1));
            let experts = layer.call(comm, Ok::<_, Error>(d.call()), options).map(drop).unwrap_err();
            Ok((refused, experts))
        };
        Ok(run())
    });
    let out: Vec<(Error, Error)> = out.into_iter().map(|r| r.unwrap().unwrap()).collect();
    let refused: Vec<Error> = out.iter().map(|o| o.0.clone()).collect();
    named(&refused, 2, ErrorKind::Type, "topk_ids: expected dtype torch.int64");
    for (_, experts) in &out {
        assert_eq!(*experts, Error::ExpertsPerRank { experts: 7, local_experts: 2, ranks: 3 });
        assert!(experts.to_string().contains("num_experts=7"), "{experts}");
    }
}

#[test]
fn the_layer_keeps_one_executor_per_plan_and_checks_its_budget() {
    assert!(matches!(
        Layer::new(config(), LayerBudget::Bytes(0)),
        Err(Error::InvalidConfig { field: "budget_bytes", .. })
    ));
    let shape = Shape {
        ranks: 1,
        tokens: 8,
        hidden: H,
        intermediate: I,
        experts: LOCAL,
        top_k: K,
        dtype: DType::F32,
    };
    let least = Plan::least_workspace_bytes(&config(), &shape).unwrap();
    assert_eq!(
        LayerBudget::Default.of(&config(), &shape, Device::Cpu).unwrap(),
        llep::Budget::Bytes(least + llep::DEFAULT_CPU_ROWS_BUDGET_BYTES)
    );
    assert_eq!(
        LayerBudget::Default.of(&config(), &shape, Device::Cuda(1)).unwrap(),
        llep::Budget::Bytes(least + llep::DEFAULT_CUDA_ROWS_BUDGET_BYTES)
    );
    let out = LocalGroup::run(1, LocalGroupOptions::default(), |comm| {
        let run = || -> llep::Result<_> {
            let mut layer = Layer::new(config(), LayerBudget::Bytes(1 << 20))?;
            let mut held = Vec::new();
            for tokens in [8, 8, 3] {
                let d = Data::new(0, tokens, LOCAL);
                layer
                    .call(comm, Ok::<_, Error>(d.call()), CallOptions::default())?
                    .forward(comm, &d.inputs())?;
                held.push(layer.held_bytes());
            }
            layer.release();
            held.push(layer.held_bytes());
            Ok(held)
        };
        Ok(run())
    });
    let held = out.into_iter().next().unwrap().unwrap().unwrap();
    assert!(held[0] > 0 && held[0] <= 1 << 20 && held[1] == held[0], "{held:?}");
    assert_eq!(held[3], 0);
}
