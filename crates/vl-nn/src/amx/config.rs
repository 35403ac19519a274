//! The AMX tile configuration and state of this thread: tmm0-3 sums, tmm4-5 activations,
//! tmm6-7 weights, each 16 rows of 64 bytes (palette 1).

use std::arch::asm;

/// The tile configuration (palette 1): tmm0-3 sums, tmm4-5 activations, tmm6-7 weights,
/// each 16 rows of 64 bytes.
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

/// Loads the tile configuration on this thread (each call: other code on the thread, e.g.
/// candle's AMX kernels, may have loaded its own).
pub(crate) fn configure() {
    let mut c = Config { palette: 1, start_row: 0, reserved: [0; 14], bytes_per_row: [0; 16], rows: [0; 16] };
    for t in 0..8 {
        c.bytes_per_row[t] = 64;
        c.rows[t] = 16;
    }
    // SAFETY: only called where `available()` holds; a valid palette-1 configuration.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &c, options(nostack, readonly)) };
}

/// Returns the tile state to its initial one (nothing to save on a context switch).
pub(crate) fn release() {
    // SAFETY: AMX present (as for `configure`).
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}
