//! MLX affine quantization: `w = scale * q + bias` per group of `group_size` consecutive values
//! of a row, `q` an unsigned `bits`-bit integer. Rows are packed into u32 words as one
//! little-endian bit stream (for 3, 5 and 6 bits values straddle word boundaries).

use crate::error::{Error, Result};

pub const SUPPORTED_BITS: [usize; 6] = [2, 3, 4, 5, 6, 8];

/// Number of u32 words holding one row of `cols` values.
pub fn packed_cols(cols: usize, bits: usize) -> usize {
    cols * bits / 32
}

/// Unpacks and dequantizes `rows x cols` values. `packed` is the row-major little-endian byte
/// image of the u32 words; `scales` and `biases` are [rows, cols / group] in f32.
pub fn dequantize(
    packed: &[u8],
    scales: &[f32],
    biases: &[f32],
    rows: usize,
    cols: usize,
    bits: usize,
    group: usize,
) -> Result<Vec<f32>> {
    let bad = |m: String| Error::Input { what: "affine-quantized tensor".into(), message: m };
    if !SUPPORTED_BITS.contains(&bits) {
        return Err(bad(format!("{bits} bits is not supported (2, 3, 4, 5, 6, 8)")));
    }
    if group == 0 || !cols.is_multiple_of(group) || !(cols * bits).is_multiple_of(32) {
        return Err(bad(format!("{cols} columns do not fit group size {group} at {bits} bits")));
    }
    let row_bytes = packed_cols(cols, bits) * 4;
    let groups = cols / group;
    if packed.len() != rows * row_bytes || scales.len() != rows * groups || biases.len() != rows * groups {
        return Err(bad(format!(
            "{} packed bytes, {} scales, {} biases do not describe {rows}x{cols} at {bits} bits, group {group}",
            packed.len(),
            scales.len(),
            biases.len()
        )));
    }
    let mask = (1u32 << bits) - 1;
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let row = &packed[r * row_bytes..(r + 1) * row_bytes];
        for c in 0..cols {
            let bit = c * bits;
            let (byte, shift) = (bit / 8, bit % 8);
            // Up to 8 + 7 bits starting mid-byte: read 2 bytes (3 never needed for bits <= 8 + shift <= 16).
            let lo = row[byte] as u32;
            let hi = if shift + bits > 8 { row[byte + 1] as u32 } else { 0 };
            let q = ((lo | (hi << 8)) >> shift) & mask;
            let g = r * groups + c / group;
            out.push(scales[g] * q as f32 + biases[g]);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packs values as a little-endian bit stream (the inverse, written independently).
    fn pack(vals: &[u32], bits: usize) -> Vec<u8> {
        let mut out = vec![0u8; vals.len() * bits / 8];
        for (i, &v) in vals.iter().enumerate() {
            for b in 0..bits {
                if v >> b & 1 == 1 {
                    let pos = i * bits + b;
                    out[pos / 8] |= 1 << (pos % 8);
                }
            }
        }
        out
    }

    #[test]
    fn four_bit_words_by_hand() {
        // One row of 8 values in one u32: 0x76543210 holds 0,1,...,7 from the low nibble up.
        let packed = 0x7654_3210u32.to_le_bytes();
        let w = dequantize(&packed, &[2.0], &[-1.0], 1, 8, 4, 8).unwrap();
        assert_eq!(w, vec![-1.0, 1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0]);
    }

    #[test]
    fn every_width_roundtrips_exactly() {
        for bits in SUPPORTED_BITS {
            let (rows, cols, group) = (3, 64, 32);
            let vals: Vec<u32> =
                (0..rows * cols).map(|i| ((i as u32).wrapping_mul(2654435761u32) >> 7) % (1 << bits)).collect();
            let mut packed = Vec::new();
            for r in 0..rows {
                packed.extend(pack(&vals[r * cols..(r + 1) * cols], bits));
            }
            let scales: Vec<f32> = (0..rows * 2).map(|i| 0.5 + i as f32).collect();
            let biases: Vec<f32> = (0..rows * 2).map(|i| -(i as f32)).collect();
            let w = dequantize(&packed, &scales, &biases, rows, cols, bits, group).unwrap();
            for (i, x) in w.iter().enumerate() {
                let g = (i / cols) * 2 + (i % cols) / group;
                assert_eq!(*x, scales[g] * vals[i] as f32 + biases[g], "bits {bits} index {i}");
            }
        }
    }

    #[test]
    fn bad_layouts_are_errors() {
        assert!(dequantize(&[0; 4], &[1.0], &[0.0], 1, 8, 7, 8).is_err());
        assert!(dequantize(&[0; 4], &[1.0], &[0.0], 1, 8, 4, 3).is_err());
        assert!(dequantize(&[0; 8], &[1.0], &[0.0], 1, 8, 4, 8).is_err());
    }
}
