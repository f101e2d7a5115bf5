//! Byte buffers that start on a page boundary, for request data.
//!
//! The kernel copies into and out of user memory with `rep movsb`, which is
//! much slower when the user address is not cache-line aligned: on this
//! project's development host a 1 MiB `pread` from the page cache took
//! 123 µs into a buffer 16 bytes past a page boundary — where a 1 MiB `Vec`
//! from glibc's allocator starts — and 60 µs into a page-aligned one (64-byte
//! alignment was as fast). Read replies are a `pread` into such a buffer and
//! a `writev` out of it, so the buffer's address alone decided a quarter of
//! the server's CPU time per 1 MiB read.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment of every [`PageBuf`].
pub const ALIGN: usize = 4096;

/// A growable byte buffer whose first byte is [`ALIGN`]-aligned. Bytes
/// beyond the length but within the capacity keep what they held (they are
/// initialized: the allocation is zeroed), so growing within the capacity
/// costs no memset.
pub struct PageBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: PageBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for PageBuf {}
// SAFETY: shared access only reads through `&[u8]`.
unsafe impl Sync for PageBuf {}

impl PageBuf {
    /// An empty buffer (no allocation).
    pub const fn new() -> Self {
        PageBuf {
            ptr: NonNull::dangling(),
            len: 0,
            cap: 0,
        }
    }

    /// Bytes it holds without reallocating.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the length to `len`, reallocating (zeroed, old contents not
    /// kept) if the capacity is smaller. The bytes up to `len` hold whatever
    /// they held before: callers overwrite them.
    pub fn set_len(&mut self, len: usize) {
        if len > self.cap {
            *self = Self::zeroed(len);
        }
        self.len = len;
    }

    /// Empties the buffer, keeping its allocation.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// A buffer of `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        if len == 0 {
            return Self::new();
        }
        let cap = len.next_multiple_of(ALIGN);
        let layout = Self::layout(cap);
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout);
        };
        PageBuf { ptr, len, cap }
    }

    fn layout(cap: usize) -> Layout {
        // A request is at most a few MiB (the protocol's payload limit):
        // no size here comes near isize::MAX.
        Layout::from_size_align(cap, ALIGN).expect("buffer size within isize::MAX")
    }
}

impl Default for PageBuf {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        if self.cap > 0 {
            // SAFETY: allocated by `zeroed` with this same layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) };
        }
    }
}

impl Deref for PageBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `cap >= len` initialized bytes (zeroed
        // at allocation), or dangling with `len == 0`, which a slice allows.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for PageBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageBuf")
            .field("len", &self.len)
            .field("cap", &self.cap)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_page_and_keeps_contents_within_capacity() {
        let mut b = PageBuf::zeroed(10_000);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        assert_eq!((b.len(), b.capacity()), (10_000, 12_288));
        assert!(b.iter().all(|&x| x == 0));
        b[9_999] = 7;
        let p = b.as_ptr();
        b.clear();
        assert!(b.is_empty());
        b.set_len(12_288);
        // Same allocation, old byte still there, no memset.
        assert_eq!(b.as_ptr(), p);
        assert_eq!(b[9_999], 7);
        b.set_len(1 << 20);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        assert_eq!(b.len(), 1 << 20);
        assert!(b.iter().all(|&x| x == 0));
    }

    #[test]
    fn empty_buffers_allocate_nothing() {
        let mut b = PageBuf::new();
        assert_eq!((b.len(), b.capacity()), (0, 0));
        assert!(b.is_empty());
        b.set_len(0);
        assert_eq!(b.capacity(), 0);
        let z = PageBuf::zeroed(0);
        assert_eq!(z.capacity(), 0);
        assert_eq!(&z[..], &[] as &[u8]);
    }
}
