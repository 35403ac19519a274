//! A JSON object's fields read by hand, each error a 400 naming the field's path (`param`): the
//! request parts serde does not type (content parts, tools, the Responses API's items).

use serde_json::Value;

use crate::error::ApiError;

/// Refuses a key of the object `o` at `at` that is not in `known`, naming its path.
pub(crate) fn known_keys(o: &serde_json::Map<String, Value>, known: &[&str], at: &str) -> Result<(), ApiError> {
    match o.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => {
            let path = if at.is_empty() { k.clone() } else { format!("{at}.{k}") };
            Err(ApiError::bad_at(path.clone(), format!("`{path}` is not a known field")))
        }
        None => Ok(()),
    }
}

/// The field `name` of `o` when present and not null: a string, or a 400 naming `at.name`.
pub(crate) fn opt_str<'a>(
    o: &'a serde_json::Map<String, Value>,
    name: &str,
    at: &str,
) -> Result<Option<&'a str>, ApiError> {
    typed_field(o, name, at, "a string", Value::as_str)
}

/// The field `name` of `o` when present and not null, read by `read`; a 400 naming `at.name` as
/// not being `what` otherwise.
pub(crate) fn typed_field<'a, T>(
    o: &'a serde_json::Map<String, Value>,
    name: &str,
    at: &str,
    what: &str,
    read: impl Fn(&'a Value) -> Option<T>,
) -> Result<Option<T>, ApiError> {
    match o.get(name).filter(|x| !x.is_null()) {
        None => Ok(None),
        Some(x) => read(x).map(Some).ok_or_else(|| {
            let path = if at.is_empty() { name.to_string() } else { format!("{at}.{name}") };
            ApiError::bad_at(path.clone(), format!("`{path}` must be {what}"))
        }),
    }
}

/// The `speculative` field: a method name, or an object of the method and its bounds (each
/// absent one the server's default).
pub(crate) fn speculative(
    v: &Value,
    default: &vl_models::speculative::Speculative,
) -> Result<vl_models::speculative::Speculative, ApiError> {
    use vl_models::speculative::Method;
    let bad = |m: String| ApiError::bad_at("speculative", m);
    let method = |s: &str| Method::parse(s).map_err(|e| bad(format!("`speculative`: {e}")));
    let mut out = default.clone();
    match v {
        Value::String(s) => out.method = method(s)?,
        Value::Object(o) => {
            for (k, x) in o {
                let number = || {
                    x.as_u64()
                        .map(|n| n as usize)
                        .ok_or_else(|| bad(format!("`speculative.{k}` must be an integer, got {x}")))
                };
                match k.as_str() {
                    "method" => {
                        out.method = method(
                            x.as_str().ok_or_else(|| bad(format!("`speculative.method` must be a string, got {x}")))?,
                        )?
                    }
                    "draft_max" => out.draft_max = number()?,
                    "ngram_min" => out.ngram_min = number()?,
                    "ngram_max" => out.ngram_max = number()?,
                    other => {
                        return Err(bad(format!(
                            "`speculative.{other}` is not a field: expected method, draft_max, ngram_min, ngram_max"
                        )))
                    }
                }
            }
        }
        other => return Err(bad(format!("`speculative` must be a method name or an object, got {other}"))),
    }
    out.validate().map_err(|e| bad(format!("`speculative.{e}`")))?;
    Ok(out)
}
