//! The tests of `stored`: each row bit for bit its product alone, and products against
//! candle's on the same blocks, on each kernel this CPU runs.

use super::*;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// Every kernel this CPU runs: the AVX2 ones wherever it has AVX2 (an AVX-512 CPU too), the
/// AVX-512 ones and, with VNNI, theirs.
fn kernels() -> Vec<Kernel> {
    #[cfg(target_arch = "x86_64")]
    let vnni = is_x86_feature_detected!("avx512vnni");
    #[cfg(not(target_arch = "x86_64"))]
    let vnni = false;
    let runs = |k: &Kernel| match k {
        Kernel::Avx2 => avx2_runs(),
        Kernel::Avx512 => avx512_runs(),
        Kernel::Vnni => avx512_runs() && vnni,
    };
    [Kernel::Avx2, Kernel::Avx512, Kernel::Vnni].into_iter().filter(runs).collect()
}

fn matmul_on(
    weights: &[(Blocks, &[u8], usize)],
    x: &[f32],
    m: usize,
    k: usize,
    kernel: Kernel,
) -> Option<Vec<Vec<f32>>> {
    let each: Vec<(Blocks, &[u8], usize, usize)> = weights.iter().map(|&(kind, b, n)| (kind, b, n, 0)).collect();
    matmul_each_on(&each, &[(x, m)], k, kernel)
}

/// candle's product of `x` [m, k] with the stored blocks of `q` (its Q8_K rows, its
/// vec_dot), on the compact blocks.
fn candles(q: &QTensor, xs: &[f32], (m, k, n): (usize, usize, usize)) -> Vec<f32> {
    use candle_core::quantized::k_quants::{matmul, BlockQ4K, BlockQ6K};
    let bytes = q.data().unwrap();
    let mut want = vec![0f32; m * n];
    // SAFETY: the bytes are a Vec of the tensor's blocks (QTensor::quantize), whole blocks.
    unsafe {
        match q.dtype() {
            GgmlDType::Q4K => {
                let b = std::slice::from_raw_parts(bytes.as_ptr() as *const BlockQ4K, bytes.len() / Q4K_BYTES);
                matmul((m, k, n), xs, b, &mut want).unwrap()
            }
            _ => {
                let b = std::slice::from_raw_parts(bytes.as_ptr() as *const BlockQ6K, bytes.len() / Q6K_BYTES);
                matmul((m, k, n), xs, b, &mut want).unwrap()
            }
        }
    }
    want
}

#[test]
fn each_row_is_bit_for_bit_its_product_alone() {
    // Drafted tokens are verified with the token before them in one product: each row must
    // be exactly what decoding it alone gives, however many rows share the pass.
    if kernels().is_empty() {
        eprintln!("no AVX2 here: the kernels are not used, nothing to compare");
        return;
    }
    for (kind, dtype) in [(Blocks::Q4K, GgmlDType::Q4K), (Blocks::Q6K, GgmlDType::Q6K)] {
        // An odd n: with VNNI the weight rows go in pairs, and the last row goes paired with
        // itself.
        let (n, k) = (25, 512);
        let w = crate::testing::randn(5, 0.05, (n, k)).unwrap();
        let q = QTensor::quantize(&w, dtype).unwrap();
        let bytes = q.data().unwrap();
        for m in [2, 5, 8, 9, SMALL_ROWS] {
            let xs = crate::testing::randn(6 + m as u64, 1.0, (m, k)).unwrap().flatten_all().unwrap();
            let xs = xs.to_vec1::<f32>().unwrap();
            for kernel in kernels() {
                let all = matmul_on(&[(kind, &bytes, n)], &xs, m, k, kernel).unwrap().remove(0);
                for r in 0..m {
                    let x = &xs[r * k..(r + 1) * k];
                    let one = matmul_on(&[(kind, &bytes, n)], x, 1, k, kernel).unwrap().remove(0);
                    assert_eq!(&all[r * n..(r + 1) * n], &one[..], "{kind:?}, {kernel:?}, {m} rows: row {r}");
                }
            }
        }
    }
}

#[test]
fn products_match_candles_on_the_same_blocks() {
    if kernels().is_empty() {
        eprintln!("no AVX2 here: the kernels are not used, nothing to compare");
        return;
    }
    for (kind, dtype) in [(Blocks::Q4K, GgmlDType::Q4K), (Blocks::Q6K, GgmlDType::Q6K)] {
        for (m, n, k) in [(1, 40, 512), (3, 16, 256), (4, 33, 768), (2, 1, 1024), (8, 17, 512), (13, 20, 256)] {
            let w = crate::testing::randn(11 + n as u64, 0.05, (n, k)).unwrap();
            let x = crate::testing::randn(12 + m as u64, 1.0, (m, k)).unwrap();
            let q = QTensor::quantize(&w, dtype).unwrap();
            let bytes = q.data().unwrap();
            let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let want = candles(&q, &xs, (m, k, n));
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            let deq = q.dequantize(&Device::Cpu).unwrap();
            let exact = x.matmul(&deq.t().unwrap()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for kernel in kernels() {
                let got = matmul_on(&[(kind, &bytes, n), (kind, &bytes, n)], &xs, m, k, kernel).unwrap();
                assert_eq!(got[0], got[1]);
                for (i, (g, w)) in got[0].iter().zip(&want).enumerate() {
                    let at = format!("{kind:?} {kernel:?} ({m},{n},{k}) [{i}]");
                    assert!((g - w).abs() <= 1e-5 * scale.max(1.0), "{at}: {g} vs {w}");
                }
                // And close to the f32 product of the dequantized weight (the Q8_K rounding of x).
                let err = got[0].iter().zip(&exact).fold(0f32, |a, (g, e)| a.max((g - e).abs()));
                assert!(err <= 0.02 * scale.max(1.0), "{kind:?} {kernel:?} ({m},{n},{k}) off the f32 product by {err}");
            }
        }
    }
    let rows = SMALL_ROWS + 1;
    let t = Tensor::zeros((rows, 256), candle_core::DType::F32, &Device::Cpu).unwrap();
    let xs = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let more = matmul(&[(Blocks::Q4K, &[0u8; 144], 1)], &xs, rows, 256);
    assert_eq!(more.is_some(), takes_prompts(), "more rows than SMALL_ROWS: AVX2 only");
    assert!(matmul(&[(Blocks::Q6K, &[0u8; 144], 1)], &xs[..256], 1, 256).is_none(), "bytes are not whole blocks");
}

#[test]
fn the_avx2_kernels_take_a_prompts_rows() {
    // Without AVX-512 a prompt's products run here too, its rows in chunks of whole passes
    // (200 rows of 2048: three chunks); the AVX-512 kernels leave more than SMALL_ROWS to
    // `stored_tiles`.
    for kernel in kernels() {
        let (m, n, k) = (200, 19, 2048);
        for (kind, dtype) in [(Blocks::Q4K, GgmlDType::Q4K), (Blocks::Q6K, GgmlDType::Q6K)] {
            let w = crate::testing::randn(31, 0.05, (n, k)).unwrap();
            let q = QTensor::quantize(&w, dtype).unwrap();
            let bytes = q.data().unwrap();
            let xs = crate::testing::randn(32, 1.0, (m, k)).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let got = matmul_on(&[(kind, &bytes, n)], &xs, m, k, kernel);
            if kernel != Kernel::Avx2 {
                assert!(got.is_none(), "{kernel:?} took {m} rows");
                continue;
            }
            let got = got.unwrap().remove(0);
            let want = candles(&q, &xs, (m, k, n));
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 1e-5 * scale.max(1.0), "{kind:?} ({m},{n},{k}) [{i}]: {g} vs {w}");
            }
            for r in [0, 79, 80, 81, 160, 199] {
                let one = matmul_on(&[(kind, &bytes, n)], &xs[r * k..(r + 1) * k], 1, k, kernel).unwrap().remove(0);
                assert_eq!(&got[r * n..(r + 1) * n], &one[..], "{kind:?}: row {r} of {m}");
            }
        }
    }
}

#[test]
fn the_reorders_agree() {
    // The byte permutes (where this CPU has VBMI) against the byte loop, for both orders, on
    // random Q8_K rows.
    let k = 1024;
    let xs = crate::testing::randn(41, 1.0, (3, k)).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut q8 = vec![BlockQ8K::zeros(); 3 * k / QK];
    for (row, blocks) in xs.chunks_exact(k).zip(q8.chunks_exact_mut(k / QK)) {
        crate::q8k::quantize(row, blocks);
    }
    for order in [&Q4K_VNNI_ORDER, &Q6K_VNNI_ORDER] {
        let (mut a, mut b) = (vec![0i8; q8.len() * QK], vec![0i8; q8.len() * QK]);
        reorder_blocks(order, q8_bytes(&q8), &mut a);
        reorder_scalar(order, q8_bytes(&q8), &mut b);
        assert_eq!(a, b);
        assert!(a.iter().any(|&v| v != 0));
    }
}

#[test]
fn the_vector_scale_decode_follows_the_q4k_format() {
    // `vnni::q4k_pair_scales` on seeded random block heads (every bit pattern of the packed
    // scales is a valid block) against the format's definition (ggml's `get_scale_min_k4`):
    // sub-block j < 4 has scale q[j] & 63 and min q[j + 4] & 63; j >= 4 has scale
    // (q[j + 4] & 15) | (q[j - 4] >> 6) << 4 and min (q[j + 4] >> 4) | (q[j] >> 6) << 4.
    #[cfg(target_arch = "x86_64")]
    {
        if !kernels().contains(&Kernel::Avx512) {
            return;
        }
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let scale_min = |q: &[u8], j: usize| -> (u8, u8) {
            if j < 4 {
                (q[j] & 63, q[j + 4] & 63)
            } else {
                ((q[j + 4] & 15) | (q[j - 4] >> 6) << 4, (q[j + 4] >> 4) | (q[j] >> 6) << 4)
            }
        };
        for _ in 0..500 {
            let mut blocks = [[0u8; 16]; 2];
            for blk in &mut blocks {
                for (i, b) in blk.iter_mut().enumerate() {
                    *b = next() as u8;
                    // Keep d and dmin finite f16 values (exponent bits not all ones).
                    if i % 2 == 1 && i < 4 {
                        *b &= 0x7b;
                    }
                }
            }
            // SAFETY: the CPU has AVX-512 F and BW (checked above); 16 bytes a block.
            let (dsc, dmn) = unsafe {
                let (a, b) = vnni::q4k_pair_scales(blocks[0].as_ptr(), blocks[1].as_ptr());
                (
                    std::mem::transmute::<std::arch::x86_64::__m512, [f32; 16]>(a),
                    std::mem::transmute::<std::arch::x86_64::__m512, [f32; 16]>(b),
                )
            };
            for (r, blk) in blocks.iter().enumerate() {
                let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                let dmin = half::f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                for (i, &j) in Q4K_FOLDED.iter().enumerate() {
                    let (sc, mn) = scale_min(&blk[4..], j);
                    assert_eq!(dsc[8 * r + i].to_bits(), (d * sc as f32).to_bits(), "block {r} sub-block {j}");
                    assert_eq!(dmn[8 * r + i].to_bits(), (dmin * mn as f32).to_bits(), "block {r} sub-block {j}");
                }
            }
        }
    }
}
