//! The GGUF container, family-agnostic: every header walked with bounds before candle's reader
//! sees it (counts, string and array lengths and tensor extents checked against the file's size,
//! so a hostile or truncated file is an error naming the file and the field, never a panic or a
//! huge allocation), typed metadata access, and how a model's GGUF files are found.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

use crate::error::{Error, Result};

/// Header bounds: more than any real model has, far less than a hostile file may claim.
const MAX_TENSORS: u64 = 1 << 16;
const MAX_KV: u64 = 1 << 16;
const MAX_STRING: u64 = 1 << 24;
const MAX_DIMS: u32 = 4;
/// Memory the parsed metadata may take. candle keeps every array element as its own `Value`
/// (32 bytes, a string's bytes besides), so a u8 array costs 32 times its size: the walk adds
/// up that cost before candle parses anything. Qwen3-VL's tokenizer (151k tokens and merges)
/// takes about 20 MiB.
pub const MAX_METADATA_MEMORY: u64 = 256 << 20;
/// What one parsed value costs beyond its string bytes: the `Value` and allocator overhead.
const VALUE_COST: u64 = std::mem::size_of::<Value>() as u64 + 16;

pub(crate) fn bad(path: &Path, message: impl Into<String>) -> Error {
    Error::Input { what: path.display().to_string(), message: message.into() }
}

/// Walks a GGUF header within the file's bytes: magic, version, counts, every key and value,
/// every tensor's dims, type and extent.
pub fn check_header(path: &Path) -> Result<()> {
    walk_header(path).map(|_| ())
}

/// `check_header`'s walk; returns `general.architecture` when the header has it.
fn walk_header(path: &Path) -> Result<Option<String>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    // SAFETY: read-only map of a file we only read; a concurrent truncation is the user's doing.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let mut r = Reader { b: &map, at: 0, path, memory: 0 };
    let magic = r.bytes(4, "magic")?;
    if magic != b"GGUF" {
        return Err(bad(path, format!("not a GGUF file (magic {magic:02x?})")));
    }
    let version = r.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(bad(path, format!("GGUF version {version} is not supported (2 or 3)")));
    }
    let tensors = r.u64("tensor count")?;
    if tensors > MAX_TENSORS {
        return Err(bad(path, format!("tensor count {tensors} exceeds {MAX_TENSORS}")));
    }
    let kvs = r.u64("metadata count")?;
    if kvs > MAX_KV {
        return Err(bad(path, format!("metadata count {kvs} exceeds {MAX_KV}")));
    }
    let mut alignment = 32u64;
    let mut architecture = None;
    for _ in 0..kvs {
        let key = r.string("metadata key")?;
        let ty = r.u32(&key)?;
        if key == "general.architecture" && ty == 8 {
            architecture = Some(r.string(&key)?);
        } else if key == "general.alignment" {
            // Any integer type candle reads it as, u8 to i32 (a u8 0 divides by zero in candle;
            // a 64-bit one it ignores, reading the data at 32 instead).
            let size = match ty {
                0 | 1 => 1,
                2 | 3 => 2,
                4 | 5 => 4,
                _ => return Err(bad(path, format!("general.alignment has type {ty}, not an integer of 8 to 32 bits"))),
            };
            let raw = r.bytes(size, &key)?;
            let mut le = [0u8; 8];
            le[..raw.len()].copy_from_slice(raw);
            let value = i64::from_le_bytes(le);
            // Sign-extend the signed types.
            let shift = 64 - 8 * size as u32;
            let value = if matches!(ty, 1 | 3 | 5 | 11) { (value << shift) >> shift } else { value };
            if value <= 0 || !(value as u64).is_power_of_two() || value > 1 << 20 {
                return Err(bad(path, format!("general.alignment = {value} is not a power of two up to 1 MiB")));
            }
            alignment = value as u64;
        } else {
            r.value(ty, &key, 0)?;
        }
    }
    let mut extents = Vec::with_capacity(tensors as usize);
    for _ in 0..tensors {
        let name = r.string("tensor name")?;
        let dims = r.u32(&name)?;
        if dims == 0 || dims > MAX_DIMS {
            return Err(bad(path, format!("tensor {name}: {dims} dimensions")));
        }
        let shape: Vec<u64> = (0..dims).map(|_| r.u64(&name)).collect::<Result<_>>()?;
        let ty = r.u32(&name)?;
        let dtype = ggml_type(ty).ok_or_else(|| {
            bad(path, format!("tensor {name}: GGML type {ty} ({}) is not supported (no kernel)", ggml_type_name(ty)))
        })?;
        let row = shape[0];
        let elems = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d).filter(|&e| e <= len.saturating_mul(8)))
            .ok_or_else(|| {
            bad(path, format!("tensor {name}: dimensions {shape:?} larger than the file could hold"))
        })?;
        let block = dtype.block_size() as u64;
        if !row.is_multiple_of(block) {
            return Err(bad(
                path,
                format!("tensor {name}: row of {row} values is not a multiple of the block {block}"),
            ));
        }
        let bytes = elems / block * dtype.type_size() as u64;
        let offset = r.u64(&name)?;
        extents.push((name, offset, bytes));
    }
    let data_start = r.at.div_ceil(alignment as usize) as u64 * alignment;
    for (name, offset, bytes) in extents {
        let end = data_start.checked_add(offset).and_then(|o| o.checked_add(bytes));
        if end.is_none_or(|e| e > len) {
            return Err(bad(
                path,
                format!("tensor {name}: bytes {offset}+{bytes} past the end of the file ({len} bytes; truncated?)"),
            ));
        }
    }
    Ok(architecture)
}

/// GGUF type ids candle reads (the ids of ggml.h).
pub(crate) fn ggml_type(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

pub(crate) fn ggml_type_name(id: u32) -> &'static str {
    match id {
        9 => "Q8_1",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "unknown",
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    path: &'a Path,
    /// Memory the metadata walked so far takes once parsed (`MAX_METADATA_MEMORY`).
    memory: u64,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let end = (self.at as u64)
            .checked_add(n)
            .filter(|&e| e <= self.b.len() as u64)
            .ok_or_else(|| bad(self.path, format!("truncated header: {what} needs {n} bytes at offset {}", self.at)))?;
        let s = &self.b[self.at..end as usize];
        self.at = end as usize;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(4, what)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(8, what)?.try_into().expect("8 bytes")))
    }
    /// A string's bytes, its length within `MAX_STRING`.
    fn string_bytes(&mut self, what: &str) -> Result<&'a [u8]> {
        let n = self.u64(what)?;
        if n > MAX_STRING {
            return Err(bad(self.path, format!("{what}: string of {n} bytes exceeds {MAX_STRING}")));
        }
        self.bytes(n, what)
    }
    fn string(&mut self, what: &str) -> Result<String> {
        Ok(String::from_utf8_lossy(self.string_bytes(what)?).into_owned())
    }
    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<()> {
        let start = self.at;
        self.value_inner(ty, key, depth)?;
        // A value costs its `Value` plus, for a string, its bytes (an array: its elements').
        self.memory += VALUE_COST + if ty == 8 { (self.at - start) as u64 } else { 0 };
        if self.memory > MAX_METADATA_MEMORY {
            return Err(bad(
                self.path,
                format!(
                    "{key}: the metadata would take more than {} MiB of memory once read (each array element is a value of its own), over the limit of {} MiB",
                    self.memory >> 20,
                    MAX_METADATA_MEMORY >> 20
                ),
            ));
        }
        Ok(())
    }

    fn value_inner(&mut self, ty: u32, key: &str, depth: u32) -> Result<()> {
        let fixed = match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            // A string value: its length checked, its bytes skipped (not copied).
            8 => {
                self.string_bytes(key)?;
                return Ok(());
            }
            9 if depth == 0 => {
                let elem = self.u32(key)?;
                let n = self.u64(key)?;
                // Every element takes at least one byte: a count beyond the rest of the file is a lie.
                if n > (self.b.len() - self.at) as u64 {
                    return Err(bad(self.path, format!("{key}: array of {n} elements is longer than the file")));
                }
                for _ in 0..n {
                    self.value(elem, key, depth + 1)?;
                }
                return Ok(());
            }
            _ => return Err(bad(self.path, format!("{key}: value type {ty} is not valid here"))),
        };
        self.bytes(fixed, key)?;
        Ok(())
    }
}

/// One GGUF file, its header read, the file mapped (`tensor` takes quantized blocks in place).
pub struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
    map: std::sync::Arc<memmap2::Mmap>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        check_header(path)?;
        let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // Buffered: candle's reader takes the metadata a few bytes at a time (a tokenizer's
        // 151k strings were 762,617 read calls on the 2B Q4_K_M, ~0.2-0.4 s of a load).
        let mut r = std::io::BufReader::with_capacity(1 << 20, &f);
        let content = Content::read(&mut r).map_err(|e| bad(path, format!("unreadable GGUF: {e}")))?;
        // SAFETY: a read-only map of a file we only read (see `walk_header`); replacing or
        // truncating the file while a model runs from it is the user's doing, as for llama.cpp.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(path, e))?;
        Ok(Self { path: path.to_path_buf(), content, map: std::sync::Arc::new(map) })
    }

    /// Where `name`'s bytes start in the file, and how many there are.
    fn extent(&self, name: &str) -> Option<(usize, usize)> {
        let info = self.content.tensor_infos.get(name)?;
        let bytes =
            (info.shape.elem_count() / info.ggml_dtype.block_size()).checked_mul(info.ggml_dtype.type_size())?;
        let offset = usize::try_from(self.content.tensor_data_offset.checked_add(info.offset)?).ok()?;
        offset.checked_add(bytes)?;
        Some((offset, bytes))
    }

    /// `name` with its blocks left in the mapped file (CPU, a block type candle multiplies);
    /// None otherwise.
    fn mapped(&self, name: &str, dev: &Device) -> Option<QTensor> {
        let info = self.content.tensor_infos.get(name)?;
        let (offset, _) = self.extent(name)?;
        if !dev.is_cpu() {
            return None;
        }
        crate::mapped::qtensor(&self.map, offset, info.ggml_dtype, info.shape.dims())
    }

    /// The experts of a 3-D `[experts, out, in]` tensor, each `[out, in]`: views of the mapped
    /// file where `tensor` would map it, cut from a read copy otherwise (the copy dropped after).
    pub(crate) fn experts(&self, name: &str, dev: &Device) -> Result<Vec<std::sync::Arc<QTensor>>> {
        let info =
            self.content.tensor_infos.get(name).ok_or_else(|| bad(&self.path, format!("tensor {name} is missing")))?;
        let &[e, o, i] = info.shape.dims() else {
            return Err(bad(
                &self.path,
                format!("tensor {name} has shape {:?}, not [experts, out, in]", info.shape.dims()),
            ));
        };
        let (offset, bytes) = self.extent(name).unwrap_or_default();
        let per = bytes / e.max(1);
        if dev.is_cpu() {
            let cut: Option<Vec<_>> = (0..e)
                .map(|x| {
                    crate::mapped::qtensor(&self.map, offset + x * per, info.ggml_dtype, &[o, i])
                        .map(std::sync::Arc::new)
                })
                .collect();
            if let Some(cut) = cut {
                return Ok(cut);
            }
        }
        cut_experts(&self.tensor(name, dev)?).map_err(|err| bad(&self.path, format!("tensor {name}: {err}")))
    }

    /// A float tensor (F32, F16, BF16) as stored, its bytes copied once from the map into a
    /// tensor of that dtype (candle's `dequantize` would widen every value to f32 and back), the
    /// mapped pages handed back after.
    /// None for block types.
    pub(crate) fn float_tensor(&self, name: &str, dev: &Device) -> Result<Option<candle_core::Tensor>> {
        let Some(info) = self.content.tensor_infos.get(name) else { return Ok(None) };
        let Some(dtype) = float_dtype(info.ggml_dtype) else { return Ok(None) };
        let (offset, bytes, data) = self.data(name)?;
        let shape = info.shape.dims();
        let t = if dev.is_cpu() {
            match dtype {
                candle_core::DType::F32 => candle_core::Tensor::from_vec(copy_out::<f32>(data), shape, dev),
                candle_core::DType::F16 => candle_core::Tensor::from_vec(copy_out::<half::f16>(data), shape, dev),
                _ => candle_core::Tensor::from_vec(copy_out::<half::bf16>(data), shape, dev),
            }
        } else {
            candle_core::Tensor::from_raw_buffer(data, dtype, shape, dev)
        }
        .map_err(|e| bad(&self.path, format!("tensor {name}: {e}")))?;
        // The tensor owns its copy: the file's pages need not stay in this process as well.
        crate::mapped::release(&self.map, offset, bytes);
        Ok(Some(t))
    }

    /// `name`'s offset, length and bytes in the mapped file.
    fn data(&self, name: &str) -> Result<(usize, usize, &[u8])> {
        let (offset, bytes) = self.extent(name).ok_or_else(|| bad(&self.path, format!("tensor {name} is missing")))?;
        let data = self
            .map
            .get(offset..offset + bytes)
            .ok_or_else(|| bad(&self.path, format!("tensor {name} lies past the end")))?;
        Ok((offset, bytes, data))
    }

    /// A 2-D float tensor `[rows, cols]` as the transposed view of a new contiguous `[cols, rows]`
    /// buffer written straight from the mapped file (one pass, on candle's pool): what a linear
    /// layer keeps (`vl_nn::linear::Dense` holds `W^T`; its `kernels::transpose` then takes the
    /// buffer as it is). `float_tensor` and a transpose would write every value twice, into fresh
    /// pages each time. On the CPU only; None where `float_tensor` applies instead (another
    /// device, rank, block type, or data not aligned for its type).
    pub(crate) fn float_tensor_transposed(&self, name: &str, dev: &Device) -> Result<Option<candle_core::Tensor>> {
        let Some(info) = self.content.tensor_infos.get(name) else { return Ok(None) };
        let &[rows, cols] = info.shape.dims() else { return Ok(None) };
        if !dev.is_cpu() {
            return Ok(None);
        }
        let (offset, bytes, data) = self.data(name)?;
        fn view<T: Copy + Send + Sync>(data: &[u8], n: usize) -> Option<&[T]> {
            let fits = data.len() >= n * std::mem::size_of::<T>()
                && (data.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>());
            // SAFETY: aligned for T and long enough (checked above); f32 / f16 / bf16 are plain
            // data valid for any bits; the map outlives the borrow.
            fits.then(|| unsafe { std::slice::from_raw_parts(data.as_ptr() as *const T, n) })
        }
        let n = rows * cols;
        let t = match info.ggml_dtype {
            GgmlDType::F32 => view::<f32>(data, n).map(|v| {
                candle_core::Tensor::from_vec(vl_nn::kernels::transpose_slice(v, rows, cols), (cols, rows), dev)
            }),
            GgmlDType::F16 => view::<half::f16>(data, n).map(|v| {
                candle_core::Tensor::from_vec(vl_nn::kernels::transpose_slice(v, rows, cols), (cols, rows), dev)
            }),
            GgmlDType::BF16 => view::<half::bf16>(data, n).map(|v| {
                candle_core::Tensor::from_vec(vl_nn::kernels::transpose_slice(v, rows, cols), (cols, rows), dev)
            }),
            _ => None,
        };
        let Some(t) = t else { return Ok(None) };
        let t = t.and_then(|t| t.t()).map_err(|e| bad(&self.path, format!("tensor {name}: {e}")))?;
        crate::mapped::release(&self.map, offset, bytes);
        Ok(Some(t))
    }

    /// Hands `name`'s mapped pages back (`mapped::release`): for weights whose kernels no longer
    /// read the stored blocks.
    pub(crate) fn release(&self, name: &str) {
        if let Some((offset, bytes)) = self.extent(name) {
            crate::mapped::release(&self.map, offset, bytes);
        }
    }

    pub(crate) fn get(&self, key: &str) -> Result<&Value> {
        self.content.metadata.get(key).ok_or_else(|| bad(&self.path, format!("metadata key {key} is missing")))
    }
    pub(crate) fn usize(&self, key: &str, max: usize) -> Result<usize> {
        let v = self.get(key)?;
        let n = v.to_u64().or_else(|_| v.to_u32().map(u64::from)).or_else(|_| v.to_i32().map(|x| x.max(0) as u64));
        let n = n.map_err(|_| bad(&self.path, format!("{key} is not an integer")))?;
        if n == 0 || n > max as u64 {
            return Err(bad(&self.path, format!("{key} = {n} is outside 1..={max}")));
        }
        Ok(n as usize)
    }
    pub(crate) fn f64(&self, key: &str) -> Result<f64> {
        let v = self.get(key)?;
        v.to_f32()
            .map(f64::from)
            .or_else(|_| v.to_f64())
            .map_err(|_| bad(&self.path, format!("{key} is not a number")))
            .and_then(|x| if x.is_finite() && x > 0.0 { Ok(x) } else { Err(bad(&self.path, format!("{key} = {x}"))) })
    }
    pub(crate) fn str(&self, key: &str) -> Result<&str> {
        self.get(key)?.to_string().map(String::as_str).map_err(|_| bad(&self.path, format!("{key} is not a string")))
    }
    pub(crate) fn array(&self, key: &str) -> Result<&Vec<Value>> {
        self.get(key)?.to_vec().map_err(|_| bad(&self.path, format!("{key} is not an array")))
    }
    /// The id of a token string in `tokenizer.ggml.tokens`.
    pub(crate) fn token_id(&self, token: &str) -> Option<u32> {
        let tokens = self.array("tokenizer.ggml.tokens").ok()?;
        tokens.iter().position(|v| v.to_string().is_ok_and(|x| x == token)).map(|i| i as u32)
    }
    pub(crate) fn dims(&self, name: &str) -> Option<Vec<usize>> {
        self.content.tensor_infos.get(name).map(|i| i.shape.dims().to_vec())
    }
    /// `name` as stored: quantized blocks mapped in place on the CPU, otherwise read.
    pub(crate) fn tensor(&self, name: &str, dev: &Device) -> Result<QTensor> {
        if let Some(t) = self.mapped(name, dev) {
            return Ok(t);
        }
        let mut f = std::fs::File::open(&self.path).map_err(|e| Error::io(&self.path, e))?;
        self.content.tensor(&mut f, name, dev).map_err(|e| bad(&self.path, format!("tensor {name}: {e}")))
    }
}

/// A quantized 3-D expert tensor `[E, out, in]` cut into one `[out, in]` tensor per expert: each
/// expert's rows are whole blocks, contiguous in the tensor's bytes, so they are copied as stored
/// (no dequantize). Drop `q` after, so the bytes are held once.
pub fn cut_experts(q: &QTensor) -> Result<Vec<std::sync::Arc<QTensor>>> {
    let dims = q.shape().dims().to_vec();
    let [e, o, i] = dims[..] else {
        return Err(Error::Input { what: "expert tensor".into(), message: format!("shape {dims:?} is not 3-D") });
    };
    let bytes = q.data()?;
    let per = bytes.len() / e.max(1);
    let dev = q.device();
    (0..e)
        .map(|x| {
            let part = candle_core::quantized::ggml_file::qtensor_from_ggml(
                q.dtype(),
                &bytes[x * per..(x + 1) * per],
                vec![o, i],
                &dev,
            )?;
            Ok(std::sync::Arc::new(part))
        })
        .collect()
}

/// The GGUF files of `path`: the file itself (with `mmproj`, or an `mmproj*.gguf` beside it), or
/// a directory holding one text GGUF and at most one `mmproj*.gguf`.
pub fn find_files(path: &Path, mmproj: Option<&Path>) -> Result<(PathBuf, Option<PathBuf>)> {
    let is_gguf = |p: &Path| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    let is_mmproj = |p: &Path| p.file_name().is_some_and(|n| n.to_string_lossy().to_lowercase().starts_with("mmproj"));
    let dir = if path.is_dir() { path.to_path_buf() } else { path.parent().unwrap_or(Path::new(".")).to_path_buf() };
    let mut listed: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| Error::io(&dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| is_gguf(p))
        .collect();
    listed.sort();
    let text = if path.is_dir() {
        let texts: Vec<&PathBuf> = listed.iter().filter(|p| !is_mmproj(p)).collect();
        match texts.as_slice() {
            [one] => (*one).clone(),
            [] => return Err(bad(path, "no text-model .gguf file in this directory")),
            many => {
                return Err(bad(
                    path,
                    format!(
                        "{} text-model .gguf files ({}); pass one with --model",
                        many.len(),
                        many.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
                    ),
                ))
            }
        }
    } else {
        path.to_path_buf()
    };
    let mm = match mmproj {
        Some(m) if m.is_dir() => {
            return Err(Error::Input {
                what: format!("--mmproj {}", m.display()),
                message: "is a directory; name the projector's .gguf file".into(),
            })
        }
        Some(m) if !m.is_file() => {
            let why = if m.symlink_metadata().is_ok() { "broken symbolic link or not a file" } else { "no such file" };
            return Err(Error::Input { what: format!("--mmproj {}", m.display()), message: why.into() });
        }
        Some(m) => Some(m.to_path_buf()),
        None => {
            let found: Vec<&PathBuf> = listed.iter().filter(|p| is_mmproj(p)).collect();
            match found.as_slice() {
                [] => None,
                [one] => Some((*one).clone()),
                _ => return Err(bad(&dir, "several mmproj*.gguf files: pick one with --mmproj")),
            }
        }
    };
    Ok((text, mm))
}

/// Whether `path` names GGUF weights (a .gguf file, or a directory with one and no config.json).
pub fn is_gguf(path: &Path) -> bool {
    if path.is_file() {
        return path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    }
    path.is_dir()
        && !path.join("config.json").exists()
        && std::fs::read_dir(path).is_ok_and(|mut d| {
            d.any(|e| e.is_ok_and(|e| e.path().extension().is_some_and(|x| x.eq_ignore_ascii_case("gguf"))))
        })
}

/// The text-model file of `path` (a .gguf file, or the one text .gguf of a directory).
pub fn find_text_file(path: &Path) -> Result<PathBuf> {
    find_files(path, None).map(|(t, _)| t).or_else(|e| if path.is_file() { Ok(path.to_path_buf()) } else { Err(e) })
}

/// A GGUF file's `general.architecture`, read from its checked header.
/// (The bounded walk alone: the loader reads the whole header after the registry picks it.)
pub fn architecture(path: &Path) -> Result<String> {
    walk_header(path)?.ok_or_else(|| bad(path, "metadata key general.architecture is missing"))
}

/// What `vl quantize` wrote.
#[derive(Debug, Clone)]
pub struct Written {
    pub text: std::path::PathBuf,
    pub mmproj: std::path::PathBuf,
    /// Tensors written, both files.
    pub tensors: usize,
    /// The text model's 2-D weights by the block type stored (llama.cpp's names: Q4_K, Q5_0, BF16...).
    pub stored: std::collections::BTreeMap<String, usize>,
    /// 2-D weights whose rows do not fill the recipe's blocks, stored in a fallback type.
    pub fell_back: usize,
    /// Those weights by the type they fell back to (llama.cpp's names: Q5_0, Q8_0, F32...).
    pub fell_back_to: std::collections::BTreeMap<String, usize>,
}

/// What `vl quantize` writes for the text model's 2-D weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recipe {
    /// Every 2-D weight in this type (embeddings and lm_head included), as `--quantize` does at load.
    Uniform(vl_nn::QuantType),
    /// llama.cpp's Q4_K_M: Q4_K, with the output (or the tied embedding table) in Q6_K, and
    /// attn_v and ffn_down in Q6_K on the layers `use_more_bits` picks (llama-quant.cpp).
    Q4KM,
    /// No blocks: every matrix in this float type (F32, F16 or BF16), the norms, the DeltaNet
    /// convolution and the routers in F32, as llama.cpp's converter writes with `--outtype`.
    Float(candle_core::DType),
}

impl Recipe {
    /// The name in file names, as llama.cpp spells it.
    pub fn file_tag(self) -> &'static str {
        match self {
            Recipe::Q4KM => "Q4_K_M",
            Recipe::Uniform(vl_nn::QuantType::Q4K) => "Q4_K",
            Recipe::Uniform(vl_nn::QuantType::Q5K) => "Q5_K",
            Recipe::Uniform(vl_nn::QuantType::Q6K) => "Q6_K",
            Recipe::Uniform(vl_nn::QuantType::Q8_0) => "Q8_0",
            Recipe::Uniform(q) => q.name(),
            Recipe::Float(candle_core::DType::BF16) => "BF16",
            Recipe::Float(candle_core::DType::F16) => "F16",
            Recipe::Float(_) => "F32",
        }
    }

    /// llama.cpp's `general.file_type` (llama_ftype).
    pub(crate) fn file_type(self) -> u32 {
        match self {
            Recipe::Q4KM => 15,
            Recipe::Uniform(vl_nn::QuantType::Q4K) => 14,
            Recipe::Uniform(vl_nn::QuantType::Q5K) => 16,
            Recipe::Uniform(vl_nn::QuantType::Q6K) => 18,
            Recipe::Uniform(vl_nn::QuantType::Q8_0) => 7,
            Recipe::Uniform(_) => 0,
            Recipe::Float(candle_core::DType::BF16) => 32,
            Recipe::Float(candle_core::DType::F16) => 1,
            Recipe::Float(_) => 0,
        }
    }

    /// The float type every matrix is written in, for `Float`; None for the block recipes.
    pub fn float(self) -> Option<candle_core::DType> {
        match self {
            Recipe::Float(d) => Some(d),
            _ => None,
        }
    }

    /// The block type of a text tensor (llama.cpp name) of `layer` among `layers` (the file's
    /// blocks, an MTP block included), in a model of `experts` routed experts per layer (1:
    /// dense), as llama-quantize picks it; None for `Float`. A hybrid model's DeltaNet `attn_qkv`
    /// counts as its layer's `attn_v` (llama-quant.cpp's `category_is_attn_v`).
    pub(crate) fn text_type(
        self,
        name: &str,
        layer: Option<usize>,
        layers: usize,
        tied: bool,
        experts: usize,
    ) -> Option<vl_nn::QuantType> {
        let attn_v = name.ends_with("attn_v.weight") || name.ends_with("attn_qkv.weight");
        let q = match self {
            Recipe::Uniform(q) => q,
            Recipe::Float(_) => return None,
            Recipe::Q4KM => {
                let more_bits =
                    |i: usize| i < layers / 8 || i >= 7 * layers / 8 || (i as i64 - (layers / 8) as i64) % 3 == 2;
                if name == "output.weight" || (tied && name == "token_embd.weight") {
                    return Some(vl_nn::QuantType::Q6K);
                }
                // llama.cpp's rule for 8-expert models (Mixtral's): attention K and V in Q8_0, its
                // output in Q5_K.
                if experts == 8 {
                    if attn_v || name.ends_with("attn_k.weight") {
                        return Some(vl_nn::QuantType::Q8_0);
                    }
                    if name.ends_with("attn_output.weight") {
                        return Some(vl_nn::QuantType::Q5K);
                    }
                }
                // `ffn_down` and the experts' `ffn_down_exps` alike.
                if (attn_v || name.contains("ffn_down")) && layer.is_some_and(more_bits) {
                    return Some(vl_nn::QuantType::Q6K);
                }
                vl_nn::QuantType::Q4K
            }
        };
        Some(q)
    }
}

/// `data` (whole values of `T`, any alignment) copied into a new vector on candle's pool: the
/// copy's new pages are faulted in by both threads and never zeroed first (a single-threaded
/// zeroed copy of a 0.8 GB mmproj cost ~0.4 s of the load).
/// The candle dtype of a GGUF float type (None for block types).
pub(crate) fn float_dtype(t: GgmlDType) -> Option<candle_core::DType> {
    match t {
        GgmlDType::F32 => Some(candle_core::DType::F32),
        GgmlDType::F16 => Some(candle_core::DType::F16),
        GgmlDType::BF16 => Some(candle_core::DType::BF16),
        _ => None,
    }
}

fn copy_out<T: Copy + Send + Sync>(data: &[u8]) -> Vec<T> {
    let size = std::mem::size_of::<T>();
    let n = data.len() / size;
    let mut out: Vec<T> = Vec::with_capacity(n);
    const CHUNK: usize = 1 << 20;
    let dst = SendBytes(out.as_mut_ptr() as *mut u8);
    candle_core::utils::barrier_pool().execute_chunked((n * size).div_ceil(CHUNK), |range| {
        for c in range {
            let (a, b) = (c * CHUNK, ((c + 1) * CHUNK).min(n * size));
            // SAFETY: bytes a..b of the reserved capacity (n values) belong to this work item;
            // `data` holds at least n * size bytes.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().add(a), dst.get().add(a), b - a) };
        }
    });
    // SAFETY: every byte of the n values was copied above (T is plain data: f32, f16, bf16).
    unsafe { out.set_len(n) };
    out
}

/// A raw destination pointer shared with the pool's threads (each writes its own range).
#[derive(Clone, Copy)]
struct SendBytes(*mut u8);
// SAFETY: only used for disjoint writes by the pool's work items, into a buffer that outlives
// the pool's call (`execute_chunked` returns when every item is done).
unsafe impl Send for SendBytes {}
// SAFETY: as for Send: shared references only copy the pointer; each item writes its own range.
unsafe impl Sync for SendBytes {}
impl SendBytes {
    fn get(self) -> *mut u8 {
        self.0
    }
}
