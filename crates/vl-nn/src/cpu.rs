//! The bottom of the crate's CPU code, importing nothing of the crate: what the kernel modules
//! (`kernels`, `amx`, `avx2`, `avx512`, `panels`, `stored`, `stored_tiles`, `linear`,
//! `attention`) share. The run-time CPU feature checks (AVX-512, AMX), a buffer's base pointer
//! shared with pool workers, a CPU storage's f32 values, and the base-2 exponential of the
//! softmaxes (its polynomial shared with the vector versions in `avx2` and `avx512`).

/// Whether this CPU has AVX-512F and this build may use it: the AVX2 stand-in build
/// (`--cfg vl_avx2_proxy`, from `tools/bench/vision-side-by-side` with `VL_VISION_ISA=avx2`)
/// never does, so on an AVX-512 machine it takes every path an AVX2-only CPU takes.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512() -> bool {
    !cfg!(vl_avx2_proxy) && std::arch::is_x86_feature_detected!("avx512f")
}

/// Whether this CPU and OS run `amx`'s bf16 tiles: x86_64 with AMX-TILE, AMX-BF16, AVX-512 F/BW/VL and
/// AVX512-BF16 (the activations' rounding), and on Linux the tile state granted to this process
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once). False in the AVX2 stand-in build.
pub fn amx_bf16() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| {
            if !has_avx512()
                || !std::arch::is_x86_feature_detected!("avx512bw")
                || !std::arch::is_x86_feature_detected!("avx512vl")
                || !std::arch::is_x86_feature_detected!("avx512bf16")
            {
                return false;
            }
            // CPUID.(7,0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE (`is_x86_feature_detected!`
            // does not take the AMX names on stable Rust).
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a plain system call with integer arguments; it fails cleanly (non-zero)
            // where the kernel does not grant the tile state.
            unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
        })
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        false
    }
}

/// Whether this CPU has AVX512-VNNI (`vpdpbusd`) besides AVX-512 F/BW, and this build may use it;
/// `VL_NO_VNNI=1` says no (to compare the two kernels on one machine). Asked once.
pub fn has_avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            has_avx512()
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vnni")
                && std::env::var_os("VL_NO_VNNI").is_none_or(|v| v.is_empty() || v == "0")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7, what candle checks before its own
/// AMX products of quantized weights). Asked once.
pub(crate) fn has_amx_int8() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            let info = std::arch::x86_64::__cpuid_count(7, 0);
            info.edx & (1 << 24) != 0 && info.edx & (1 << 25) != 0
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// A buffer's base pointer shared with pool workers that write disjoint parts of it.
pub(crate) struct SendPtr<T>(pub(crate) *mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
// SAFETY: a `SendPtr` is only an address; it never dereferences itself. Every write through it
// is in an `unsafe` block of a parallel region whose work items own disjoint elements of a buffer
// that outlives the region (what the region's SAFETY comments state), so moving or sharing the
// address across the pool's threads adds no access of its own; `T: Send` because those threads
// write `T` values into the buffer.
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: as for `Send`: `&SendPtr` gives only a copy of the address.
unsafe impl<T: Send> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// The f32 values of a CPU storage (None for other devices and dtypes).
pub(crate) fn cpu_f32(s: &candle_core::Storage) -> Option<&[f32]> {
    cpu_slice(s)
}

/// A custom op's f32 operand as its contiguous values, else an error naming `op`.
pub(crate) fn contiguous_f32<'a>(
    s: &'a candle_core::CpuStorage,
    l: &candle_core::Layout,
    op: &str,
) -> candle_core::Result<&'a [f32]> {
    let candle_core::CpuStorage::F32(v) = s else { candle_core::bail!("{op}: f32 only") };
    let Some((a, b)) = l.contiguous_offsets() else { candle_core::bail!("{op}: contiguous tensors only") };
    Ok(&v[a..b])
}

/// A CPU storage's elements as `E`, if it holds that type.
pub(crate) fn cpu_slice<E: candle_core::WithDType>(s: &candle_core::Storage) -> Option<&[E]> {
    match s {
        candle_core::Storage::Cpu(c) => c.as_slice::<E>().ok(),
        _ => None,
    }
}

/// `exp2_nonpositive`'s polynomial for `2^r` on [-1/2, 1/2], highest degree first (Horner; the
/// vector versions in `avx2` and `avx512` use the same coefficients in the same order).
#[allow(clippy::approx_constant)] // the fitted linear coefficient is near ln 2, but not ln 2
pub(crate) const EXP2_POLY: [f32; 6] = [1.327_735_7e-3, 9.671_589e-3, 5.550_689_6e-2, 2.402_224_1e-1, 6.931_47e-1, 1.0];

/// `2^x` for `x <= 0` to about 2 ulp (relative error <= 1.8e-7 in the fit), flushing below
/// `2^-126` to `2^-126`; NaN stays NaN. The softmax's exponential when the scores are in base 2
/// (q scaled by `log2 e`): x = n + r with |r| <= 1/2, a degree-5 polynomial for `2^r` with
/// constant term 1 (so `2^0` is exactly 1), its other coefficients fitted for relative error on
/// [-1/2, 1/2], `2^n` from the exponent bits. Four operations fewer than `exp`: no range
/// reduction by ln 2 and no upper clamp.
#[inline(always)]
pub fn exp2_nonpositive(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    // Written as a comparison so that NaN passes through (`f32::max` would drop it).
    let x = if x < -126.0 { -126.0 } else { x };
    let t = x + MAGIC;
    let n = t - MAGIC;
    let r = x - n;
    let mut p = EXP2_POLY[0];
    for c in &EXP2_POLY[1..] {
        p = p.mul_add(r, *c);
    }
    // n in [-126, 0]: its biased exponent, shifted into place.
    let bits = (t.to_bits().wrapping_sub(MAGIC.to_bits()) as i32 + 127) as u32;
    p * f32::from_bits(bits << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp2_matches_std_to_a_few_ulp() {
        let mut worst = 0f32;
        let mut x = -126.0f32;
        while x <= 0.0 {
            let (a, b) = (exp2_nonpositive(x), x.exp2());
            worst = worst.max(((a - b) / b).abs());
            x += 0.000_71;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp2_nonpositive(0.0), 1.0);
        assert_eq!(exp2_nonpositive(-1.0), 0.5);
        assert!(exp2_nonpositive(-1000.0) <= 1.2e-38 && exp2_nonpositive(f32::NEG_INFINITY) >= 0.0);
        assert!(exp2_nonpositive(f32::NAN).is_nan());
    }
}
