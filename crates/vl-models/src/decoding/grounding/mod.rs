//! Grounding answers: the boxes and points a vision-language model names in its text, parsed,
//! mapped to an image's pixels, and drawn.
//!
//! Qwen3-VL answers a grounding prompt with JSON, often inside a ```json fence:
//! `[{"bbox_2d": [x1, y1, x2, y2], "label": "cat"}]` or `{"point_2d": [x, y], "label": ...}`. Its
//! coordinates are relative: 0..1000 of the image's width and height, whatever size the image
//! was resized to (Qwen2.5-VL used absolute pixels of the resized image instead). A family says
//! which convention its checkpoints follow (`Coords`); the parser is the same for both.
//!
//! GUI-grounding checkpoints built on Qwen3-VL and Qwen3.5 (UI-Venus-1.5 and -2) answer with a
//! bare list instead: `[x,y]` (a point), `[x1,y1,x2,y2]` or `[x1,y1],[x2,y2]` (a box), in the
//! same 0..1000 space, and `[-1,-1]` when nothing in the image matches; an answer without JSON
//! entries is read that way.
//!
//! The parser takes what real checkpoints give: a fence or none, a list or one object, objects
//! nested in a wrapper (`{"objects": [...]}`), text around the JSON, and a list cut off by the
//! token limit (the complete entries are kept, the cut one is reported). A coordinate outside
//! the range is clamped and reported, never a crash.

use serde_json::Value;

mod draw;
pub use draw::*;

/// Most shapes one answer yields (an answer is bounded by its tokens; this bounds the work of
/// drawing and of the server's extension field).
pub const MAX_SHAPES: usize = 1024;
/// Most bytes of a label kept.
pub const MAX_LABEL_BYTES: usize = 256;

/// Words that mark a prompt (or a response schema) as asking for boxes or points, compared
/// case-insensitively: Qwen's grounding prompts ("Locate every ... Report bbox coordinates in
/// JSON format", "Point to ...: point_2d") use them.
pub const GROUNDING_WORDS: [&str; 5] = ["bbox", "bounding box", "point_2d", "grounding", "coordinates"];

/// Whether `text` asks for boxes or points (`GROUNDING_WORDS`).
pub fn looks_like_grounding(text: &str) -> bool {
    let t = text.to_lowercase();
    GROUNDING_WORDS.iter().any(|w| t.contains(w))
}

/// How a family's answers give coordinates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Coords {
    /// Relative: 0..`scale` of the original image's width and height (Qwen3-VL: 1000).
    Relative(f64),
    /// Absolute pixels of the image as the model saw it (resized: `(height, width)`).
    Resized,
}

/// A family's grounding conventions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grounding {
    pub coords: Coords,
    /// Fewest pixels an image of a grounding request is sized to (boxes from too few visual
    /// tokens land in the wrong place), within the engine's budget.
    pub min_pixels: usize,
}

/// What an answer names: a box `[x1, y1, x2, y2]` or a point `[x, y]`, in the answer's own
/// coordinates.
#[derive(Debug, Clone, PartialEq)]
pub enum Geometry {
    Box([f64; 4]),
    Point([f64; 2]),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub geometry: Geometry,
    pub label: Option<String>,
}

/// The shapes of one answer and what the parser noticed (clamped coordinates, a cut-off entry,
/// malformed entries), one line each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Parsed {
    pub shapes: Vec<Shape>,
    pub notes: Vec<String>,
}

/// Finds the boxes and points in `text`. `coords` bounds the coordinates: values outside
/// 0..scale (relative) or below 0 (resized; the upper bound is the image's) are clamped and
/// noted.
pub fn parse(text: &str, coords: Coords) -> Parsed {
    let mut out = Parsed::default();
    // A thinking model's reasoning comes first: the answer is after it.
    let text = text.rsplit_once("</think>").map_or(text, |(_, answer)| answer);
    let (objects, cut) = json_objects(text, 0);
    for v in objects {
        collect(&v, coords, &mut out, 0);
        if out.shapes.len() >= MAX_SHAPES {
            out.notes.push(format!("more than {MAX_SHAPES} shapes: the rest ignored"));
            out.shapes.truncate(MAX_SHAPES);
            return out;
        }
    }
    if cut && (text.contains("bbox_2d") || text.contains("point_2d")) {
        out.notes.push("the answer ends inside an entry (cut off?): that entry ignored".into());
    }
    if out.shapes.is_empty() && out.notes.is_empty() {
        bare_lists(text, coords, &mut out);
    }
    out
}

/// The bracketed lists of numbers in `text` (`[x,y]`, `[x1,y1,x2,y2]`; two points in a row,
/// `[x1,y1],[x2,y2]`, are one box), as GUI-grounding checkpoints answer. All -1 says nothing
/// matches: noted, no shape.
fn bare_lists(text: &str, coords: Coords, out: &mut Parsed) {
    // A list holds only number characters, so each `[` is looked past by at most this many bytes:
    // the scan stays linear in the answer, whatever brackets it holds.
    const MAX_LIST_BYTES: usize = 128;
    let bytes = text.as_bytes();
    let mut lists: Vec<(usize, usize, Vec<f64>)> = Vec::new();
    let mut from = 0;
    while let Some(p) = text[from..].find('[') {
        let open = from + p;
        from = open + 1;
        let body = bytes[open + 1..]
            .iter()
            .take(MAX_LIST_BYTES)
            .take_while(|b| b"0123456789+-.,eE \t\r\n".contains(b))
            .count();
        let close = open + 1 + body;
        if bytes.get(close) != Some(&b']') {
            continue;
        }
        let nums: Option<Vec<f64>> = text[open + 1..close].split(',').map(|x| x.trim().parse::<f64>().ok()).collect();
        if let Some(nums) = nums.filter(|n| n.len() == 2 || n.len() == 4) {
            lists.push((open, close + 1, nums));
        }
        if lists.len() > 2 * MAX_SHAPES {
            break;
        }
    }
    let mut i = 0;
    while i < lists.len() && out.shapes.len() < MAX_SHAPES {
        let (_, end, nums) = &lists[i];
        // Two points joined by a comma: a box's corners.
        let next = lists
            .get(i + 1)
            .filter(|(start, _, n)| nums.len() == 2 && n.len() == 2 && text[*end..*start].trim() == ",");
        let nums = match next {
            Some((_, _, n)) => {
                i += 1;
                [nums.as_slice(), n.as_slice()].concat()
            }
            None => nums.clone(),
        };
        i += 1;
        if nums.iter().all(|&x| x == -1.0) {
            out.notes.push(format!("the answer is {}: nothing in the image matches", short(&format!("{nums:?}"))));
            continue;
        }
        let key = if nums.len() == 4 { "bbox_2d" } else { "point_2d" };
        push_shape(key, nums, None, coords, out);
    }
}

/// Every outermost `{...}` in `text` that parses as JSON, in order, and whether the text ends
/// inside one. Strings are respected, so braces inside labels do not count. A region that is not
/// JSON as a whole is searched inside, `level` levels deep at most.
fn json_objects(text: &str, level: usize) -> (Vec<Value>, bool) {
    if level > 16 {
        return (vec![], false);
    }
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let (mut depth, mut start, mut in_str, mut escaped) = (0usize, 0usize, false, false);
    for (i, &b) in bytes.iter().enumerate() {
        if in_str {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' if depth > 0 => in_str = true,
            b'{' => {
                if depth == 0 {
                    start = i;
                }
                depth += 1;
            }
            b'}' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    match serde_json::from_str::<Value>(&text[start..=i]) {
                        Ok(v) => out.push(v),
                        // Not JSON as a whole (e.g. a cut inner entry closed by a later brace):
                        // look inside it for complete objects.
                        Err(_) => out.extend(json_objects(&text[start + 1..i], level + 1).0),
                    }
                }
            }
            _ => {}
        }
    }
    if depth > 0 {
        // The text ends inside an object: its complete inner objects still count.
        out.extend(json_objects(&text[start + 1..], level + 1).0);
    }
    (out, depth > 0)
}

/// Shapes in `v` (an entry, or a wrapper holding entries), depth-bounded.
fn collect(v: &Value, coords: Coords, out: &mut Parsed, depth: usize) {
    if depth > 16 || out.shapes.len() >= MAX_SHAPES {
        return;
    }
    match v {
        Value::Array(items) => items.iter().for_each(|x| collect(x, coords, out, depth + 1)),
        Value::Object(o) => {
            let key = ["bbox_2d", "point_2d"].into_iter().find(|k| o.contains_key(*k));
            let Some(key) = key else {
                o.values().for_each(|x| collect(x, coords, out, depth + 1));
                return;
            };
            let label = label(o);
            let want = if key == "bbox_2d" { 4 } else { 2 };
            let nums: Option<Vec<f64>> = o[key].as_array().map(|a| a.iter().filter_map(Value::as_f64).collect());
            let Some(nums) = nums.filter(|n| n.len() == want && o[key].as_array().is_some_and(|a| a.len() == want))
            else {
                out.notes.push(format!("`{key}` = {} is not {want} numbers: ignored", short(&o[key].to_string())));
                return;
            };
            push_shape(key, nums, label, coords, out);
        }
        _ => {}
    }
}

/// A box (4 numbers) or point (2) of an answer, finite, clamped to the coordinate range (noted).
fn push_shape(key: &str, mut nums: Vec<f64>, label: Option<String>, coords: Coords, out: &mut Parsed) {
    if nums.iter().any(|x| !x.is_finite()) {
        out.notes.push(format!("`{key}` has a non-finite value: ignored"));
        return;
    }
    let hi = match coords {
        Coords::Relative(s) => s,
        Coords::Resized => f64::INFINITY,
    };
    if nums.iter().any(|&x| x < 0.0 || x > hi) {
        out.notes.push(format!(
            "`{key}` = {} is outside 0..{}: clamped",
            short(&format!("{nums:?}")),
            if hi.is_finite() { hi.to_string() } else { "the image".into() }
        ));
        nums.iter_mut().for_each(|x| *x = x.clamp(0.0, hi));
    }
    let geometry = if nums.len() == 4 {
        let [x1, y1, x2, y2] = [nums[0], nums[1], nums[2], nums[3]];
        // Corners in either order.
        Geometry::Box([x1.min(x2), y1.min(y2), x1.max(x2), y1.max(y2)])
    } else {
        Geometry::Point([nums[0], nums[1]])
    };
    out.shapes.push(Shape { geometry, label });
}

/// An entry's label: `label`, else another short string field (`text_content`, `name`, ...).
fn label(o: &serde_json::Map<String, Value>) -> Option<String> {
    let s = o
        .get("label")
        .and_then(Value::as_str)
        .or_else(|| o.iter().find(|(k, v)| !k.ends_with("_2d") && v.is_string()).and_then(|(_, v)| v.as_str()))?;
    let mut end = s.len().min(MAX_LABEL_BYTES);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Some(s[..end].to_string())
}

fn short(s: &str) -> String {
    if s.len() <= 60 {
        return s.to_string();
    }
    let mut end = 60;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// A shape in an image's pixels (x right, y down, from the top-left corner).
#[derive(Debug, Clone, PartialEq)]
pub struct PixelShape {
    pub geometry: Geometry,
    pub label: Option<String>,
}

/// `shapes` in pixels of an image `width` x `height` (as displayed: after EXIF orientation),
/// which the model saw resized to `resized` = (height, width). Coordinates stay within the image.
pub fn to_pixels(
    shapes: &[Shape],
    coords: Coords,
    width: usize,
    height: usize,
    resized: (usize, usize),
) -> Vec<PixelShape> {
    let (sx, sy) = match coords {
        Coords::Relative(s) => (width as f64 / s, height as f64 / s),
        Coords::Resized => (width as f64 / resized.1.max(1) as f64, height as f64 / resized.0.max(1) as f64),
    };
    let (w, h) = (width as f64, height as f64);
    let x = |v: f64| (v * sx).clamp(0.0, w);
    let y = |v: f64| (v * sy).clamp(0.0, h);
    shapes
        .iter()
        .map(|s| PixelShape {
            geometry: match s.geometry {
                Geometry::Box([x1, y1, x2, y2]) => Geometry::Box([x(x1), y(y1), x(x2), y(y2)]),
                Geometry::Point([px, py]) => Geometry::Point([x(px), y(py)]),
            },
            label: s.label.clone(),
        })
        .collect()
}

/// The answer's shapes as JSON: in the answer's coordinates (`shapes`), then in pixels of each
/// image of the request (`images[i].shapes`, x right and y down from the top-left corner, to
/// 0.1 px), and the parser's `notes`. `vl serve` puts this on a choice as `grounding`, `vl run
/// --json` as `grounding` (docs/serving.md documents the shape).
pub fn report(text: &str, coords: Coords, images: &[crate::request::ImageReport]) -> Value {
    let parsed = parse(text, coords);
    let round = |x: f64| (x * 10.0).round() / 10.0;
    let shape = |geometry: &Geometry, label: &Option<String>, pixels: bool| {
        let mut v = match (geometry, pixels) {
            (Geometry::Box(b), false) => serde_json::json!({"type": "box", "bbox_2d": b}),
            (Geometry::Point(p), false) => serde_json::json!({"type": "point", "point_2d": p}),
            (Geometry::Box(b), true) => serde_json::json!({"type": "box", "bbox": b.map(round)}),
            (Geometry::Point(p), true) => serde_json::json!({"type": "point", "point": p.map(round)}),
        };
        if let Some(l) = label {
            v["label"] = Value::String(l.clone());
        }
        v
    };
    let images: Vec<Value> = images
        .iter()
        .enumerate()
        .map(|(i, im)| {
            let px = to_pixels(&parsed.shapes, coords, im.width, im.height, im.resized);
            serde_json::json!({
                "index": i,
                "width": im.width,
                "height": im.height,
                "shapes": px.iter().map(|s| shape(&s.geometry, &s.label, true)).collect::<Vec<_>>(),
            })
        })
        .collect();
    let coords = match coords {
        Coords::Relative(s) => format!("relative_{s}"),
        Coords::Resized => "resized_pixels".into(),
    };
    serde_json::json!({
        "coords": coords,
        "shapes": parsed.shapes.iter().map(|s| shape(&s.geometry, &s.label, false)).collect::<Vec<_>>(),
        "images": images,
        "notes": parsed.notes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const Q3: Coords = Coords::Relative(1000.0);

    fn boxes(p: &Parsed) -> Vec<[f64; 4]> {
        p.shapes
            .iter()
            .filter_map(|s| match s.geometry {
                Geometry::Box(b) => Some(b),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn fenced_list_with_labels() {
        let a = "Here you go:\n```json\n[\n  {\"bbox_2d\": [12, 40, 500, 990], \"label\": \"cat\"},\n  {\"bbox_2d\": [600, 0, 1000, 300], \"label\": \"dog {big}\"}\n]\n```\nDone.";
        let p = parse(a, Q3);
        assert_eq!(boxes(&p), vec![[12.0, 40.0, 500.0, 990.0], [600.0, 0.0, 1000.0, 300.0]]);
        assert_eq!(p.shapes[1].label.as_deref(), Some("dog {big}"));
        assert!(p.notes.is_empty(), "{:?}", p.notes);
    }

    #[test]
    fn bare_single_object_and_points() {
        let p = parse(r#"{"point_2d": [250, 750], "label": "button"}"#, Q3);
        assert_eq!(p.shapes, vec![Shape { geometry: Geometry::Point([250.0, 750.0]), label: Some("button".into()) }]);
        let p = parse(r#"[{"point_2d": [1, 2]}, {"point_2d": [3.5, 4]}]"#, Q3);
        assert_eq!(p.shapes.len(), 2);
        assert_eq!(p.shapes[1].geometry, Geometry::Point([3.5, 4.0]));
        assert_eq!(p.shapes[1].label, None);
    }

    /// UI-Venus-1.5 / -2's answers (inclusionAI/UI-Venus, `models/grounding/ui_venus2_gd.py`:
    /// a point `[x,y]` in 0..1000, boxes as four numbers or two points, `[-1,-1]` for no match).
    #[test]
    fn bare_lists_as_gui_grounding_checkpoints_answer() {
        let p = parse("[512,88]", Q3);
        assert_eq!(p.shapes, vec![Shape { geometry: Geometry::Point([512.0, 88.0]), label: None }]);
        assert!(p.notes.is_empty(), "{:?}", p.notes);
        let p = parse("<think>\nthe button [1, 2] is at</think>\n[10, 20, 300, 40.5]", Q3);
        assert_eq!(boxes(&p), vec![[10.0, 20.0, 300.0, 40.5]]);
        let p = parse("[300,40],[10,20]", Q3);
        assert_eq!(boxes(&p), vec![[10.0, 20.0, 300.0, 40.0]]);
        let p = parse("[[1,2],[3,4]] and [5, 6]", Q3);
        assert_eq!(boxes(&p), vec![[1.0, 2.0, 3.0, 4.0]]);
        assert_eq!(p.shapes[1].geometry, Geometry::Point([5.0, 6.0]));
        let p = parse("[-1,-1]", Q3);
        assert!(p.shapes.is_empty());
        assert!(p.notes[0].contains("nothing in the image matches"), "{:?}", p.notes);
        let p = parse("[1200, 5]", Q3);
        assert_eq!(p.shapes[0].geometry, Geometry::Point([1000.0, 5.0]));
        assert!(p.notes[0].contains("clamped"), "{:?}", p.notes);
        // Lists of other lengths and words are not coordinates; JSON entries win over lists.
        assert!(parse("[1, 2, 3] [a, b]", Q3).shapes.is_empty());
        let p = parse(r#"{"point_2d": [7, 8]} [1, 2]"#, Q3);
        assert_eq!(p.shapes, vec![Shape { geometry: Geometry::Point([7.0, 8.0]), label: None }]);
    }

    #[test]
    fn truncated_list_keeps_complete_entries() {
        let a = "```json\n[{\"bbox_2d\": [1, 2, 3, 4], \"label\": \"a\"}, {\"bbox_2d\": [5, 6, 7, 8], \"label\": \"b\"}, {\"bbox_2d\": [9, 10";
        let p = parse(a, Q3);
        assert_eq!(boxes(&p), vec![[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]);
        assert_eq!(p.notes.len(), 1, "{:?}", p.notes);
        assert!(p.notes[0].contains("cut off"));
    }

    #[test]
    fn wrapper_objects_other_label_keys_and_reversed_corners() {
        let a = r#"{"objects": [{"bbox_2d": [300, 400, 100, 200], "text_content": "Sign in"}]}"#;
        let p = parse(a, Q3);
        assert_eq!(boxes(&p), vec![[100.0, 200.0, 300.0, 400.0]]);
        assert_eq!(p.shapes[0].label.as_deref(), Some("Sign in"));
    }

    #[test]
    fn out_of_range_is_clamped_and_said() {
        let p = parse(r#"[{"bbox_2d": [-5, 10, 1200, 20]}]"#, Q3);
        assert_eq!(boxes(&p), vec![[0.0, 10.0, 1000.0, 20.0]]);
        assert!(p.notes[0].contains("clamped"), "{:?}", p.notes);
    }

    #[test]
    fn junk_is_no_shape_and_no_crash() {
        for junk in [
            "",
            "no boxes here",
            "{",
            "}}}{{{",
            r#"{"bbox_2d": "12,40"}"#,
            r#"{"bbox_2d": [1, 2, 3]}"#,
            r#"{"bbox_2d": [1, 2, 3, "x"]}"#,
            r#"{"point_2d": [1e400, 2]}"#,
            "\"{\\\"bbox_2d\\\": [1,2,3,4]}\"",
            "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
        ] {
            let p = parse(junk, Q3);
            assert!(p.shapes.is_empty(), "{junk:?} gave {:?}", p.shapes);
        }
        let p = parse(r#"{"bbox_2d": [1, 2, 3]}"#, Q3);
        assert!(p.notes[0].contains("not 4 numbers"), "{:?}", p.notes);
    }

    #[test]
    fn grounding_prompts_are_recognised() {
        for p in [
            "Locate every cat. Report bbox coordinates in JSON format.",
            "Outline each person with a Bounding Box",
            "Point to the button, output point_2d",
            // UI-Venus-2's grounding prompt.
            "Output the center point of the position corresponding to the following instruction: \nOpen settings. \n\nThe output should just be the coordinates of a point, in the format [x,y].",
        ] {
            assert!(looks_like_grounding(p), "{p}");
        }
        for p in ["Describe this image.", "What is in the background?", "Read the text."] {
            assert!(!looks_like_grounding(p), "{p}");
        }
    }

    #[test]
    fn deep_nesting_is_bounded() {
        let deep = format!("{}{}", "{\"a\":".repeat(200), "1".to_string() + &"}".repeat(200));
        assert!(parse(&deep, Q3).shapes.is_empty());
    }

    #[test]
    fn thinking_is_skipped() {
        let a = "<think>maybe {\"bbox_2d\": [1, 1, 2, 2]}</think>\n[{\"bbox_2d\": [5, 6, 7, 8]}]";
        assert_eq!(boxes(&parse(a, Q3)), vec![[5.0, 6.0, 7.0, 8.0]]);
    }

    #[test]
    fn relative_coordinates_map_to_the_original_image() {
        // Qwen3-VL: 0..1000 of the original width and height, whatever the resized size.
        let shapes = parse(r#"[{"bbox_2d": [100, 250, 500, 1000]}, {"point_2d": [500, 500]}]"#, Q3).shapes;
        let px = to_pixels(&shapes, Q3, 640, 480, (224, 320));
        assert_eq!(px[0].geometry, Geometry::Box([64.0, 120.0, 320.0, 480.0]));
        assert_eq!(px[1].geometry, Geometry::Point([320.0, 240.0]));
        // Qwen2.5-VL's convention: pixels of the resized image, scaled back.
        let px = to_pixels(&shapes, Coords::Resized, 640, 480, (240, 320));
        assert_eq!(px[0].geometry, Geometry::Box([200.0, 480.0, 640.0, 480.0]));
    }
}
