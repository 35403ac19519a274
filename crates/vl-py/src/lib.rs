//! `vl._vl`: the engine for Python (PyO3, abi3). The Python package `vl` (python/vl) wraps it:
//! it turns images given as paths, bytes or PIL images into the parts the server reads, and the
//! JSON answers into result objects. Requests are read by `vl_server::Chat`, so they get the
//! server's checks, media rules, constraints and tools, and answers its shapes. The GIL is
//! released while the engine works: many Python threads calling one engine are batched by its
//! scheduler.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use vl_models::engine::{Delta, EngineOptions, ModelOptions};
use vl_server::{Chat, ChatRequest, MediaDir, RequestError, ServerConfig};

create_exception!(
    _vl,
    VlError,
    PyException,
    "An error from vl; its message is one line naming the field, file or limit."
);
create_exception!(
    _vl,
    RequestError_,
    VlError,
    "A request the engine refuses (the server would answer 400): `param` names the field."
);

/// A `VlError` (or, for a refused request, its `RequestError` subclass) with the message, and
/// the field and HTTP status as attributes.
fn py_error(e: &RequestError) -> PyErr {
    let err =
        if e.status < 500 { RequestError_::new_err(e.message.clone()) } else { VlError::new_err(e.message.clone()) };
    Python::attach(|py| {
        let v = err.value(py);
        let _ = v.setattr("param", e.param.clone());
        let _ = v.setattr("status", e.status);
    });
    err
}

fn load_error(e: impl std::fmt::Display) -> PyErr {
    VlError::new_err(e.to_string())
}

/// The engine over one model, and the server's reading of requests.
#[pyclass(frozen, module = "vl._vl")]
struct Engine {
    chat: Arc<Chat>,
}

fn quant(name: &str) -> PyResult<vl_nn::QuantType> {
    use vl_nn::QuantType::*;
    Ok(match name {
        "q4k" => Q4K,
        "q5k" => Q5K,
        "q6k" => Q6K,
        "q8" | "q8_0" => Q8_0,
        other => {
            return Err(RequestError_::new_err(format!(
                "quantize = {other:?} is not one of \"q4k\", \"q5k\", \"q6k\", \"q8\" (or None: as stored)"
            )))
        }
    })
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (model, *, mmproj=None, quantize=None, device="cpu", parallel=4, kv_cache_mib=None,
                        prefix_cache=true, image_cache_mib=256, media_dir=None, allow_remote_media=false,
                        draft_model=None, kv_cache_dtype=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: &str,
        mmproj: Option<&str>,
        quantize: Option<&str>,
        device: &str,
        parallel: usize,
        kv_cache_mib: Option<usize>,
        prefix_cache: bool,
        image_cache_mib: usize,
        media_dir: Option<&str>,
        allow_remote_media: bool,
        draft_model: Option<&str>,
        kv_cache_dtype: Option<&str>,
    ) -> PyResult<Self> {
        let device = match device {
            "cpu" => candle_core::Device::Cpu,
            "cuda" => candle_core::Device::new_cuda(0).map_err(load_error)?,
            "metal" => candle_core::Device::new_metal(0).map_err(load_error)?,
            other => {
                return Err(RequestError_::new_err(format!(
                    "device = {other:?} is not one of \"cpu\", \"cuda\", \"metal\""
                )))
            }
        };
        if parallel == 0 {
            return Err(RequestError_::new_err("parallel = 0: at least 1 sequence must decode at a time"));
        }
        let mut model_opts = ModelOptions {
            dtype: vl_nn::dispatch::default_dtype(vl_nn::dispatch::DeviceKind::of(&device)),
            device,
            ..Default::default()
        };
        model_opts.quant = quantize.map(quant).transpose()?;
        model_opts.kv_dtype = match kv_cache_dtype {
            None => None,
            Some("f32") => Some(candle_core::DType::F32),
            Some("f16") => Some(candle_core::DType::F16),
            Some("bf16") => Some(candle_core::DType::BF16),
            Some(other) => {
                return Err(RequestError_::new_err(format!(
                    "kv_cache_dtype = {other:?} is not one of \"f32\", \"f16\", \"bf16\" (or None: the compute dtype)"
                )))
            }
        };
        let mut opts = EngineOptions {
            model: model_opts,
            prefix_cache,
            parallel,
            image_cache_bytes: image_cache_mib.saturating_mul(1 << 20),
            ..Default::default()
        };
        if let Some(k) = kv_cache_mib {
            opts.kv_cache_bytes = k.saturating_mul(1 << 20);
        }
        let dir = MediaDir::new(std::path::Path::new(media_dir.unwrap_or("/")))
            .map_err(|e| RequestError_::new_err(format!("media_dir: {e}")))?;
        let mmproj = mmproj.map(std::path::PathBuf::from);
        // A directory, a .gguf file, or a hub id (`Qwen/Qwen3-VL-2B-Instruct`, or
        // `repo:Q4_K_M` for a GGUF pair): from the local Hugging Face cache, downloaded when
        // absent, as `vl run --model` does.
        let name = model.to_string();
        let draft_name = draft_model.map(str::to_string);
        let (model, engine) = py.detach(|| {
            let dir = vl_models::hub::resolve(&name).map_err(|e| load_error(format!("{e:#}")))?;
            // The draft model (`speculative="draft"`), loaded with the model's options.
            let draft = match &draft_name {
                Some(d) => {
                    let ddir = vl_models::hub::resolve(d).map_err(|e| load_error(format!("draft_model: {e:#}")))?;
                    let source = vl_models::family::Source { model: &ddir, mmproj: None, progress: None };
                    let family = vl_models::registry::open(&source, &opts.model)
                        .map_err(|e| load_error(format!("draft_model {}: {e}", ddir.display())))?;
                    Some(family)
                }
                None => None,
            };
            let engine = vl_models::engine::Engine::open_with_draft(&dir, mmproj.as_deref(), draft, opts)
                .map_err(|e| load_error(format!("{}: {e}", dir.display())))?;
            Ok::<_, PyErr>((dir, engine))
        })?;
        let config = ServerConfig {
            // A hub id as given; a path by its last part.
            id: if vl_models::hub::looks_like_hub_id(&name) && !std::path::Path::new(&name).exists() {
                name.clone()
            } else {
                model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "vl".into())
            },
            allowed_media_dir: Some(dir),
            remote_media: allow_remote_media.then(|| std::time::Duration::from_secs(20)),
            ..Default::default()
        };
        Ok(Self { chat: Arc::new(Chat::new(Arc::new(engine), config)) })
    }

    /// The model's context in tokens.
    #[getter]
    fn context(&self) -> usize {
        self.chat.engine().context()
    }

    /// A chat completions body (JSON text) answered: the `chat.completion` object as JSON text.
    fn chat(&self, py: Python<'_>, body: &str) -> PyResult<String> {
        let req = self.chat.parse(body.as_bytes()).map_err(|e| py_error(&e))?;
        let chat = self.chat.clone();
        let done = py.detach(move || {
            let all = chat.engine().stream(&req.request, req.n, &mut |_| true).map_err(|e| chat.error(&req, &e))?;
            Ok::<_, RequestError>(chat.completion(&req, all).to_string())
        });
        done.map_err(|e| py_error(&e))
    }

    /// A pooling body (JSON text) answered as `POST /v1/{endpoint}` answers it (`embeddings`,
    /// `rerank`, `score`): the answer as JSON text.
    fn pool(&self, py: Python<'_>, endpoint: &str, body: &str) -> PyResult<String> {
        let chat = self.chat.clone();
        let (endpoint, body) = (endpoint.to_string(), body.to_string());
        py.detach(move || chat.pool(&endpoint, body.as_bytes()).map(|v| v.to_string())).map_err(|e| py_error(&e))
    }

    /// A chat completions body answered piece by piece: an iterator of (choice, text,
    /// reasoning) pieces whose `result` is then the whole answer.
    fn stream(&self, py: Python<'_>, body: &str) -> PyResult<Stream> {
        let req = self.chat.parse(body.as_bytes()).map_err(|e| py_error(&e))?;
        let (tx, rx) = mpsc::sync_channel::<Item>(64);
        let cancel = Arc::new(AtomicBool::new(false));
        let chat = self.chat.clone();
        let stop = cancel.clone();
        py.detach(|| {
            std::thread::Builder::new()
                .name("vl-py-stream".into())
                .spawn(move || run_stream(chat, req, tx, stop))
                .map(|_| ())
                .map_err(|e| VlError::new_err(format!("cannot start a thread: {e}")))
        })?;
        Ok(Stream { rx: Mutex::new(rx), cancel, result: Mutex::new(None) })
    }
}

/// What a stream's thread sends: pieces, then the answer or the error.
enum Item {
    Piece { choice: usize, text: String, reasoning: bool },
    Done(Result<String, RequestError>),
}

fn run_stream(chat: Arc<Chat>, req: ChatRequest, tx: mpsc::SyncSender<Item>, cancel: Arc<AtomicBool>) {
    let r = chat.engine().stream(&req.request, req.n, &mut |d: &Delta<'_>| {
        if cancel.load(Ordering::Relaxed) {
            return false;
        }
        let piece = Item::Piece { choice: d.choice, text: d.text.to_string(), reasoning: d.reasoning };
        // A reader that has gone (the iterator dropped) cancels the answer.
        tx.send(piece).is_ok() && !cancel.load(Ordering::Relaxed)
    });
    let done = r.map(|all| chat.completion(&req, all).to_string()).map_err(|e| chat.error(&req, &e));
    let _ = tx.send(Item::Done(done));
}

/// An answer arriving: iterate for its pieces, `(choice, text, reasoning)`; once they end,
/// `result` is the whole answer (JSON text). Dropping it, or `close()`, cancels the answer.
#[pyclass(frozen, module = "vl._vl")]
struct Stream {
    rx: Mutex<mpsc::Receiver<Item>>,
    cancel: Arc<AtomicBool>,
    result: Mutex<Option<String>>,
}

#[pymethods]
impl Stream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<(usize, String, bool)>> {
        let item = py.detach(|| self.rx.lock().map(|rx| rx.recv().ok()).unwrap_or(None));
        match item {
            Some(Item::Piece { choice, text, reasoning }) => Ok(Some((choice, text, reasoning))),
            Some(Item::Done(Ok(json))) => {
                *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(json);
                Ok(None)
            }
            Some(Item::Done(Err(e))) => Err(py_error(&e)),
            None => Ok(None),
        }
    }

    /// The whole answer (JSON text), once the pieces have ended; None before.
    #[getter]
    fn result(&self) -> Option<String> {
        self.result.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Cancels the answer (the engine stops at its next step).
    fn close(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

/// Serves the OpenAI API over `engine` on `host:port` until SIGINT / SIGTERM (the GIL released
/// meanwhile), as `vl serve` does.
#[pyfunction]
#[pyo3(signature = (engine, host="127.0.0.1", port=8080, api_key=None))]
fn serve(py: Python<'_>, engine: &Engine, host: &str, port: u16, api_key: Option<String>) -> PyResult<()> {
    let listener = std::net::TcpListener::bind((host, port))
        .map_err(|e| VlError::new_err(format!("binding {host}:{port}: {e}")))?;
    let config = ServerConfig { api_key, ..Default::default() };
    let e = engine.chat.engine().clone();
    py.detach(|| vl_server::serve(e, listener, config)).map_err(load_error)
}

#[pymodule]
fn _vl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The allocator settings `vl` sets first thing: large per-op buffers stay in the heap
    // instead of being mapped and unmapped (and zeroed by the kernel) per op. Without them the
    // same questions took 1.3x as long as through `vl serve` (docs/python.md).
    vl_models::alloc::keep_large_buffers();
    m.add_class::<Engine>()?;
    m.add_class::<Stream>()?;
    m.add_function(wrap_pyfunction!(serve, m)?)?;
    m.add("VlError", m.py().get_type::<VlError>())?;
    m.add("RequestError", m.py().get_type::<RequestError_>())?;
    Ok(())
}
