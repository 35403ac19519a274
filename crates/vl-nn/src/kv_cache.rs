//! A per-layer key/value cache that grows with the sequence in blocks of `BLOCK` positions (no
//! preallocation of the context window), appends are in-place copies, and the cached keys and
//! values are returned as views of the first `len` positions. A cache that outgrows its
//! allocation is copied into a larger one; how much larger is its owner's call (`reserve`): one
//! block by default, or `growth(len)` (an eighth of its length, at most `MAX_GROWTH`) where the
//! engine's budget has room, so a long answer copies its cache every len / 8 tokens rather than
//! every `BLOCK`. Can be reset and truncated (e.g. to reuse a shared prompt prefix); reports the
//! bytes it holds. A cache may keep its rows in a dtype of its own (`in_dtype`: f16 or bf16 rows
//! for f32 compute, half the bytes): appended rows are rounded to it, and the views are in it.

use candle_core::{DType, Tensor};

use crate::{Error, Result};

/// Positions a cache grows by: capacity is always a multiple of it.
pub const BLOCK: usize = 64;

/// Capacity, in positions, that holds `positions`: the next multiple of `BLOCK`.
pub fn blocks_for(positions: usize) -> usize {
    positions.div_ceil(BLOCK).max(1) * BLOCK
}

/// The largest growth step, in positions (`growth`).
pub const MAX_GROWTH: usize = 32 * BLOCK;

/// Positions a full cache of `len` positions grows by when the memory allows: an eighth of its
/// length in whole blocks, at least one block and at most `MAX_GROWTH`. Growing copies the
/// whole cache (its rows are head-major), so steps in proportion to the length keep the copies
/// a bounded share of decoding (block by block, a 4,000-position cache of the 2B, 0.9 GB in
/// f32, would be copied every 64 tokens), at most an eighth more memory than the positions use.
pub fn growth(len: usize) -> usize {
    blocks_for(len / 8).min(MAX_GROWTH)
}

#[derive(Debug, Clone, Default)]
pub struct KvCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    len: usize,
    /// Positions the next allocation reserves (e.g. a prompt's length), so a known total is
    /// allocated once.
    reserve: usize,
    /// The dtype rows are kept in; None: the appended rows' own.
    dtype: Option<DType>,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty cache that keeps its rows in `dtype` (appended rows are converted: rounded to
    /// nearest even for f16 / bf16).
    pub fn in_dtype(dtype: DType) -> Self {
        Self { dtype: Some(dtype), ..Self::default() }
    }

    /// The dtype rows are kept in, when it was set (`in_dtype`).
    pub fn dtype(&self) -> Option<DType> {
        self.dtype
    }

    /// Cached positions.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Allocated positions.
    pub fn capacity(&self) -> usize {
        self.k.as_ref().map_or(0, |k| k.dim(1).unwrap_or(0))
    }

    /// Bytes held by the key and value buffers (capacity, not just the used part).
    pub fn bytes(&self) -> usize {
        [&self.k, &self.v].iter().filter_map(|t| t.as_ref()).map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }

    /// Drops everything, memory included (the dtype it keeps stays).
    pub fn reset(&mut self) {
        *self = Self { dtype: self.dtype, ..Self::default() };
    }

    /// The next allocation holds at least `positions` (an expected length, or the length plus a
    /// `growth` step): growth to that length then copies nothing.
    pub fn reserve(&mut self, positions: usize) {
        self.reserve = positions;
    }

    /// Keeps the first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// A new cache holding a copy of the first `len` positions (capacity for `len`, in blocks);
    /// this one is left as it is.
    pub fn copy_prefix(&self, len: usize) -> Result<KvCache> {
        let len = len.min(self.len);
        let mut out = KvCache { reserve: len, dtype: self.dtype, ..Default::default() };
        if let (Some(k), Some(v), true) = (&self.k, &self.v, len > 0) {
            out.append(&k.narrow(1, 0, len)?, &v.narrow(1, 0, len)?)?;
        }
        out.reserve = 0;
        Ok(out)
    }

    /// Appends `k`, `v` ([kv_heads, new, head_dim]; converted to the cache's dtype when it has
    /// one) and returns views of all cached positions.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let converted;
        let (k, v) = match self.dtype {
            Some(d) if k.dtype() != d || v.dtype() != d => {
                converted = (k.to_dtype(d)?, v.to_dtype(d)?);
                (&converted.0, &converted.1)
            }
            _ => (k, v),
        };
        let (heads, new, dim) = k.dims3()?;
        if v.dims() != k.dims() {
            return Err(Error::Shape {
                layer: "KvCache",
                message: format!("k {:?} and v {:?} differ", k.dims(), v.dims()),
            });
        }
        let need = self.len + new;
        if need > self.capacity() {
            let cap = blocks_for(need.max(self.reserve));
            let grow = |old: &Option<Tensor>| -> Result<Tensor> {
                let buf = Tensor::zeros((heads, cap, dim), k.dtype(), k.device())?;
                if let Some(old) = old {
                    if self.len > 0 {
                        buf.slice_set(&old.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
                    }
                }
                Ok(buf)
            };
            let (nk, nv) = (grow(&self.k)?, grow(&self.v)?);
            self.k = Some(nk);
            self.v = Some(nv);
        }
        let (kb, vb) = (self.k.as_ref().unwrap(), self.v.as_ref().unwrap());
        if let Some(old) = kb.dims().first() {
            if *old != heads || kb.dim(2)? != dim {
                return Err(Error::Shape {
                    layer: "KvCache",
                    message: format!("appending {:?} to a cache of {:?}", k.dims(), kb.dims()),
                });
            }
        }
        kb.slice_set(&k.contiguous()?, 1, self.len)?;
        vb.slice_set(&v.contiguous()?, 1, self.len)?;
        self.len = need;
        Ok((kb.narrow(1, 0, need)?, vb.narrow(1, 0, need)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn t(vals: &[f32]) -> Tensor {
        Tensor::from_slice(vals, (1, vals.len(), 1), &Device::Cpu).unwrap()
    }

    #[test]
    fn growth_steps_are_an_eighth_of_the_length_in_blocks() {
        assert_eq!(growth(0), BLOCK);
        assert_eq!(growth(512), BLOCK, "512 / 8 = 64");
        assert_eq!(growth(576), 2 * BLOCK, "576 / 8 = 72, two blocks");
        assert_eq!(growth(4096), 8 * BLOCK);
        assert_eq!(growth(16384), 32 * BLOCK);
        assert_eq!(growth(1 << 20), MAX_GROWTH);
        // A full cache reserved a step ahead grows by the step at its next append, keeping its rows.
        let mut c = KvCache::new();
        let rows: Vec<f32> = (0..640).map(|i| i as f32).collect();
        c.append(&t(&rows), &t(&rows)).unwrap();
        assert_eq!(c.capacity(), 640);
        c.reserve(c.len() + growth(c.len()));
        let (k, _) = c.append(&t(&[-1.0]), &t(&[-1.0])).unwrap();
        assert_eq!((c.len(), c.capacity()), (641, 640 + 2 * BLOCK));
        let k = k.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!((k[0], k[639], k[640]), (0.0, 639.0, -1.0));
    }

    #[test]
    fn grows_truncates_and_resets() {
        let mut c = KvCache::new();
        assert_eq!((c.len(), c.bytes()), (0, 0));
        let (k, _) = c.append(&t(&[1., 2.]), &t(&[10., 20.])).unwrap();
        assert_eq!(k.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![1., 2.]);
        assert_eq!(c.capacity(), BLOCK);
        assert_eq!(c.bytes(), 2 * BLOCK * 4);
        let many: Vec<f32> = (0..(BLOCK as u32 + 6)).map(|i| i as f32).collect();
        let (k, v) = c.append(&t(&many), &t(&many)).unwrap();
        assert_eq!(c.len(), BLOCK + 8);
        // One block more, not a doubling.
        assert_eq!(c.capacity(), 2 * BLOCK);
        let more: Vec<f32> = vec![1.0; 2 * BLOCK];
        c.append(&t(&more), &t(&more)).unwrap();
        assert_eq!(c.capacity(), 4 * BLOCK);
        let k = k.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(&k[..3], &[1., 2., 0.]);
        assert_eq!(k[BLOCK + 7], BLOCK as f32 + 5.);
        assert_eq!(v.dims(), &[1, BLOCK + 8, 1]);
        c.truncate(2);
        let (k, _) = c.append(&t(&[7.]), &t(&[7.])).unwrap();
        assert_eq!(k.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![1., 2., 7.]);
        let copy = c.copy_prefix(2).unwrap();
        assert_eq!((copy.len(), copy.capacity()), (2, BLOCK));
        let (k, _) = c.append(&t(&[8.]), &t(&[8.])).unwrap();
        assert_eq!(k.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![1., 2., 7., 8.]);
        let mut copy = copy;
        let (k, _) = copy.append(&t(&[9.]), &t(&[9.])).unwrap();
        assert_eq!(k.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![1., 2., 9.]);
        c.reset();
        assert_eq!((c.len(), c.bytes()), (0, 0));
    }

    #[test]
    fn a_cache_in_its_own_dtype_rounds_what_it_keeps() {
        let mut c = KvCache::in_dtype(DType::F16);
        assert_eq!(c.dtype(), Some(DType::F16));
        // 1 + 2^-12 is not an f16 (10 fraction bits): it rounds to 1 (nearest even).
        let (k, v) = c.append(&t(&[1.0 + 1.0 / 4096.0, 3.0]), &t(&[0.1, -2.0])).unwrap();
        assert_eq!(k.dtype(), DType::F16);
        let k = k.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(k, vec![1.0, 3.0]);
        let v = v.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(v, vec![half::f16::from_f32(0.1).to_f32(), -2.0]);
        assert_eq!(c.bytes(), 2 * BLOCK * 2, "two bytes a value");
        assert_eq!(c.copy_prefix(1).unwrap().dtype(), Some(DType::F16));
        c.reset();
        assert_eq!((c.len(), c.dtype()), (0, Some(DType::F16)));
        let mut b = KvCache::in_dtype(DType::BF16);
        let (k, _) = b.append(&t(&[1.0 + 1.0 / 256.0]), &t(&[1.0])).unwrap();
        assert_eq!(k.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![1.0]);
    }

    #[test]
    fn mismatched_shapes_are_errors() {
        let mut c = KvCache::new();
        c.append(&t(&[1.]), &t(&[1.])).unwrap();
        let two_heads = Tensor::zeros((2, 1, 1), DType::F32, &Device::Cpu).unwrap();
        assert!(c.append(&two_heads, &two_heads).is_err());
        assert!(c.append(&t(&[1.]), &t(&[1., 2.])).is_err());
    }
}
