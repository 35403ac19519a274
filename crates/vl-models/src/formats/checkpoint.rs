//! Model-agnostic safetensors checkpoints: one file or a sharded set (`model.safetensors.index.json`),
//! memory-mapped, with every header validated at open and errors that name the file and key.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
use safetensors::tensor::{Dtype as StDtype, SafeTensors};

use crate::error::{Error, Result};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const SHARD_INDEX: &str = "model.safetensors.index.json";

/// Where one tensor lives and what it looks like on disk.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    file: usize,
    /// Byte range within the mapped file (header included in the offset).
    start: usize,
    end: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The weights of one model directory.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<PathBuf>,
    mmaps: Vec<Mmap>,
    tensors: BTreeMap<String, TensorInfo>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("files", &self.files)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

#[derive(serde::Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` (sharded) or `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join(SHARD_INDEX);
        if index.is_file() {
            let text = crate::limits::read_text(&index, crate::limits::MAX_METADATA_FILE_BYTES)?;
            let idx: ShardIndex =
                serde_json::from_str(&text).map_err(|source| Error::Json { path: index.clone(), source })?;
            // Shards are files of this directory: no paths elsewhere (`../x`, `/dev/zero`).
            if let Some((key, bad)) = idx.weight_map.iter().find(|(_, f)| {
                let p = Path::new(f.as_str());
                p.file_name().map(|n| n != p.as_os_str()).unwrap_or(true)
            }) {
                return Err(Error::Safetensors {
                    path: index,
                    message: format!("weight_map puts `{key}` in {bad:?}, which is not a file name in this directory"),
                });
            }
            let mut names: Vec<&String> = idx.weight_map.values().collect();
            names.sort();
            names.dedup();
            let files: Vec<PathBuf> = names.iter().map(|n| dir.join(n)).collect();
            let ck = Self::open_files(dir, files)?;
            for (key, file) in &idx.weight_map {
                let in_file = ck.tensors.get(key).map(|t| &ck.files[t.file]);
                if in_file != Some(&dir.join(file)) {
                    return Err(Error::Safetensors {
                        path: index,
                        message: format!("weight_map puts `{key}` in {file}, but that file does not hold it"),
                    });
                }
            }
            Ok(ck)
        } else if dir.join(SINGLE_FILE).is_file() {
            Self::open_files(dir, vec![dir.join(SINGLE_FILE)])
        } else if !dir.is_dir() {
            Err(Error::io(dir, std::io::Error::new(std::io::ErrorKind::NotFound, "model directory not found")))
        } else {
            Err(Error::NoWeights { dir: dir.to_path_buf() })
        }
    }

    /// Opens an explicit list of safetensors files as one checkpoint; a key in two files is an error.
    pub fn open_files(dir: &Path, files: Vec<PathBuf>) -> Result<Self> {
        let mut mmaps = Vec::with_capacity(files.len());
        let mut tensors = BTreeMap::new();
        for (fi, path) in files.iter().enumerate() {
            let file = File::open(path).map_err(|e| Error::io(path, e))?;
            // SAFETY: the map is read-only; a file truncated underneath us is outside our contract,
            // as with every mmap-based loader.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
            let (header, meta) = SafeTensors::read_metadata(&mmap).map_err(|e| Error::Safetensors {
                path: path.clone(),
                message: format!("not a valid safetensors file: {e}"),
            })?;
            let base = 8 + header;
            for (name, info) in meta.tensors() {
                let ti = TensorInfo {
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    file: fi,
                    start: base + info.data_offsets.0,
                    end: base + info.data_offsets.1,
                };
                if let Some(prev) = tensors.insert(name.clone(), ti) {
                    return Err(Error::Safetensors {
                        path: path.clone(),
                        message: format!("tensor `{name}` also appears in {}", files[prev.file].display()),
                    });
                }
            }
            mmaps.push(mmap);
        }
        Ok(Self { dir: dir.to_path_buf(), files, mmaps, tensors })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    pub fn tensors(&self) -> &BTreeMap<String, TensorInfo> {
        &self.tensors
    }

    pub fn info(&self, key: &str) -> Option<&TensorInfo> {
        self.tensors.get(key)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.tensors.contains_key(key)
    }

    /// The file holding `key`.
    pub fn file_of(&self, key: &str) -> Option<&Path> {
        self.tensors.get(key).map(|t| self.files[t.file].as_path())
    }

    /// The stored bytes of `key` (little-endian, row-major), with its info.
    pub fn raw(&self, key: &str) -> Option<(&TensorInfo, &[u8])> {
        self.tensors.get(key).map(|t| (t, &self.mmaps[t.file][t.start..t.end]))
    }

    /// Drops the resident pages of `key`'s bytes from this process (they stay in the page cache
    /// and are read back if touched again): a loaded tensor's file bytes need not count twice.
    pub fn release(&self, key: &str) {
        if let Some(t) = self.tensors.get(key) {
            if t.end > t.start {
                // SAFETY: a read-only private file mapping; MADV_DONTNEED only drops pages, which
                // the kernel re-reads from the unchanged file on the next access.
                let _ = unsafe {
                    self.mmaps[t.file].unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        t.start,
                        t.end - t.start,
                    )
                };
            }
        }
    }

    /// Loads `key` in its stored dtype.
    pub fn load(&self, key: &str, device: &Device) -> Result<Tensor> {
        let info = self.tensors.get(key).ok_or_else(|| Error::MissingTensor { key: key.to_string() })?;
        let dtype = candle_dtype(info.dtype).ok_or_else(|| Error::UnsupportedDtype {
            key: key.to_string(),
            path: self.files[info.file].clone(),
            dtype: format!("{:?}", info.dtype),
        })?;
        let bytes = &self.mmaps[info.file][info.start..info.end];
        Ok(Tensor::from_raw_buffer(bytes, dtype, &info.shape, device)?)
    }
}

/// The candle dtype for a stored dtype, where candle has one.
pub fn candle_dtype(d: StDtype) -> Option<DType> {
    Some(match d {
        StDtype::F32 => DType::F32,
        StDtype::F16 => DType::F16,
        StDtype::BF16 => DType::BF16,
        StDtype::F64 => DType::F64,
        StDtype::U8 => DType::U8,
        StDtype::U32 => DType::U32,
        StDtype::I64 => DType::I64,
        _ => return None,
    })
}

/// Short lower-case name of a stored dtype, as `vl inspect` prints it.
pub fn dtype_name(d: StDtype) -> String {
    match d {
        StDtype::F32 => "float32".into(),
        StDtype::F16 => "float16".into(),
        StDtype::BF16 => "bfloat16".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// One tensor to write: name, stored dtype, shape and little-endian bytes.
pub struct RawTensor<'a> {
    pub name: String,
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

/// Serializes tensors as one safetensors file's bytes; `path` names the destination in errors.
pub fn encode_safetensors(path: &Path, tensors: &[RawTensor<'_>]) -> Result<Vec<u8>> {
    let views = tensors
        .iter()
        .map(|t| {
            safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), t.data).map(|v| (t.name.clone(), v)).map_err(
                |e| Error::Safetensors { path: path.to_path_buf(), message: format!("tensor `{}`: {e}", t.name) },
            )
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::tensor::serialize(views, None)
        .map_err(|e| Error::Safetensors { path: path.to_path_buf(), message: format!("cannot serialize: {e}") })
}

/// Writes tensors as one safetensors file (used for sharding, rewriting and `--logits-out`).
pub fn write_safetensors(path: &Path, tensors: &[RawTensor<'_>]) -> Result<()> {
    let bytes = encode_safetensors(path, tensors)?;
    std::fs::write(path, bytes).map_err(|e| Error::io(path, e))
}

/// Called once per tensor loaded through a `VarBuilder` (for progress bars).
pub type LoadProgress = std::sync::Arc<dyn Fn(&str) + Send + Sync>;
