//! How the CPU engine's buffers come back from the allocator: glibc's malloc (mallopt(3))
//! serves blocks from 128 KiB up with a fresh `mmap` and gives the top of its heap back to the
//! OS once 128 KiB are free there (it raises the first limit itself, but only after such a
//! block is freed, and the second with it), so a forward pass's outputs (hundreds of KiB to a few MiB
//! each, a prompt's ~200 of them) would come back as new pages every time: a page fault and a
//! zeroed page each 4 KiB. Raised limits keep freed buffers in the heap for the next ones.

/// Blocks up to this size come from the heap (glibc refuses more than 32 MiB on 64-bit
/// targets, `HEAP_MAX_SIZE / 2`).
const MMAP_THRESHOLD: i32 = 32 << 20;
/// Free memory at the top of the heap kept, up to this much.
const TRIM_THRESHOLD: i32 = 256 << 20;

/// Sets the limits for this process (glibc only; elsewhere nothing). Idempotent. The trim
/// limit is set only once the mmap one is taken: setting either freezes glibc's own rise of
/// the mmap threshold, which alone would be worse than the defaults.
pub fn keep_freed_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's tunables; it refuses values it cannot take.
    unsafe {
        if libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 {
            libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
        }
    }
}
