//! Device tests of the foundation's CUDA side (feature `cuda`). They need a GPU, so they are
//! ignored by default; `scripts/gpu-check.sh` runs them with `--include-ignored`.
#![cfg(feature = "cuda")]

use flatpeak_common::cuda::{
    DeviceWorkspace, KernelCache, cast_f32_to_bf16, checksum_f32, context, fill_f32,
};
use flatpeak_common::{Error, SplitMix64};

fn setup() -> (KernelCache, std::sync::Arc<flatpeak_common::cuda::cudarc::driver::CudaStream>) {
    let ctx = context(0).expect("a CUDA device");
    let stream = ctx.default_stream();
    (KernelCache::new(ctx).expect("kernel cache"), stream)
}

#[test]
#[ignore = "needs a CUDA device"]
fn fill_and_checksum_match_the_cpu() {
    let (cache, stream) = setup();
    for n in [1usize, 255, 256, 257, 1 << 20, (1 << 20) + 3] {
        let mut ws = DeviceWorkspace::new(&stream, 4 * n).unwrap();
        let region = ws.carve::<f32>(n).unwrap();
        fill_f32(&cache, &stream, &mut ws.view_mut(region).unwrap(), 0.25).unwrap();
        let sum = checksum_f32(&cache, &stream, &ws.view(region).unwrap()).unwrap();
        assert_eq!(sum, 0.25 * n as f64, "n={n}");
        let host = stream.clone_dtoh(&ws.view(region).unwrap()).unwrap();
        assert!(host.iter().all(|&x| x == 0.25));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn checksum_of_random_data_is_reproducible_and_close_to_f64() {
    let (cache, stream) = setup();
    let x = SplitMix64::new(3).uniform_f32(3_000_001, -1.0, 1.0);
    let dev = stream.clone_htod(&x).unwrap();
    let a = checksum_f32(&cache, &stream, &dev.slice(..)).unwrap();
    let b = checksum_f32(&cache, &stream, &dev.slice(..)).unwrap();
    let want: f64 = x.iter().map(|&v| v as f64).sum();
    assert_eq!(a.to_bits(), b.to_bits());
    assert!((a - want).abs() < 1e-9 * x.len() as f64, "{a} vs {want}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn bf16_cast_is_bitwise_equal_to_half() {
    let (cache, stream) = setup();
    let mut x = SplitMix64::new(9).normal_f32(10_007, 0.0, 100.0);
    x.extend([f32::NAN, f32::INFINITY, -0.0, 1.0e-40, 3.389_531_4e38]);
    let dev = stream.clone_htod(&x).unwrap();
    let mut out = stream.alloc_zeros::<half::bf16>(x.len()).unwrap();
    cast_f32_to_bf16(&cache, &stream, &dev.slice(..), &mut out.slice_mut(..)).unwrap();
    let got = stream.clone_dtoh(&out).unwrap();
    for (g, &v) in got.iter().zip(&x) {
        let want = half::bf16::from_f32(v);
        assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()), "{v}: {g} vs {want}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_workspace_never_grows() {
    let (_cache, stream) = setup();
    let mut ws = DeviceWorkspace::new(&stream, 1000).unwrap();
    ws.carve::<f32>(200).unwrap();
    assert!(matches!(ws.carve::<f32>(100), Err(Error::WorkspaceExhausted { capacity: 1000, .. })));
    ws.reset();
    assert_eq!(ws.high_water(), 800);
}

/// Without NCCL the probe says so and every constructor is a typed error (never a panic); with
/// it, a one-rank communicator per local GPU exchanges a ring step with itself and all-reduces.
#[test]
fn nccl_is_probed_without_panicking() {
    use flatpeak_common::nccl::{NcclId, nccl_available};
    if !nccl_available() {
        assert!(matches!(NcclId::new(), Err(Error::CudaUnavailable { .. })));
    }
}

#[test]
#[ignore = "needs a CUDA device and NCCL"]
fn nccl_ring_step_and_all_reduce_on_every_local_gpu() {
    use flatpeak_common::ReduceOp;
    use flatpeak_common::cuda::cudarc::driver::CudaContext;
    use flatpeak_common::nccl::{DeviceCommunicator, NcclComm};
    if !flatpeak_common::nccl::nccl_available() {
        eprintln!("skipped: libnccl is not installed on this machine");
        return;
    }
    let p = flatpeak_common::cuda_device_count().expect("a CUDA device");
    let streams = (0..p).map(|i| CudaContext::new(i).expect("context").default_stream()).collect();
    let comms = NcclComm::for_devices(streams).expect("NCCL");
    std::thread::scope(|scope| {
        for comm in comms {
            scope.spawn(move || {
                let (r, s) = (comm.rank(), comm.stream().clone());
                let send = s.clone_htod(&[r as f32; 5]).unwrap();
                let mut recv = s.alloc_zeros::<f32>(5).unwrap();
                let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
                comm.exchange(&[send.slice(..)], next, &mut [recv.slice_mut(..)], prev).unwrap();
                assert_eq!(s.clone_dtoh(&recv).unwrap(), vec![prev as f32; 5]);
                let mut sum = s.clone_htod(&[1.0f64, r as f64]).unwrap();
                comm.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
                let want = [p as f64, (p * (p - 1) / 2) as f64];
                assert_eq!(s.clone_dtoh(&sum).unwrap(), want);
                // Rank r sends d + 1 copies of 10·r + d to rank d.
                let (send, counts): (Vec<u32>, Vec<usize>) = (
                    (0..p).flat_map(|d| std::iter::repeat_n((10 * r + d) as u32, d + 1)).collect(),
                    (0..p).map(|d| d + 1).collect(),
                );
                let send = s.clone_htod(&send).unwrap();
                let mut recv = s.alloc_zeros::<u32>(p * (r + 1)).unwrap();
                comm.all_to_all_v(&send.slice(..), &counts, &mut recv.slice_mut(..), &vec![r + 1; p])
                    .unwrap();
                let want: Vec<u32> =
                    (0..p).flat_map(|src| std::iter::repeat_n((10 * src + r) as u32, r + 1)).collect();
                assert_eq!(s.clone_dtoh(&recv).unwrap(), want);
            });
        }
    });
}
