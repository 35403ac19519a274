//! The files `vl run` writes besides stdout, checked before any work: `--draw-boxes`' PNG
//! (`BoxesOut`) and `--logits-out`'s safetensors (`LogitsOut`); an output is never an input.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use vl_models::checkpoint::{encode_safetensors, RawTensor};
use vl_models::limits::ImageLimits;

use crate::note;

/// The PNG `--draw-boxes` names, checked before any work (`check_output`); written at the end
/// to a temporary file beside it, then renamed over it (never a half-written image; the
/// temporary file is removed on any error, and no message names it).
pub(super) struct BoxesOut {
    pub path: PathBuf,
    force: bool,
}

/// The directory a file `path` goes in.
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// An io error without the path tempfile adds to it (the temporary file's name).
fn plain(e: std::io::Error) -> std::io::Error {
    std::io::Error::from(e.kind())
}

/// Whether `a` and `b` are one file: the same canonical path, or the same device and inode (a
/// hard link, or a symbolic link to it).
pub(super) fn same_file(a: &Path, b: &Path) -> bool {
    if let (Ok(x), Ok(y)) = (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        if x == y {
            return true;
        }
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
            return x.dev() == y.dev() && x.ino() == y.ino();
        }
    }
    false
}

/// Refuses (one line naming `flag` and `path`) an output file that is one of `inputs` (what,
/// path): an existing `path` that is the same file as an input.
pub(super) fn check_not_input(flag: &str, path: &Path, inputs: &[(&str, &Path)]) -> Result<()> {
    // A link (even a dangling one) counts as there.
    if std::fs::symlink_metadata(path).is_ok() {
        if let Some((what, p)) = inputs.iter().find(|(_, p)| same_file(path, p)) {
            bail!(
                "{flag} {}: is the input {what} {}; name another file (an input is never replaced)",
                path.display(),
                p.display()
            );
        }
    }
    Ok(())
}

/// Checks the file an output flag names before any work, each refusal one line naming `flag`
/// and `path`: not a directory, in an existing directory, not one of `inputs` (what, path),
/// unless `force` not an existing file, and a file can be created beside it (a probe, removed).
fn check_output(flag: &str, path: &Path, inputs: &[(&str, &Path)], force: bool) -> Result<()> {
    let shown = path.display();
    if path.is_dir() {
        bail!("{flag} {shown}: is a directory; name a file");
    }
    let dir = parent_dir(path);
    if !dir.is_dir() {
        let why = if dir.exists() { "is not a directory" } else { "does not exist" };
        bail!("{flag} {shown}: cannot create it: the directory {} {why}", dir.display());
    }
    check_not_input(flag, path, inputs)?;
    if !force && std::fs::symlink_metadata(path).is_ok() {
        bail!("{flag} {shown}: exists; pass --force to replace it");
    }
    tempfile::Builder::new()
        .prefix(".vl-out-")
        .tempfile_in(dir)
        .map_err(|e| anyhow::anyhow!("{flag} {shown}: cannot create a file in {}: {}", dir.display(), plain(e)))?;
    Ok(())
}

impl BoxesOut {
    pub fn create(path: &Path, inputs: &[(&str, &Path)], force: bool) -> Result<Self> {
        check_output("--draw-boxes", path, inputs, force)?;
        let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
        if ext.as_deref() != Some("png") {
            bail!("--draw-boxes {}: the drawing is written as PNG; name a .png file", path.display());
        }
        Ok(Self { path: path.to_path_buf(), force })
    }

    /// Draws `text`'s shapes on the image `data` (decoded as the engine decodes it) and writes
    /// the PNG; returns the number drawn and the parser's notes.
    pub fn write(
        self,
        g: vl_models::grounding::Grounding,
        data: &[u8],
        name: &Path,
        limits: &ImageLimits,
        text: &str,
        resized: (usize, usize),
    ) -> Result<usize> {
        use vl_models::grounding::{draw, parse, to_pixels};
        let file = vl_models::image_file::ImageFile::from_bytes(data.to_vec(), name, limits)?;
        let mut img = file.decode()?;
        let parsed = parse(text, g.coords);
        for n in &parsed.notes {
            note!("note: --draw-boxes: {n}");
        }
        let shapes = to_pixels(&parsed.shapes, g.coords, img.width() as usize, img.height() as usize, resized);
        draw(&mut img, &shapes);
        let shown = self.path.display();
        let dir = parent_dir(&self.path);
        // Dropped (and so removed) on every error below.
        let tmp = tempfile::Builder::new().prefix(".vl-boxes-").suffix(".png").tempfile_in(dir).map_err(|e| {
            anyhow::anyhow!("--draw-boxes {shown}: cannot create a file in {}: {}", dir.display(), plain(e))
        })?;
        let mut w = std::io::BufWriter::new(tmp.as_file());
        img.write_to(&mut w, image::ImageFormat::Png)
            .map_err(|e| anyhow::anyhow!("--draw-boxes {shown}: cannot write: {e}"))?;
        w.flush()
            .and_then(|_| tmp.as_file().sync_all())
            .map_err(|e| anyhow::anyhow!("--draw-boxes {shown}: cannot write: {}", plain(e)))?;
        drop(w);
        // Without --force, a file that appeared meanwhile is not replaced either.
        let persisted = if self.force { tmp.persist(&self.path) } else { tmp.persist_noclobber(&self.path) };
        persisted.map_err(|e| match e.error.kind() {
            std::io::ErrorKind::AlreadyExists if !self.force => {
                anyhow::anyhow!("--draw-boxes {shown}: exists; pass --force to replace it")
            }
            _ => anyhow::anyhow!("--draw-boxes {shown}: cannot write: {}", plain(e.error)),
        })?;
        Ok(shapes.len())
    }
}

/// The file `--logits-out` names, created before any work so that an unwritable path fails
/// first; removed again if the run fails.
pub(super) struct LogitsOut {
    path: PathBuf,
    file: Option<std::fs::File>,
}

impl LogitsOut {
    pub fn create(path: &Path) -> Result<Self> {
        let file = std::fs::File::create(path)
            .with_context(|| format!("--logits-out {}: cannot create the file", path.display()))?;
        Ok(Self { path: path.to_path_buf(), file: Some(file) })
    }

    pub fn write(mut self, logits: &[f32]) -> Result<()> {
        let bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
        let t = [RawTensor {
            name: "logits".into(),
            dtype: safetensors::Dtype::F32,
            shape: vec![logits.len()],
            data: &bytes,
        }];
        let encoded = encode_safetensors(&self.path, &t)?;
        let mut file = self.file.take().expect("written once");
        file.write_all(&encoded)
            .and_then(|_| file.sync_all())
            .with_context(|| format!("--logits-out {}: cannot write", self.path.display()))
    }
}

impl Drop for LogitsOut {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
