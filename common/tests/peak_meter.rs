//! PeakMeter against known allocations. The counters are process-wide and libtest's own threads
//! allocate while a test starts, so this file runs without the harness (`harness = false`): a
//! plain `main` on one thread, nothing else allocating while the exact byte counts are taken.

use flatpeak_common::{Communicator, CountingAllocator, LocalGroup, LocalGroupOptions, PeakMeter, Workspace};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

const MIB: usize = 1 << 20;

fn main() {
    let checks: [(&str, fn()); 2] = [
        ("peak_meter_matches_known_allocations", known_allocations),
        ("per_thread_meters_count_their_own_thread", per_thread),
    ];
    for (name, check) in checks {
        check();
        println!("test {name} ... ok");
    }
    println!("test result: ok. {} passed; 0 failed; 0 ignored; 0 measured; 0 filtered out", checks.len());
}

fn known_allocations() {
    // A transient buffer, freed before return: counted exactly.
    let m = PeakMeter::measure(|| {
        let scratch = vec![1u8; MIB];
        std::hint::black_box(&scratch);
    })
    .unwrap();
    assert_eq!(m.peak_bytes, MIB);
    assert_eq!(m.output_bytes, 0);

    // Two transients alive together, then one output: outputs are subtracted.
    let m = PeakMeter::measure(|| {
        let a = vec![0f32; 1000];
        let b = vec![0f64; 1000];
        std::hint::black_box((&a, &b));
        drop((a, b));
        vec![0u32; 256]
    })
    .unwrap();
    assert_eq!(m.high_water_bytes, 12_000);
    assert_eq!(m.output_bytes, 1024);
    assert_eq!(m.peak_bytes, 12_000 - 1024);

    // Sequential transients: the peak is the larger one, not the sum.
    let m = PeakMeter::measure(|| {
        for bytes in [3 * MIB, MIB, 2 * MIB] {
            std::hint::black_box(vec![7u8; bytes]);
        }
    })
    .unwrap();
    assert_eq!(m.peak_bytes, 3 * MIB);

    // Live bytes from before the call are not charged to it.
    let held = vec![0u8; 8 * MIB];
    let m = PeakMeter::measure(|| std::hint::black_box(vec![0u8; 100]).len()).unwrap();
    assert_eq!(m.peak_bytes, 100);
    drop(held);

    // A workspace reserved inside the call is its working set (and the < 64 bytes that align
    // its first line); carving adds nothing.
    let m = PeakMeter::measure(|| {
        let ws = Workspace::new(64 * 1000).expect("workspace");
        let a = ws.take::<f32>(1000).unwrap();
        let b = ws.take::<f32>(1000).unwrap();
        a.fill(1.0);
        b.copy_from_slice(a);
        b.iter().sum::<f32>()
    })
    .unwrap();
    assert!((64 * 1000..64 * 1000 + 64).contains(&m.peak_bytes), "{}", m.peak_bytes);

    // Allocations on other threads (the ranks of a LocalGroup) are counted: 4 ranks each hold
    // 1 MiB at once behind a barrier.
    let m = PeakMeter::measure(|| {
        LocalGroup::run(4, LocalGroupOptions::default(), |comm| {
            let buf = vec![3u8; MIB];
            comm.barrier()?;
            std::hint::black_box(&buf);
            comm.barrier()
        })
    })
    .unwrap();
    assert!(m.value.iter().all(Result::is_ok));
    assert!(m.peak_bytes >= 4 * MIB, "peak {} < 4 MiB", m.peak_bytes);
    assert!(m.peak_bytes < 4 * MIB + 256 * 1024, "thread bookkeeping {} too large", m.peak_bytes);
}

fn per_thread() {
    // Each of 4 ranks measures its own call at once (a process-wide meter would serialise them
    // and the barrier would never be reached): rank r holds (r + 1) MiB behind a barrier while
    // its peers hold theirs, and returns 1 KiB.
    let peaks = LocalGroup::run(4, LocalGroupOptions::default(), |comm| {
        let rank = comm.rank();
        let m = PeakMeter::measure_thread(|| -> flatpeak_common::Result<Vec<u8>> {
            let buf = vec![3u8; (rank + 1) * MIB];
            comm.barrier()?;
            std::hint::black_box(&buf);
            Ok(vec![0u8; 1024])
        })?;
        let value = m.value?;
        assert_eq!(m.output_bytes, value.capacity());
        Ok(m.peak_bytes)
    });
    for (rank, peak) in peaks.into_iter().enumerate() {
        let peak = peak.expect("rank ran");
        let want = (rank + 1) * MIB;
        // The rank's own buffer, plus the transport's barrier messages and thread bookkeeping.
        assert!(peak >= want && peak < want + 64 * 1024, "rank {rank}: {peak} for {want}");
    }

    // Blocks another thread allocates are not the caller's.
    let m = PeakMeter::measure_thread(|| {
        std::thread::scope(|s| s.spawn(|| std::hint::black_box(vec![0u8; 4 * MIB]).len()).join())
    })
    .unwrap();
    assert!(m.peak_bytes < MIB, "counted another thread's 4 MiB: {}", m.peak_bytes);
}
