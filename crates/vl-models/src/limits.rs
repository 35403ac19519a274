//! Bounds on what input files may make us read or allocate, checked before the work happens.
//! Every limit that a user may need to raise is a field of `ImageLimits` (the CLI exposes each as
//! a flag); the others are fixed far above any real checkpoint's needs.

use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};

/// Largest JSON or text file read whole (config, tokenizer, chat template, shard index).
/// Qwen3-VL's tokenizer.json, the largest of them, is 11 MB.
pub const MAX_METADATA_FILE_BYTES: u64 = 256 << 20;

pub use crate::error::LimitKind;

/// Limits on image files, checked from the file size and the image header before decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// Bytes read from one image file.
    pub max_file_bytes: u64,
    /// Decoded pixels (width * height) of one image, before resizing.
    pub max_pixels: u64,
}

/// Largest pixel budget (`max_pixels`, `min_pixels`) of a resized image or video: 2^25 pixels,
/// 32768 tokens at Qwen3-VL's 32-pixel merge factor (twice its shipped `longest_edge` of 16777216).
pub const MAX_PIXEL_BUDGET: usize = 1 << 25;
/// Longest image side accepted (in pixels); above `max_pixels` for any image it could admit.
pub const MAX_IMAGE_SIDE: u32 = 1 << 16;

impl Default for ImageLimits {
    fn default() -> Self {
        // 128 MiB holds any real photo or screenshot; 2^26 pixels (67 MP) is above a 48 MP phone
        // photo and keeps a decode (up to 8 bytes a pixel for 16-bit RGBA) near 512 MiB.
        Self { max_file_bytes: 128 << 20, max_pixels: 1 << 26 }
    }
}

impl ImageLimits {
    /// Bytes a decoder may allocate: the decoded image at up to 16 bytes a pixel.
    pub fn max_decoder_alloc(&self) -> u64 {
        self.max_pixels.saturating_mul(16).max(64 << 20)
    }
}

/// Reads at most `limit` bytes of `path`; a longer file (or an endless one such as /dev/zero)
/// is an error that names the file and the limit.
pub fn read_bytes(path: &Path, limit: u64, kind: LimitKind) -> Result<Vec<u8>> {
    read_within(path, limit, kind, false)
}

/// `read_bytes` for a path a client named (a server's media): only a regular file is read. A
/// FIFO, device or socket is refused without blocking (it is opened non-blocking and checked on
/// the open descriptor, so a file swapped for a FIFO after an earlier check is refused too).
pub fn read_regular(path: &Path, limit: u64, kind: LimitKind) -> Result<Vec<u8>> {
    read_within(path, limit, kind, true)
}

/// Opens `path` for reading without blocking on a FIFO, then checks what it is: a directory is
/// an error, and so is anything but a regular file when `regular_only`. The descriptor is back
/// in blocking mode when returned (a FIFO from a shell's `<(...)` then reads as usual).
pub fn open_checked(path: &Path, regular_only: bool) -> Result<std::fs::File> {
    #[cfg(unix)]
    let file = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)
    };
    #[cfg(not(unix))]
    let file = std::fs::File::open(path);
    let file = file.map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if meta.is_dir() {
        return Err(Error::io(path, std::io::Error::other("is a directory")));
    }
    if regular_only && !meta.is_file() {
        return Err(Error::Input {
            what: path.display().to_string(),
            message: "not a regular file (a FIFO, device or socket is never read as media)".into(),
        });
    }
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        let fd = file.as_raw_fd();
        // SAFETY: fcntl on a descriptor this function owns.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
            }
        }
    }
    Ok(file)
}

pub(crate) fn read_within(path: &Path, limit: u64, kind: LimitKind, regular_only: bool) -> Result<Vec<u8>> {
    let file = open_checked(path, regular_only)?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    let too_big = |size: String| Error::Limit {
        what: path.display().to_string(),
        message: format!("{size} exceeds the limit of {limit} bytes"),
        kind,
    };
    if meta.is_file() && meta.len() > limit {
        return Err(too_big(format!("file size {} bytes", meta.len())));
    }
    // A stream of unknown length (a pipe, a device) gets the whole bound reserved up front:
    // untouched pages cost no memory, and the buffer never doubles (a reallocation would hold
    // the old and the new copy at once, twice the bound, at its end).
    let reserve = if meta.is_file() { meta.len() } else { limit.saturating_add(1).min(1 << 31) };
    let mut buf = Vec::with_capacity(reserve as usize);
    file.take(limit + 1).read_to_end(&mut buf).map_err(|e| Error::io(path, e))?;
    if buf.len() as u64 > limit {
        return Err(too_big("more than that many bytes readable".into()));
    }
    Ok(buf)
}

/// `read_bytes` for UTF-8 text with the metadata bound.
pub fn read_text(path: &Path, limit: u64) -> Result<String> {
    let bytes = read_bytes(path, limit, LimitKind::Fixed)?;
    String::from_utf8(bytes).map_err(|e| Error::Input {
        what: path.display().to_string(),
        message: format!("not UTF-8 text (invalid byte at offset {})", e.utf8_error().valid_up_to()),
    })
}

/// Kills a child process with SIGKILL if it is still running `limit` after `start`; `stop`
/// before waiting for the child says whether it was killed. (No limit: never kills.)
pub(crate) struct Watchdog {
    done: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<bool>>,
}

impl Watchdog {
    pub(crate) fn start(child: &std::process::Child, limit: Option<std::time::Duration>) -> Self {
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let pid = child.id();
        let thread = limit.map(|limit| {
            std::thread::spawn(move || {
                let late = finished.recv_timeout(limit) == Err(std::sync::mpsc::RecvTimeoutError::Timeout);
                #[cfg(unix)]
                if late {
                    // SAFETY: a signal to the caller's child, not yet waited for (the caller
                    // waits for it only after `stop` joins this thread), so the pid is still its.
                    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                }
                late
            })
        });
        Self { done: Some(done), thread }
    }

    /// Ends the watch; whether the child was killed for running past the limit.
    pub(crate) fn stop(mut self) -> bool {
        drop(self.done.take());
        self.thread.take().is_some_and(|t| t.join().unwrap_or(false))
    }
}

/// Memory this process may still fill, in bytes: the smallest of the system's available memory
/// and free swap (`/proc/meminfo`), the cgroup's room (`memory.max` less its anonymous memory, in
/// a container) and `VL_MEMORY_AVAILABLE` when set (bytes: for machines where neither is right).
/// None where none can be read.
pub fn available_memory() -> Option<u64> {
    let mut best: Option<u64> = None;
    let mut take = |v: u64| best = Some(best.map_or(v, |b| b.min(v)));
    if let Some(v) = std::env::var("VL_MEMORY_AVAILABLE").ok().and_then(|v| v.trim().parse::<u64>().ok()) {
        take(v);
    }
    if let Ok(m) = std::fs::read_to_string("/proc/meminfo") {
        let kb = |key: &str| -> Option<u64> {
            m.lines().find(|l| l.starts_with(key))?.split_whitespace().nth(1)?.parse::<u64>().ok().map(|k| k * 1024)
        };
        if let Some(a) = kb("MemAvailable:") {
            take(a + kb("SwapFree:").unwrap_or(0));
        }
    }
    // In a cgroup with a memory limit: the limit less the anonymous memory charged to it (page
    // cache counts in `memory.current` but is given back under pressure).
    let cg = |f: &str| std::fs::read_to_string(Path::new("/sys/fs/cgroup").join(f)).ok();
    let max = cg("memory.max").and_then(|m| m.trim().parse::<u64>().ok());
    let anon = cg("memory.stat")
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("anon ").and_then(|v| v.trim().parse::<u64>().ok())));
    if let (Some(max), Some(anon)) = (max, anon) {
        take(max.saturating_sub(anon));
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endless_and_oversized_files_are_refused() {
        let err = read_bytes(Path::new("/dev/zero"), 1000, LimitKind::ImageBytes).unwrap_err();
        assert!(matches!(err, Error::Limit { kind: LimitKind::ImageBytes, .. }));
        assert!(err.to_string().contains("/dev/zero") && err.to_string().contains("1000 bytes"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, vec![b'x'; 1001]).unwrap();
        let err = read_text(&p, 1000).unwrap_err().to_string();
        assert!(err.contains("file size 1001 bytes exceeds the limit of 1000 bytes"), "{err}");
        std::fs::write(&p, b"ok").unwrap();
        assert_eq!(read_text(&p, 1000).unwrap(), "ok");
        std::fs::write(&p, [0xff, 0xfe]).unwrap();
        assert!(read_text(&p, 1000).unwrap_err().to_string().contains("not UTF-8"));
        assert!(read_bytes(dir.path(), 10, LimitKind::Fixed).unwrap_err().to_string().contains("is a directory"));
    }
}
