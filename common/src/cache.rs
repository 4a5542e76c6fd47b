//! [`ExecutorCache`]: executors a caller keeps between calls (a binding whose ops are called
//! once per step), each with the working set it reserved, by key (the device and the plan): the
//! second call of a shape reuses the first one's reservation instead of making its own.
//!
//! Memory: the cache holds at most its limit in reservations ([`Held::held_bytes`]), or one
//! executor when that one alone needs more. Before a new executor is made, the least recently
//! used ones are dropped until it fits, so an old working set is freed before a new one is
//! reserved; [`ExecutorCache::held_bytes`] says what it holds and [`ExecutorCache::clear`]
//! frees everything.
//!
//! ```
//! use flatpeak_common::{ExecutorCache, Held};
//!
//! struct Executor(Vec<u8>); // stands for one that reserved its working set
//! impl Held for Executor {
//!     fn held_bytes(&self) -> usize { self.0.len() }
//! }
//!
//! let mut cache = ExecutorCache::new(100);
//! let make = |n: usize| move || Ok::<_, ()>(Executor(vec![0; n]));
//! cache.get_or_try_insert("a", 60, make(60))?;
//! cache.get_or_try_insert("b", 30, make(30))?;
//! assert_eq!(cache.held_bytes(), 90);
//! cache.get_or_try_insert("c", 50, make(50))?; // "a", the least recently used, goes first
//! assert_eq!((cache.len(), cache.held_bytes()), (2, 80));
//! cache.clear();
//! assert_eq!(cache.held_bytes(), 0);
//! # Ok::<(), ()>(())
//! ```

/// What an executor holds: the bytes of the working set it reserved.
pub trait Held {
    /// Bytes reserved by this executor (host or device).
    fn held_bytes(&self) -> usize;
}

/// Executors by key, their reservations bounded (see the module docs).
#[derive(Debug)]
pub struct ExecutorCache<K, X> {
    limit: usize,
    /// Each entry with its last use (a tick of `clock`).
    entries: Vec<(K, X, u64)>,
    clock: u64,
}

impl<K: PartialEq, X: Held> ExecutorCache<K, X> {
    /// An empty cache holding at most `limit_bytes` of reservations (or one executor that alone
    /// needs more).
    pub const fn new(limit_bytes: usize) -> Self {
        Self { limit: limit_bytes, entries: Vec::new(), clock: 0 }
    }

    /// The bound on what it holds.
    pub fn limit_bytes(&self) -> usize {
        self.limit
    }

    /// A new bound; executors over it are dropped now, least recently used first.
    pub fn set_limit_bytes(&mut self, limit_bytes: usize) {
        self.limit = limit_bytes;
        self.evict_until(0);
    }

    /// Bytes reserved by the executors it holds.
    pub fn held_bytes(&self) -> usize {
        self.entries.iter().map(|(_, x, _)| x.held_bytes()).sum()
    }

    /// Executors held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops every executor and its working set.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// The keys of the executors held, least recently made first.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.entries.iter().map(|(k, _, _)| k)
    }

    /// Keeps only the executors whose key `keep` accepts (the others, and their working sets,
    /// are dropped).
    pub fn retain(&mut self, mut keep: impl FnMut(&K) -> bool) {
        self.entries.retain(|(k, _, _)| keep(k));
    }

    /// The executor of `key`, made by `make` when there is none; `bytes` is what the new one
    /// will reserve (its plan's working set), for which older ones are dropped first.
    pub fn get_or_try_insert<E>(
        &mut self,
        key: K,
        bytes: usize,
        make: impl FnOnce() -> Result<X, E>,
    ) -> Result<&mut X, E> {
        self.clock += 1;
        let index = match self.entries.iter().position(|(k, _, _)| *k == key) {
            Some(i) => i,
            None => {
                self.evict_until(bytes);
                self.entries.push((key, make()?, 0));
                self.entries.len() - 1
            }
        };
        let entry = &mut self.entries[index];
        entry.2 = self.clock;
        Ok(&mut entry.1)
    }

    /// Drops the least recently used executors until `incoming` more bytes fit the limit (all of
    /// them when it alone does not).
    fn evict_until(&mut self, incoming: usize) {
        while !self.entries.is_empty() && self.held_bytes().saturating_add(incoming) > self.limit {
            let oldest =
                self.entries.iter().enumerate().min_by_key(|(_, (_, _, used))| *used).map(|(i, _)| i);
            if let Some(i) = oldest {
                self.entries.remove(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Reserved(usize);
    impl Held for Reserved {
        fn held_bytes(&self) -> usize {
            self.0
        }
    }

    fn take(cache: &mut ExecutorCache<u32, Reserved>, key: u32, bytes: usize) -> usize {
        cache.get_or_try_insert(key, bytes, || Ok::<_, ()>(Reserved(bytes))).unwrap().0
    }

    #[test]
    fn reuses_by_key_and_drops_the_least_recently_used_first() {
        let mut cache = ExecutorCache::new(100);
        take(&mut cache, 1, 40);
        take(&mut cache, 2, 40);
        take(&mut cache, 1, 40); // 1 is now the more recent
        assert_eq!((cache.len(), cache.held_bytes()), (2, 80));
        take(&mut cache, 3, 40); // 2 goes
        let keys: Vec<u32> = cache.entries.iter().map(|(k, _, _)| *k).collect();
        assert_eq!(keys, vec![1, 3]);
    }

    #[test]
    fn one_executor_over_the_limit_is_held_alone_and_a_failed_make_keeps_nothing_new() {
        let mut cache = ExecutorCache::new(100);
        take(&mut cache, 1, 30);
        take(&mut cache, 2, 300);
        assert_eq!((cache.len(), cache.held_bytes()), (1, 300));
        let failed = cache.get_or_try_insert(3, 10, || Err::<Reserved, _>("refused"));
        assert_eq!(failed.err(), Some("refused"));
        assert_eq!(cache.len(), 0, "the 300 B executor went before the new one was made");
        take(&mut cache, 4, 50);
        take(&mut cache, 5, 20);
        cache.retain(|&k| k != 4);
        assert_eq!(cache.keys().copied().collect::<Vec<_>>(), vec![5]);
        cache.set_limit_bytes(10);
        assert!(cache.is_empty());
    }
}
