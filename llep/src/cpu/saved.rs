//! [`Mode::SaveActivations`] on the host: the store forward keeps every round's received rows,
//! their routes and each route's SwiGLU pre-activations in ([`SavedActivations`]), carved as the
//! round schedule's [`Store`] for [`Executor::forward_saving`](crate::Executor::forward_saving)
//! and [`Executor::backward_saved`](crate::Executor::backward_saved), which dispatch dY only and
//! run each expert's backward from what was kept (six GEMMs per group, no recompute).
//!
//! Memory: the store of rank d is a 64-byte header (which forward filled it) and
//! [`Schedule::saved_bytes`]`(d)` = `Σ_s R[s][d]·(H·b + 8·k) + 2·L_d·I·b + 4·(K + 1)` bytes (b
//! bytes per element of the storage type; rows received over all rounds, routes computed there),
//! reserved once per schedule and held from forward to backward
//! ([`SavedActivations::bytes_for`]); the part past the header is at most
//! [`Buffers::saved_activation_bytes`](crate::Buffers::saved_activation_bytes) for this K.
//! Unlike the dispatch buffers it grows with the routing: this is the larger bound the
//! checkpointed mode avoids. The per-round workspace is the checkpointed one's
//! ([`Schedule::buffers`]).

use flatpeak_common::{DType, Workspace};

use super::ops::HostBuf;
use crate::config::Mode;
use crate::device::Store;
use crate::error::{Error, Result};
use crate::plan::RouteMeta;
use crate::schedule::Schedule;

/// What one rank's forward keeps for backward in [`Mode::SaveActivations`]: a reservation of
/// [`SavedActivations::bytes_for`] made before the forward (a header that records which forward
/// filled it, then [`Schedule::saved_bytes`] laid out as [`Schedule::saved_regions`]), filled by
/// [`Executor::forward_saving`](crate::Executor::forward_saving), read by
/// [`Executor::backward_saved`](crate::Executor::backward_saved). The store may be the crate's
/// own ([`SavedActivations::new`]) or the caller's bytes, borrowed for the store's life
/// ([`SavedActivations::over`]: a framework's tensor, which its autograd then keeps, offloads or
/// drops as it does any saved tensor); the header travels with the bytes.
#[derive(Debug)]
pub struct SavedActivations<'a> {
    store: Workspace,
    /// The caller's bytes the store lives in (for [`SavedActivations::over`]), borrowed.
    borrowed: std::marker::PhantomData<&'a mut [u8]>,
}

/// The header's words: a tag, then (rank, rounds, rows, routes) of the forward that filled the
/// store; all zero before one did.
const HEADER_WORDS: usize = 5;
/// A store's length is a whole number of these (cache lines).
const LINE: usize = 64;
/// "llepsave" in ASCII: a header a saving forward wrote.
const FILLED_TAG: u64 = u64::from_be_bytes(*b"llepsave");

impl SavedActivations<'static> {
    /// Reserves rank `rank`'s store for `plan` (a plan in [`Mode::SaveActivations`]).
    pub fn new(plan: &Schedule, rank: usize) -> Result<Self> {
        check_mode(plan)?;
        Ok(Self { store: Workspace::new(Self::bytes_for(plan, rank))?, borrowed: std::marker::PhantomData })
    }
}

impl<'a> SavedActivations<'a> {
    /// A store over the caller's `bytes`, at least [`bytes_for`](Self::bytes_for) of them and
    /// starting on a 64-byte line: empty for a saving forward to fill when the bytes are fresh
    /// (zeroed, or any bytes but a filled header), or the store a saving forward filled, for its
    /// backward (whose header the backward checks against its schedule and rank).
    pub fn over(plan: &Schedule, rank: usize, bytes: &'a mut [u8]) -> Result<Self> {
        check_mode(plan)?;
        let needed = Self::bytes_for(plan, rank);
        if bytes.len() < needed {
            return Err(Error::Common(flatpeak_common::Error::ShapeMismatch {
                what: "saved-activation store (bytes)",
                expected: needed,
                got: bytes.len(),
            }));
        }
        let (ptr, len) = (std::ptr::NonNull::from(&mut *bytes).cast::<u8>(), bytes.len());
        // SAFETY: `bytes` is borrowed exclusively for 'a, the store's whole life (the marker
        // holds the borrow), so the `len` initialised bytes at `ptr` stay valid and are accessed
        // through the store alone; `from_raw` checks the 64-byte alignment.
        let store = unsafe { Workspace::from_raw(ptr, len)? };
        Ok(Self { store, borrowed: std::marker::PhantomData })
    }

    /// Bytes rank `rank`'s store takes for `plan`: the header and [`Schedule::saved_bytes`],
    /// aligned, in whole 64-byte lines (what [`over`](Self::over) carves); 0 when
    /// checkpointed.
    pub fn bytes_for(plan: &Schedule, rank: usize) -> usize {
        match plan.config().mode {
            Mode::Checkpointed => 0,
            Mode::SaveActivations => {
                let mut regions = vec![HEADER_WORDS * 8];
                regions.extend(plan.saved_regions(rank));
                let bytes = flatpeak_common::Arena::bytes_for(&regions).unwrap_or(usize::MAX);
                bytes.checked_next_multiple_of(LINE).unwrap_or(usize::MAX)
            }
        }
    }

    /// Bytes reserved.
    pub fn bytes(&self) -> usize {
        self.store.capacity()
    }

    fn stamp(plan: &Schedule, rank: usize) -> [usize; 4] {
        [rank, plan.rounds(), plan.recv_rows_total(rank), plan.assignment().rank_load(rank)]
    }
}

/// The store's regions: the header, then [`Schedule::saved_regions`].
struct StoreParts<'s> {
    header: &'s mut [u64],
    x: HostBuf<'s>,
    meta: &'s mut [RouteMeta],
    pre: HostBuf<'s>,
    route_start: &'s mut [u32],
}

/// (rank, rounds, rows, routes) of the forward that filled the store whose header this is, if
/// one did.
fn read_stamp(header: &[u64]) -> Option<[usize; 4]> {
    (header[0] == FILLED_TAG).then(|| std::array::from_fn(|i| header[i + 1] as usize))
}

/// Marks the store filled by the forward of `stamp` (`None`: by none).
fn write_stamp(header: &mut [u64], stamp: Option<[usize; 4]>) {
    header.fill(0);
    if let Some(stamp) = stamp {
        header[0] = FILLED_TAG;
        for (word, v) in header[1..].iter_mut().zip(stamp) {
            *word = v as u64;
        }
    }
}

fn carve<'s>(store: &'s mut Workspace, plan: &Schedule, rank: usize) -> Result<StoreParts<'s>> {
    store.reset();
    let store: &'s Workspace = store;
    let s = plan.shape();
    let [_, rounds, rows, routes] = SavedActivations::stamp(plan, rank);
    let header = store.take(HEADER_WORDS)?;
    // Rows and pre-activations in the storage type, as `Schedule::saved_regions` sizes them.
    let rows_of = |len: usize| -> Result<HostBuf<'s>> {
        Ok(match s.dtype {
            DType::Bf16 => HostBuf::CarvedBf16(store.take(len)?),
            _ => HostBuf::Carved(store.take(len)?),
        })
    };
    let x = rows_of(rows * s.hidden)?;
    let meta = store.take(rows * s.top_k)?;
    let pre = rows_of(routes * 2 * s.intermediate)?;
    Ok(StoreParts { header, x, meta, pre, route_start: store.take(rounds + 1)? })
}

pub(super) fn check_mode(plan: &Schedule) -> Result<()> {
    if plan.config().mode == Mode::SaveActivations {
        Ok(())
    } else {
        Err(Error::invalid_config(
            "mode",
            plan.config().mode,
            "Mode::SaveActivations (checkpointed plans run through forward and backward)",
        ))
    }
}

/// The first word of `filled` that differs from `planned` (all of them, when no forward filled
/// the store: the rounds reported), with its name.
fn check_stamp(filled: Option<[usize; 4]>, planned: [usize; 4]) -> Option<(usize, &'static str)> {
    const NAMES: [&str; 4] = [
        "rank of the saved forward",
        "rounds of the saved forward",
        "rows the saved forward received",
        "routes the saved forward computed",
    ];
    match filled {
        None => Some((1, NAMES[1])),
        Some(f) => (0..4).find(|&i| f[i] != planned[i]).map(|i| (i, NAMES[i])),
    }
}

/// What a pass does with a [`SavedActivations`] store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StoreUse {
    /// A saving forward fills it: the header says "filled by none" while it runs (a forward
    /// that fails leaves no store a backward would read) and names the forward once it
    /// succeeded.
    Fill,
    /// A backward reads what the saving forward of the same schedule and rank kept: a header
    /// naming another forward (or none) is [`Error::ScheduleMismatch`].
    Read,
}

impl SavedActivations<'_> {
    /// Runs `pass` on this store carved for `plan` and rank `rank` (carving again finds the
    /// same regions a forward left), filling it or reading it as `how` says.
    pub(super) fn with_store<'s, R>(
        &'s mut self,
        plan: &Schedule,
        rank: usize,
        how: StoreUse,
        pass: impl FnOnce(&mut Store<'_, HostBuf<'s>>) -> Result<R>,
    ) -> Result<R> {
        let stamp = Self::stamp(plan, rank);
        let StoreParts { header, mut x, meta, mut pre, route_start } = carve(&mut self.store, plan, rank)?;
        match how {
            StoreUse::Fill => write_stamp(header, None),
            StoreUse::Read => {
                let filled = read_stamp(header);
                if let Some((i, what)) = check_stamp(filled, stamp) {
                    let found = filled.map_or(0, |f| f[i]);
                    return Err(Error::ScheduleMismatch { what, planned: stamp[i], found });
                }
            }
        }
        let done = pass(&mut Store { x: &mut x, meta, pre: &mut pre, route_start })?;
        if how == StoreUse::Fill {
            write_stamp(header, Some(stamp));
        }
        Ok(done)
    }
}
