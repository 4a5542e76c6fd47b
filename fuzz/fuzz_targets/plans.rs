#![no_main]
//! Every plan constructor with arbitrary sizes, options and budgets. Invariants, not only "no
//! panic": a plan that is returned fits its budget and covers its shape.

use flatpeak::{Budget, DType, llep, ring_dtp, sco, stream_adamw};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
enum Case {
    RingDtp { shape: Sizes, budget: Option<u64> },
    RingDtpBlocks { shape: Sizes, blocks: (u64, u64) },
    Ring { shape: Sizes, budget: Option<u64>, ranks: u16, kind: Option<bool> },
    StreamAdamW { params: u64, dtypes: (u8, u8), bucket: u64, slots: u8, serial: bool, budget: Option<u64> },
    Sco { layers: u64, boundary_elems: u64, element_bytes: u8, ring: (u8, u8, u8), budget: Option<u64> },
    Llep { shape: LlepSizes, pair_cap: Option<u64>, depth: u8, scheme: u8, rounds: u64, budget: Option<u64> },
}

#[derive(Debug, Arbitrary)]
struct LlepSizes {
    ranks: u16,
    tokens: u64,
    hidden: u64,
    intermediate: u64,
    experts: u64,
    top_k: u16,
    dtype: u8,
}

#[derive(Debug, Arbitrary)]
struct Sizes {
    tokens: u64,
    hidden: u64,
    vocab: u64,
    dtype: u8,
}

fn dtype(code: u8) -> DType {
    [DType::F32, DType::Bf16, DType::F16][code as usize % 3]
}

fn budget(bytes: Option<u64>) -> Budget {
    bytes.map_or(Budget::Unlimited, |b| Budget::Bytes(b as usize))
}

fn ring_shape(s: &Sizes) -> ring_dtp::Shape {
    ring_dtp::Shape {
        tokens: s.tokens as usize,
        hidden: s.hidden as usize,
        vocab: s.vocab as usize,
        dtype: dtype(s.dtype),
    }
}

fuzz_target!(|case: Case| {
    let config = ring_dtp::Config::default();
    match case {
        Case::RingDtp { shape, budget: bytes } => {
            let shape = ring_shape(&shape);
            if let Ok(plan) = ring_dtp::Plan::new(&config, shape, budget(bytes)) {
                assert!(budget(bytes).admits(plan.workspace_bytes()), "{plan:?} over {bytes:?}");
                assert!(plan.token_block() >= 1 && plan.token_block() <= shape.tokens.max(1));
                assert!(plan.vocab_block() >= 1 && plan.vocab_block() <= shape.vocab.max(1));
                let _ = (plan.per_token_bytes(), plan.row_scratch_bytes(), plan.cpu_gemm_scratch_bytes());
            }
        }
        Case::RingDtpBlocks { shape, blocks } => {
            let shape = ring_shape(&shape);
            if let Ok(plan) =
                ring_dtp::Plan::with_blocks(&config, shape, (blocks.0 as usize, blocks.1 as usize))
            {
                assert!(plan.workspace_bytes() < usize::MAX);
                assert!(plan.token_block() <= blocks.0 as usize && plan.vocab_block() <= blocks.1 as usize);
            }
        }
        Case::Ring { shape, budget: bytes, ranks, kind } => {
            let shape = ring_shape(&shape);
            let mut options = ring_dtp::RingOptions::default().ranks(ranks as usize);
            if let Some(weight) = kind {
                options = options.ring(if weight {
                    ring_dtp::RingKind::Weight
                } else {
                    ring_dtp::RingKind::Activation
                });
            }
            if let Ok(plan) = ring_dtp::RingPlan::new(&config, shape, budget(bytes), options) {
                assert!(budget(bytes).admits(plan.bound_bytes()), "{plan:?} over {bytes:?}");
                assert!(plan.workspace_bytes() <= plan.bound_bytes());
                let (tokens, rows): (usize, usize) = (0..plan.world())
                    .map(|r| (plan.tokens(r).len(), plan.shard(r).len()))
                    .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
                assert_eq!((tokens, rows), (shape.tokens, shape.vocab));
                let _ = (plan.per_token_bytes(), plan.message_bytes(), plan.gemm_flops_per_rank());
            }
        }
        Case::StreamAdamW { params, dtypes, bucket, slots, serial, budget: bytes } => {
            let shape = stream_adamw::Shape {
                params: params as usize,
                grad_dtype: dtype(dtypes.0),
                param_dtype: dtype(dtypes.1),
            };
            let schedule = if serial {
                stream_adamw::StepSchedule::Serial
            } else {
                stream_adamw::StepSchedule::Pipelined
            };
            let config = stream_adamw::Config::default()
                .schedule(schedule)
                .bucket_elems(bucket as usize)
                .slots(slots as usize);
            if let Ok(plan) = stream_adamw::Plan::new(&config, shape, budget(bytes)) {
                assert!(budget(bytes).admits(plan.workspace_bytes()), "{plan:?} over {bytes:?}");
                let last = plan.n_buckets().saturating_sub(1);
                assert_eq!(plan.bucket(last).end, shape.params);
                assert!(plan.staged_slots() <= plan.n_buckets().max(1));
                let _ = plan.link_bytes();
            }
        }
        Case::Sco { layers, boundary_elems, element_bytes, ring, budget: bytes } => {
            let shape = sco::Shape {
                layers: layers as usize,
                boundary_elems: boundary_elems as usize,
                element_bytes: usize::from(element_bytes),
            };
            let config = sco::Config::default()
                .keep_resident(usize::from(ring.0))
                .in_flight(usize::from(ring.1))
                .prefetch_distance(usize::from(ring.2));
            if let Ok(plan) = sco::Plan::new(&config, shape, budget(bytes)) {
                assert!(budget(bytes).admits(plan.workspace_bytes()), "{plan:?} over {bytes:?}");
                let _ = (
                    plan.peak_slots(),
                    plan.boundary_bytes(),
                    plan.host_arena_bytes(),
                    plan.plain_device_bytes(),
                );
            }
        }
        Case::Llep { shape, pair_cap, depth, scheme, rounds, budget: bytes } => {
            let shape = llep::Shape {
                ranks: usize::from(shape.ranks),
                tokens: shape.tokens as usize,
                hidden: shape.hidden as usize,
                intermediate: shape.intermediate as usize,
                experts: shape.experts as usize,
                top_k: usize::from(shape.top_k),
                dtype: dtype(shape.dtype),
            };
            let cap = pair_cap.map_or(llep::PairCap::FitBudget, |q| llep::PairCap::Rows(q as usize));
            let scheme = [llep::Scheme::PipelinedLlep, llep::Scheme::Llep, llep::Scheme::StandardEp]
                [usize::from(scheme) % 3];
            let config =
                llep::Config::default().scheme(scheme).pair_cap(cap).pipeline_depth(usize::from(depth));
            if let Ok(plan) = llep::Plan::new(&config, shape, budget(bytes)) {
                if scheme == llep::Scheme::PipelinedLlep {
                    assert!(budget(bytes).admits(plan.workspace_bytes()), "{plan:?} over {bytes:?}");
                }
                assert!(plan.pair_cap() >= 1 && plan.pair_cap() <= shape.tokens.max(1));
                // Every accessor of every pass's buffers answers (saturating, never a panic).
                for pass in [llep::Pass::Forward, llep::Pass::Backward] {
                    let b = plan.buffers(pass);
                    let _ = (b.regions(), b.host_workspace_bytes(), b.checked_workspace_bytes());
                    let _ =
                        (b.workspace_bytes(), b.send_bytes(), b.recv_bytes(), b.expert_intermediate_bytes());
                    let _ = (b.foreign_weight_bytes(), b.accumulator_bytes(), b.route_table_bytes());
                    let _ = (b.local_slots(), llep::Buffers::dispatch_bytes_per_row(&shape, pass));
                    for mode in [llep::Mode::Checkpointed, llep::Mode::SaveActivations] {
                        let _ = b.saved_activation_bytes(mode, rounds as usize);
                    }
                }
                let _ = (plan.workspace_bytes(), shape.expert_elems(), shape.local_experts());
            }
        }
    }
});
