//! Exact transient-memory measurement on the host: [`CountingAllocator`] and [`PeakMeter`].
//!
//! `peak_bytes` of an operation is its transient working set: the high-water of live heap bytes
//! during the call, minus the live bytes just before it, minus the heap bytes of what it returns
//! (a caller holds its outputs under any schedule). It is the host analogue of the delta of
//! torch's `max_memory_allocated`, without the outputs.
//!
//! The counters of [`PeakMeter::measure`] are process-wide, so allocations made on other threads
//! (rayon workers, [`LocalGroup`](crate::LocalGroup) ranks) are counted. The flip side: a binary
//! that measures must not run unrelated work concurrently. Measurements take a process-wide
//! lock, and test binaries that assert exact byte counts keep them in one `#[test]` (as
//! `tests/peak_meter.rs` does) so the test harness itself is idle while they run.
//!
//! [`PeakMeter::measure_thread`] counts the calling thread's own allocations and frees instead,
//! so the P rank threads of a [`LocalGroup`](crate::LocalGroup) can each measure their share of
//! a collective call at once (a process-wide measurement would serialise them and deadlock the
//! collective). What another thread allocates for the call (a rayon worker's GEMM packing) is
//! not counted, and a block this thread allocated but another freed stays counted.
//!
//! ```
//! use flatpeak_common::{CountingAllocator, PeakMeter};
//! #[global_allocator]
//! static ALLOC: CountingAllocator = CountingAllocator;
//!
//! let m = PeakMeter::measure(|| {
//!     let scratch = vec![0u8; 1 << 20]; // transient: counted
//!     std::hint::black_box(&scratch);
//!     vec![1.0f32; 1000] // output: not counted
//! })?;
//! assert!(m.peak_bytes >= 1 << 20);
//! assert_eq!(m.output_bytes, 4000);
//! # Ok::<(), flatpeak_common::Error>(())
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::error::{Error, Result};

static LIVE: AtomicUsize = AtomicUsize::new(0);
static HIGH: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);
static MEASURING: Mutex<()> = Mutex::new(());

thread_local! {
    // Const-initialised and without a destructor: reading them allocates nothing and works at
    // any point of a thread's life, as an allocator needs. Signed: a thread may free what
    // another allocated.
    static THREAD_LIVE: Cell<isize> = const { Cell::new(0) };
    static THREAD_HIGH: Cell<isize> = const { Cell::new(0) };
}

/// A `#[global_allocator]` that counts live heap bytes and their high-water mark, then defers
/// to the system allocator. Install it in a bench or test binary to use [`PeakMeter`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CountingAllocator;

impl CountingAllocator {
    fn grew(bytes: usize) {
        let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
        HIGH.fetch_max(live, Ordering::Relaxed);
        let _ = THREAD_LIVE.try_with(|live| {
            let now = live.get().saturating_add_unsigned(bytes);
            live.set(now);
            let _ = THREAD_HIGH.try_with(|high| high.set(high.get().max(now)));
        });
    }
    /// Counts `ptr`, a fresh allocation of `layout` (none when null), and hands it back.
    fn allocated(ptr: *mut u8, layout: Layout) -> *mut u8 {
        if !ptr.is_null() {
            Self::grew(layout.size());
        }
        ptr
    }
    fn shrank(bytes: usize) {
        LIVE.fetch_sub(bytes, Ordering::Relaxed);
        let _ = THREAD_LIVE.try_with(|live| live.set(live.get().saturating_sub_unsigned(bytes)));
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// `GlobalAlloc` contract holds exactly as it does for `System`; the counters only observe sizes.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        INSTALLED.store(true, Ordering::Relaxed);
        // SAFETY: forwarded contract (non-zero-size layout, per the caller).
        Self::allocated(unsafe { System.alloc(layout) }, layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        INSTALLED.store(true, Ordering::Relaxed);
        // SAFETY: forwarded contract.
        Self::allocated(unsafe { System.alloc_zeroed(layout) }, layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract (`ptr` came from this allocator with `layout`).
        unsafe { System.dealloc(ptr, layout) };
        Self::shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded contract.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            if new_size >= layout.size() {
                Self::grew(new_size - layout.size());
            } else {
                Self::shrank(layout.size() - new_size);
            }
        }
        new
    }
}

/// Heap bytes a value owns: what a measured call's outputs hold and the meter subtracts.
pub trait HeapSize {
    /// Bytes of heap owned by `self` (allocator capacity, not length).
    fn heap_bytes(&self) -> usize;
}

macro_rules! no_heap {
    ($($t:ty),*) => { $(impl HeapSize for $t { fn heap_bytes(&self) -> usize { 0 } })* };
}
no_heap!((), bool, u8, u16, u32, u64, usize, i32, i64, f32, f64, half::bf16, half::f16);

impl<T: HeapSize> HeapSize for Vec<T> {
    fn heap_bytes(&self) -> usize {
        self.capacity() * std::mem::size_of::<T>() + self.iter().map(HeapSize::heap_bytes).sum::<usize>()
    }
}
impl<T: HeapSize> HeapSize for Box<[T]> {
    fn heap_bytes(&self) -> usize {
        std::mem::size_of_val(&**self) + self.iter().map(HeapSize::heap_bytes).sum::<usize>()
    }
}
impl HeapSize for String {
    fn heap_bytes(&self) -> usize {
        self.capacity()
    }
}
impl<T: HeapSize> HeapSize for Option<T> {
    fn heap_bytes(&self) -> usize {
        self.as_ref().map_or(0, HeapSize::heap_bytes)
    }
}
impl<T: HeapSize, E> HeapSize for std::result::Result<T, E> {
    /// An error's heap is not an output of the schedule; only `Ok` values are subtracted.
    fn heap_bytes(&self) -> usize {
        self.as_ref().map_or(0, HeapSize::heap_bytes)
    }
}
macro_rules! tuple_heap {
    ($($name:ident),+) => {
        impl<$($name: HeapSize),+> HeapSize for ($($name,)+) {
            #[allow(non_snake_case)]
            fn heap_bytes(&self) -> usize {
                let ($($name,)+) = self;
                0 $(+ $name.heap_bytes())+
            }
        }
    };
}
tuple_heap!(A);
tuple_heap!(A, B);
tuple_heap!(A, B, C);
tuple_heap!(A, B, C, D);
tuple_heap!(A, B, C, D, E);

/// What [`PeakMeter::measure`] saw.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured<R> {
    /// The closure's return value.
    pub value: R,
    /// Transient working set: `high_water_bytes − output_bytes`, floored at zero.
    pub peak_bytes: usize,
    /// High-water of live heap bytes during the call, above the live bytes before it.
    pub high_water_bytes: usize,
    /// Heap bytes owned by `value` (subtracted, since a caller holds outputs under any schedule).
    pub output_bytes: usize,
}

impl<R: HeapSize> Measured<R> {
    /// `value` with the high-water bytes seen while it was made, its own heap bytes subtracted.
    fn of(value: R, high_water_bytes: usize) -> Self {
        let output_bytes = value.heap_bytes();
        Self {
            peak_bytes: high_water_bytes.saturating_sub(output_bytes),
            high_water_bytes,
            output_bytes,
            value,
        }
    }
}

/// Measures the transient heap working set of a closure (see the module docs for the rules).
#[derive(Debug, Clone, Copy)]
pub struct PeakMeter;

impl PeakMeter {
    /// Runs `f` and returns its value with its transient peak. Measurements are serialised by
    /// a process-wide lock. Errors with [`Error::MeterNotInstalled`] when this binary's global
    /// allocator is not [`CountingAllocator`].
    pub fn measure<R: HeapSize>(f: impl FnOnce() -> R) -> Result<Measured<R>> {
        let _serial = MEASURING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        std::hint::black_box(Box::new(0u64)); // any allocation marks the counter installed
        if !INSTALLED.load(Ordering::Relaxed) {
            return Err(Error::MeterNotInstalled);
        }
        let before = LIVE.load(Ordering::Relaxed);
        HIGH.store(before, Ordering::Relaxed);
        let value = f();
        let high_water_bytes = HIGH.load(Ordering::Relaxed).saturating_sub(before);
        Ok(Measured::of(value, high_water_bytes))
    }

    /// As [`measure`](PeakMeter::measure), counting only what the calling thread allocates and
    /// frees during `f` (see the module docs): no lock, so concurrent threads — the ranks of a
    /// collective — measure at once. Errors with [`Error::MeterNotInstalled`] when this binary's
    /// global allocator is not [`CountingAllocator`].
    pub fn measure_thread<R: HeapSize>(f: impl FnOnce() -> R) -> Result<Measured<R>> {
        std::hint::black_box(Box::new(0u64)); // any allocation marks the counter installed
        if !INSTALLED.load(Ordering::Relaxed) {
            return Err(Error::MeterNotInstalled);
        }
        let before = THREAD_LIVE.with(Cell::get);
        THREAD_HIGH.with(|high| high.set(before));
        let value = f();
        let high = THREAD_HIGH.with(Cell::get);
        let high_water_bytes = usize::try_from(high.saturating_sub(before)).unwrap_or(0);
        Ok(Measured::of(value, high_water_bytes))
    }

    /// Live heap bytes right now (0 when the counting allocator is not installed).
    pub fn live_bytes() -> usize {
        LIVE.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_size_of_outputs() {
        let v: Vec<f32> = Vec::with_capacity(10);
        assert_eq!(v.heap_bytes(), 40);
        let nested = vec![vec![0u8; 3], vec![0u8; 5]];
        assert_eq!(nested.heap_bytes(), 2 * std::mem::size_of::<Vec<u8>>() + 8);
        assert_eq!((vec![0u64; 2], 1.0f32, Some(vec![0u16; 4])).heap_bytes(), 16 + 8);
        let boxed: Box<[f64]> = vec![0.0; 3].into_boxed_slice();
        assert_eq!(boxed.heap_bytes(), 24);
        let err: std::result::Result<Vec<u8>, String> = Err("x".into());
        assert_eq!(err.heap_bytes(), 0);
    }

    #[test]
    fn meter_refuses_without_the_counting_allocator() {
        // The unit-test binary of this crate uses the system allocator.
        assert_eq!(PeakMeter::measure(|| ()).unwrap_err(), Error::MeterNotInstalled);
    }
}
