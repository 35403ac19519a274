//! Process-wide allocator settings, for binaries (the `vl` CLI calls this first thing).

/// Keeps large freed buffers inside the process instead of returning them to the kernel after
/// every op. candle allocates each op's output afresh: with glibc's defaults, buffers over its
/// dynamic mmap threshold (at most 32 MiB) are mapped and unmapped per op, so every 64 MiB
/// activation of a 4096-patch vision block is page-faulted and zeroed by the kernel again
/// (measured: 0.6 s of 4.6 s in one MLP projection over the 24 blocks). Here allocations up to
/// 256 MiB come from the heap and up to 512 MiB of free heap top is kept. Peak memory is
/// unchanged; memory is handed back later. glibc (Linux gnu) only; a no-op elsewhere.
pub fn keep_large_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tunables; called before other threads allocate.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

/// Returns the free heap pages to the kernel (glibc's `malloc_trim`): after a large part of the
/// working set is dropped for good (a released vision tower), so that resident memory falls
/// before the next stage allocates. A no-op elsewhere.
pub fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator's arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}
