//! Stored responses (`store`, on by default as OpenAI's is): each response object and the
//! conversation it ended (its input after `instructions`, then its answer as an assistant
//! message), by response id (128 random bits: unguessable), in memory, bounded by bytes, least recently used out first
//! (`ServerConfig::responses_store_bytes`). `previous_response_id` continues a stored
//! conversation; `GET` / `DELETE /v1/responses/{id}` read and remove one.

use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use vl_models::cache::ByteLru;
use vl_models::engine::Completion;

/// One stored response.
pub(crate) struct Stored {
    pub response: Value,
    /// Chat messages: the conversation up to and with this response's answer (no system
    /// message from `instructions`: a later response gives its own).
    pub messages: Vec<Value>,
}

impl Stored {
    /// Bytes it is counted as (its JSON text).
    fn bytes(&self) -> usize {
        self.response.to_string().len() + self.messages.iter().map(|m| m.to_string().len()).sum::<usize>()
    }
}

pub(crate) struct ResponseStore {
    limit: usize,
    entries: Mutex<ByteLru<u128, Arc<Stored>>>,
}

impl ResponseStore {
    pub fn new(limit: usize) -> Self {
        Self { limit, entries: Mutex::new(ByteLru::new(limit)) }
    }

    /// Whether responses are kept at all (a limit above 0).
    pub fn enabled(&self) -> bool {
        self.limit > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ByteLru<u128, Arc<Stored>>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `s` as response `id` (one `new_id` made) when it fits the store; whether it was
    /// kept.
    pub fn put(&self, id: &str, s: Stored) -> bool {
        let size = s.bytes();
        let Some(key) = key(id) else { return false };
        if size > self.limit {
            return false;
        }
        self.lock().put(key, Arc::new(s), size);
        true
    }

    pub fn get(&self, id: &str) -> Option<Arc<Stored>> {
        self.lock().get(&key(id)?)
    }

    pub fn remove(&self, id: &str) -> bool {
        key(id).is_some_and(|k| self.lock().remove(&k).is_some())
    }
}

/// A new response id: `resp_` and 128 random bits in hex (the thread's CSPRNG).
pub(crate) fn new_id() -> String {
    format!("resp_{:032x}", rand::random::<u128>())
}

/// The 128 bits of a response id made by `new_id`.
fn key(id: &str) -> Option<u128> {
    let hex = id.strip_prefix("resp_").filter(|h| h.len() == 32)?;
    u128::from_str_radix(hex, 16).ok()
}

/// An answer as the assistant message a later turn's template sees.
pub(crate) fn assistant_message(c: &Completion, call_id: impl Fn(usize) -> String) -> Value {
    let mut m = json!({"role": "assistant", "content": c.text});
    if let Some(r) = &c.reasoning {
        m["reasoning_content"] = json!(r);
    }
    if !c.tool_calls.is_empty() {
        m["tool_calls"] = c
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, t)| json!({"id": call_id(i), "type": "function", "function": {"name": t.name, "arguments": t.arguments}}))
            .collect();
        if c.text.is_empty() {
            m["content"] = Value::Null;
        }
    }
    m
}
