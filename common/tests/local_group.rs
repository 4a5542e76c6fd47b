//! LocalGroup: collectives and ring traffic correct for P ∈ {1, 2, 3, 8}; failures are errors
//! within the timeout, never hangs.

use std::time::{Duration, Instant};

use flatpeak_common::{Communicator, CommunicatorExt, Error, LocalGroup, LocalGroupOptions, ReduceOp};

const WORLDS: [usize; 4] = [1, 2, 3, 8];

fn ok<R: std::fmt::Debug>(results: Vec<flatpeak_common::Result<R>>) -> Vec<R> {
    results.into_iter().map(|r| r.expect("rank failed")).collect()
}

/// Rank s sends (s + 2d) mod 4 elements to rank d, each encoding (s, d, i).
fn count(s: usize, d: usize) -> usize {
    (s + 2 * d) % 4
}
fn value(s: usize, d: usize, i: usize) -> u32 {
    (s * 1_000_000 + d * 1_000 + i) as u32
}

#[test]
fn all_to_all_v_routes_every_element() {
    for p in WORLDS {
        let received = ok(LocalGroup::run(p, LocalGroupOptions::default(), |comm| {
            let s = comm.rank();
            let send_counts: Vec<usize> = (0..p).map(|d| count(s, d)).collect();
            let send: Vec<u32> = (0..p).flat_map(|d| (0..count(s, d)).map(move |i| value(s, d, i))).collect();
            let recv_counts: Vec<usize> = (0..p).map(|src| count(src, s)).collect();
            let mut recv = vec![0u32; recv_counts.iter().sum()];
            comm.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)?;
            Ok(recv)
        }));
        for (d, got) in received.iter().enumerate() {
            let want: Vec<u32> = (0..p).flat_map(|s| (0..count(s, d)).map(move |i| value(s, d, i))).collect();
            assert_eq!(got, &want, "P={p} rank {d}");
        }
    }
}

#[test]
fn ring_shift_circulates_blocks_home() {
    for p in WORLDS {
        let homes = ok(LocalGroup::run(p, LocalGroupOptions::default(), |comm| {
            // Each rank's block visits every rank once and comes home after P shifts.
            let mut block: Vec<f32> = (0..5).map(|i| (comm.rank() * 10 + i) as f32).collect();
            let mut seen = vec![block[0] as usize / 10];
            let mut incoming = vec![0f32; block.len()];
            for _ in 0..p {
                comm.ring_shift(&block, &mut incoming)?;
                std::mem::swap(&mut block, &mut incoming);
                seen.push(block[0] as usize / 10);
            }
            Ok((block, seen))
        }));
        for (r, (block, seen)) in homes.iter().enumerate() {
            assert_eq!(block, &(0..5).map(|i| (r * 10 + i) as f32).collect::<Vec<_>>());
            let mut visited = seen[..p].to_vec();
            visited.sort_unstable();
            assert_eq!(visited, (0..p).collect::<Vec<_>>(), "P={p}");
            assert_eq!(seen[1], (r + p - 1) % p, "first arrival comes from the previous rank");
        }
    }
}

#[test]
fn point_to_point_keeps_order_per_pair() {
    let got = ok(LocalGroup::run(3, LocalGroupOptions::default(), |comm| {
        if comm.rank() == 0 {
            for i in 0..10u64 {
                comm.send(2, &[i])?;
            }
            Ok(vec![])
        } else if comm.rank() == 2 {
            let mut out = Vec::new();
            for _ in 0..10 {
                let mut x = [0u64];
                comm.recv(0, &mut x)?;
                out.push(x[0]);
            }
            Ok(out)
        } else {
            Ok(vec![])
        }
    }));
    assert_eq!(got[2], (0..10).collect::<Vec<_>>());
}

#[test]
fn all_reduce_sum_and_max_are_exact_and_identical_on_every_rank() {
    for p in WORLDS {
        let data =
            |r: usize| -> Vec<f32> { (0..33).map(|i| ((r * 7 + i * 13) % 17) as f32 * 0.1 - 0.7).collect() };
        let results = ok(LocalGroup::run(p, LocalGroupOptions::default(), |comm| {
            let mut sum = data(comm.rank());
            comm.all_reduce_f32(&mut sum, ReduceOp::Sum)?;
            let mut max = data(comm.rank());
            comm.all_reduce_f32(&mut max, ReduceOp::Max)?;
            comm.barrier()?;
            Ok((sum, max))
        }));
        let want_sum: Vec<f32> =
            (0..33).map(|i| (1..p).fold(data(0)[i], |acc, r| acc + data(r)[i])).collect();
        let want_max: Vec<f32> =
            (0..33).map(|i| (0..p).map(|r| data(r)[i]).fold(f32::MIN, f32::max)).collect();
        for (sum, max) in &results {
            assert!(sum.iter().zip(&want_sum).all(|(a, b)| a.to_bits() == b.to_bits()), "P={p}");
            assert_eq!(max, &want_max);
        }
    }
}

#[test]
fn max_propagates_nan() {
    let r = ok(LocalGroup::run(2, LocalGroupOptions::default(), |comm| {
        let mut v = if comm.rank() == 0 { vec![f32::NAN, 1.0] } else { vec![0.0, 2.0] };
        comm.all_reduce_f32(&mut v, ReduceOp::Max)?;
        Ok(v)
    }));
    assert!(r[1][0].is_nan() && r[1][1] == 2.0);
}

#[test]
fn a_panicking_rank_is_peer_lost_for_the_others_within_the_timeout() {
    for p in [2, 3, 8] {
        let timeout = Duration::from_secs(20);
        let start = Instant::now();
        let results = LocalGroup::run(p, LocalGroupOptions::with_timeout(timeout), |comm| {
            if comm.rank() == 1 {
                panic!("rank 1 fails");
            }
            let mut v = vec![1.0f32; 4];
            comm.all_reduce_f32(&mut v, ReduceOp::Sum)?;
            comm.barrier()
        });
        assert!(start.elapsed() < timeout / 4, "took {:?}", start.elapsed());
        for (rank, r) in results.iter().enumerate() {
            match (rank, r) {
                (1, Err(Error::RankPanicked { rank: 1, message })) => assert_eq!(message, "rank 1 fails"),
                (_, Err(Error::PeerLost { rank: 1 })) => {}
                other => panic!("P={p}: unexpected {other:?}"),
            }
        }
    }
}

#[test]
fn a_silent_peer_is_a_timeout_not_a_hang() {
    let timeout = Duration::from_millis(200);
    let results = LocalGroup::run(2, LocalGroupOptions::with_timeout(timeout), |comm| {
        if comm.rank() == 0 {
            let mut x = [0u8; 4];
            comm.recv(1, &mut x)?;
        } else {
            std::thread::sleep(Duration::from_millis(600));
        }
        Ok(())
    });
    assert_eq!(results[0], Err(Error::Timeout { rank: 0, peer: 1, waited: timeout }));
    assert_eq!(results[1], Ok(()));
}

#[test]
fn a_zero_timeout_is_refused_before_any_rank_runs() {
    let ran = std::sync::atomic::AtomicBool::new(false);
    let results = LocalGroup::run(3, LocalGroupOptions::with_timeout(Duration::ZERO), |_| {
        ran.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    });
    assert_eq!(results.len(), 3);
    for r in results {
        assert!(matches!(r, Err(Error::InvalidConfig { field: "timeout", .. })), "{r:?}");
    }
    assert!(!ran.into_inner());
    assert!(LocalGroup::endpoints(2, LocalGroupOptions::with_timeout(Duration::ZERO)).is_err());
}

#[test]
fn mismatched_programs_and_bad_arguments_are_typed_errors() {
    let results = LocalGroup::run(2, LocalGroupOptions::default(), |comm| {
        if comm.rank() == 0 { comm.barrier() } else { comm.all_reduce_f32(&mut [1.0], ReduceOp::Sum) }
    });
    assert!(results.iter().any(|r| matches!(r, Err(Error::CollectiveMismatch { .. }))), "{results:?}");

    let results = LocalGroup::run(2, LocalGroupOptions::default(), |comm| {
        if comm.rank() == 0 {
            comm.send(1, &[1u32, 2, 3])
        } else {
            let mut two = [0u32; 2];
            comm.recv(0, &mut two)
        }
    });
    assert_eq!(
        results[1],
        Err(Error::ShapeMismatch { what: "received message bytes", expected: 8, got: 12 })
    );

    let results = LocalGroup::run(2, LocalGroupOptions::default(), |comm| {
        comm.send(5, &[0u8])?;
        Ok(())
    });
    assert_eq!(results[0], Err(Error::RankOutOfRange { rank: 5, world_size: 2 }));

    let results = LocalGroup::run(2, LocalGroupOptions::default(), |comm| {
        let mut recv = [0u8; 2];
        comm.all_to_all_v(&[1u8, 2, 3], &[1, 1], &mut recv, &[1, 1])
    });
    assert!(matches!(results[0], Err(Error::ShapeMismatch { what: "all_to_all_v send counts", .. })));

    assert!(LocalGroup::run(0, LocalGroupOptions::default(), |_| Ok(())).is_empty());
}
