//! The memory the native path's weights are copied into at load ([`WeightArena`]):
//! anonymous maps advised into transparent huge pages, every matrix of a model packed
//! into a few of them.
//!
//! A decode step streams every matrix of the model once. Read through the file's memory
//! map, or from one small map per matrix, each 4 KB of it costs a TLB miss: the page
//! cache hands out 4 KB pages, and a map smaller than 2 MB never gets a huge one (most
//! of a layer's matrices are 0.1–4 MB). Packed together into maps advised with
//! `MADV_HUGEPAGE`, every whole 2 MB of them is one TLB entry. On a Zen 4 a single
//! thread streams ~21–24 GB/s from 4 KB pages and ~29–32 GB/s from 2 MB ones
//! (docs/performance.md, "Why it is fast").
//!
//! The first map is sized to the whole file, reserved at once: where the kernel will not
//! commit that much (a model larger than memory and swap, a `ulimit -v` below twice the
//! file: the file stays mapped too), nothing is copied and every matrix is read from the
//! file's map, with the same bits, as a matrix whose read fails is.
//!
//! The advice is a hint: where the kernel refuses it (THP `never`, not Linux) the maps
//! keep 4 KB pages and the same contents. Pages are only made resident as they are
//! written, so the maps' unused tails cost address space, not memory (at most one
//! partly used 2 MB page per map).

use std::sync::{Arc, Mutex};

/// The size of a transparent huge page on x86-64 and the maps' alignment.
const HUGE_PAGE: usize = 2 << 20;

/// A further map's size when a matrix fits (the first is [`WeightArena::with_capacity`]'s):
/// address space reserved, resident only as written.
const CHUNK: usize = 256 << 20;

/// Where each copy starts: a cache line, so the kernels' 64-byte loads never split one
/// across two lines more often than the file's layout would.
const ALIGN: usize = 64;

/// Hands out write-once regions of huge-page maps for the weights copied at load
/// ([`WeightArena::copy_in`]). One per [`WeightSource`](crate::WeightSource): the maps
/// live as long as any matrix copied into them ([`ArenaBytes`] holds its map).
#[derive(Default)]
pub struct WeightArena {
    /// The first map's size: what the source's matrices can take at most, so they all
    /// share one map and at most one 2 MB page is partly used.
    capacity: usize,
    /// The map being filled and the offset of its first free byte.
    current: Mutex<Option<(Arc<memmap2::MmapRaw>, usize)>>,
}

impl std::fmt::Debug for WeightArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightArena").finish_non_exhaustive()
    }
}

/// A region of a [`WeightArena`] map, written once by [`WeightArena::copy_in`] and
/// read-only after: the copy of one matrix.
#[derive(Clone)]
pub struct ArenaBytes {
    map: Arc<memmap2::MmapRaw>,
    offset: usize,
    len: usize,
}

impl ArenaBytes {
    /// The copy's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `offset..offset + len` is inside the map (`copy_in` only hands out
        // ranges it checked against the map's length) and the map stays mapped while
        // `self.map` holds it. The range was handed to exactly one `copy_in` call, which
        // wrote it through its only `&mut` and returned before this value existed; no
        // code writes it after, so shared borrows of it never alias a mutable one.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(self.offset), self.len) }
    }
}

impl std::fmt::Debug for ArenaBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaBytes")
            .field("len", &self.len)
            .finish()
    }
}

impl WeightArena {
    /// An arena whose first map (made on the first copy) has room for `bytes`: the
    /// size of the file's tensor data. Nothing is mapped until a copy is made.
    pub fn with_capacity(bytes: usize) -> Self {
        WeightArena {
            capacity: bytes,
            current: Mutex::default(),
        }
    }

    /// `len` bytes of a huge-page map, filled by `fill` (given them zeroed) and then
    /// read-only, or `None` when no map of that size can be made or `fill` returns
    /// `false`. A failed fill's region is given back: its whole pages are returned to
    /// the system (`MADV_DONTNEED`), the rest zeroed, and the next copy starts there, so
    /// a read that fails partway holds no memory (the matrix is then read from the
    /// file's map, and held once).
    pub fn copy_in(&self, len: usize, fill: impl FnOnce(&mut [u8]) -> bool) -> Option<ArenaBytes> {
        // A poisoned lock only means another load panicked while filling: the offset it
        // holds was already moved past that region, so the state is still consistent.
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let fits = |(map, next): &(Arc<memmap2::MmapRaw>, usize)| {
            next.checked_add(len).is_some_and(|end| end <= map.len())
        };
        if !current.as_ref().is_some_and(fits) {
            let size = if current.is_none() {
                self.capacity
            } else {
                CHUNK
            };
            *current = Some(new_map(len.max(size))?);
        }
        let (map, next) = current.as_mut()?;
        let offset = *next;
        // Checked by `fits` or by `new_map`, which makes room for `len` after its start.
        let end = offset.checked_add(len).filter(|&e| e <= map.len())?;
        *next = end.checked_next_multiple_of(ALIGN).unwrap_or(usize::MAX);
        // SAFETY: `offset..end` is inside the map (checked above), which is mapped
        // readable and writable (an anonymous `MmapMut` turned into `MmapRaw`) and stays
        // mapped while `map` is held. The bump offset only moves forward under the lock,
        // so this range is given to this call alone: no other `&mut` or `&` of it exists
        // (an `ArenaBytes` for it is only made below, after the borrow ends).
        let region = unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr().add(offset), len) };
        if !fill(region) {
            give_back(map, offset, end);
            *next = offset;
            return None;
        }
        Some(ArenaBytes {
            map: Arc::clone(map),
            offset,
            len,
        })
    }
}

impl WeightArena {
    /// Returns to the system the unused rest of the last 2 MB page the copies reached
    /// (with huge pages the first write into a 2 MB page made all of it resident):
    /// called once the model is loaded. The bytes copied stay as they are; a later
    /// copy into the rest is given zeroed pages again.
    pub fn trim(&self) {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let Some((map, next)) = current.as_ref() else {
            return;
        };
        let from = next.next_multiple_of(4096).min(map.len());
        let to = next.next_multiple_of(HUGE_PAGE).min(map.len());
        if from < to {
            // SAFETY: `from..to` is inside the map and at or past the bump offset, so
            // no `ArenaBytes` covers any of it and (the lock held) no `copy_in` is
            // writing it: `MADV_DONTNEED` only drops pages nothing reads, and a later
            // `copy_in` of this range writes zero-filled pages, as on a new map.
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, from, to - from)
            };
        }
    }
}

/// Returns bytes `offset..end` of `map`, a region no `ArenaBytes` covers and no other
/// borrow holds (a failed `copy_in`'s, its lock still held), to the zeroed state of a
/// new map: its whole pages dropped (`MADV_DONTNEED`: resident no more, zero when next
/// touched), the partial pages at its ends zeroed.
fn give_back(map: &memmap2::MmapRaw, offset: usize, end: usize) {
    const PAGE: usize = 4096;
    let (a, b) = (offset.next_multiple_of(PAGE), end / PAGE * PAGE);
    let zero = |from: usize, to: usize| {
        if from < to {
            // SAFETY: `from..to` lies inside `offset..end`, inside the map (checked by
            // `copy_in` before handing the region out); the caller holds the only
            // access to that region, and `fill`'s borrow of it has ended.
            unsafe { std::ptr::write_bytes(map.as_mut_ptr().add(from), 0, to - from) };
        }
    };
    if a < b {
        // SAFETY: `a..b` is whole pages inside the region (see above), which nothing
        // else reads or writes: dropping them only makes them zero pages again.
        let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, a, b - a) };
        zero(offset, a);
        zero(b, end);
    } else {
        zero(offset, end);
    }
}

/// A new anonymous map with room for `len` bytes from its first 2 MB boundary, advised
/// into transparent huge pages; the returned offset is that boundary.
fn new_map(len: usize) -> Option<(Arc<memmap2::MmapRaw>, usize)> {
    let map = memmap2::MmapMut::map_anon(len.checked_add(HUGE_PAGE)?).ok()?;
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    let start = (map.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - map.as_ptr() as usize;
    Some((Arc::new(memmap2::MmapRaw::from(map)), start))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Copies are written once and read back as written, one after another; a fill
    /// that fails gives its region back, zeroed, to the next copy.
    #[test]
    fn copies_hold_their_bytes_and_a_failed_fill_gives_its_region_back() {
        let arena = WeightArena::with_capacity(1 << 20);
        let a = arena
            .copy_in(1000, |b| {
                b.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8);
                true
            })
            .unwrap();
        let mut failed_at = std::ptr::null();
        let none = arena.copy_in(3 * 4096 + 100, |b| {
            assert!(b.iter().all(|&x| x == 0), "a new region is zeroed");
            b.fill(0xAB);
            failed_at = b.as_ptr();
            false
        });
        assert!(none.is_none());
        let c = arena
            .copy_in(5 * 4096, |b| {
                assert!(b.iter().all(|&x| x == 0), "the region given back is zeroed");
                assert_eq!(
                    b.as_ptr(),
                    failed_at,
                    "the next copy starts where it failed"
                );
                b.fill(7);
                true
            })
            .unwrap();
        assert!(a.bytes().iter().enumerate().all(|(i, &x)| x == i as u8));
        assert_eq!(a.bytes().len(), 1000);
        assert!(c.bytes().len() == 5 * 4096 && c.bytes().iter().all(|&x| x == 7));
        // A copy larger than the first map's room gets a map of its own.
        let big = arena.copy_in(2 << 20, |b| {
            b[0] = 1;
            true
        });
        assert_eq!(big.unwrap().bytes()[0], 1);
        assert!(a.bytes().iter().enumerate().all(|(i, &x)| x == i as u8));
    }
}
