//! Grounding answers: the boxes and points a vision-language model names in its text, parsed,
//! mapped to an image's pixels, and drawn.
//!
//! Qwen3-VL answers a grounding prompt with JSON, often inside a ```json fence:
//! `[{"bbox_2d": [x1, y1, x2, y2], "label": "cat"}]` or `{"point_2d": [x, y], "label": ...}`. Its
//! coordinates are relative: 0..1000 of the image's width and height, whatever size the image
//! was resized to (Qwen2.5-VL used absolute pixels of the resized image instead). A family says
//! which convention its checkpoints follow (`Coords`); the parser is the same for both.
//!
//! The parser takes what real checkpoints give: a fence or none, a list or one object, objects
//! nested in a wrapper (`{"objects": [...]}`), text around the JSON, and a list cut off by the
//! token limit (the complete entries are kept, the cut one is reported). A coordinate outside
//! the range is clamped and reported, never a crash.

use image::{Rgb, RgbImage};
use serde_json::Value;

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
    out
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
            let Some(mut nums) = nums.filter(|n| n.len() == want && o[key].as_array().is_some_and(|a| a.len() == want))
            else {
                out.notes.push(format!("`{key}` = {} is not {want} numbers: ignored", short(&o[key].to_string())));
                return;
            };
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
                    short(&o[key].to_string()),
                    if hi.is_finite() { hi.to_string() } else { "the image".into() }
                ));
                nums.iter_mut().for_each(|x| *x = x.clamp(0.0, hi));
            }
            let geometry = if want == 4 {
                let [x1, y1, x2, y2] = [nums[0], nums[1], nums[2], nums[3]];
                // Corners in either order.
                Geometry::Box([x1.min(x2), y1.min(y2), x1.max(x2), y1.max(y2)])
            } else {
                Geometry::Point([nums[0], nums[1]])
            };
            out.shapes.push(Shape { geometry, label });
        }
        _ => {}
    }
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
pub fn report(text: &str, coords: Coords, images: &[crate::family::ImageReport]) -> Value {
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

/// Colours shapes are drawn in, in turn (distinct on light and dark images).
pub const PALETTE: [[u8; 3]; 8] = [
    [230, 25, 75],
    [60, 180, 75],
    [0, 130, 200],
    [245, 130, 48],
    [145, 30, 180],
    [70, 240, 240],
    [240, 50, 230],
    [255, 225, 25],
];

/// Line width of drawn boxes for an image of this size: 2 px, more on large images.
pub fn line_width(width: u32, height: u32) -> u32 {
    (width.max(height) / 400).clamp(2, 8)
}

/// Draws `shapes` (pixels) on `img`: boxes as outlines `line_width` wide, inside the box's
/// pixel span [floor(x1), ceil(x2)); points as a filled disc; each label on a band of its
/// shape's colour above the box (inside it, at the top, when there is no room above), in
/// `PALETTE` order. Pixels elsewhere are untouched.
pub fn draw(img: &mut RgbImage, shapes: &[PixelShape]) {
    let (w, h) = img.dimensions();
    if w == 0 || h == 0 {
        return;
    }
    let t = line_width(w, h);
    for (i, s) in shapes.iter().enumerate() {
        let c = Rgb(PALETTE[i % PALETTE.len()]);
        let (lx, ly, bottom) = match s.geometry {
            Geometry::Box([x1, y1, x2, y2]) => {
                let (x0, y0) = ((x1.floor() as u32).min(w - 1), (y1.floor() as u32).min(h - 1));
                let (x1, y1) = ((x2.ceil() as u32).clamp(x0 + 1, w), (y2.ceil() as u32).clamp(y0 + 1, h));
                for y in y0..y1 {
                    for x in x0..x1 {
                        if x < x0 + t || x + t >= x1 || y < y0 + t || y + t >= y1 {
                            img.put_pixel(x, y, c);
                        }
                    }
                }
                (x0, y0, y1)
            }
            Geometry::Point([px, py]) => {
                let r = (t * 2) as i64;
                let (cx, cy) = (px.round() as i64, py.round() as i64);
                for y in (cy - r).max(0)..(cy + r + 1).min(h as i64) {
                    for x in (cx - r).max(0)..(cx + r + 1).min(w as i64) {
                        if (x - cx).pow(2) + (y - cy).pow(2) <= r * r {
                            img.put_pixel(x as u32, y as u32, c);
                        }
                    }
                }
                ((cx - r).max(0) as u32, (cy - r).max(0) as u32, (cy + r + 1).min(h as i64) as u32)
            }
        };
        if let Some(label) = &s.label {
            let (_, lh) = label_size(label, w, h);
            // Above the shape when there is room, else inside its top.
            let top = if ly >= lh { ly - lh } else { ly.min(bottom.saturating_sub(1)) };
            draw_label(img, label, lx, top, c);
        }
    }
}

/// Scale of label glyphs (8x8 cells): 1 below 800 px, 2 up to 1600, ...
fn glyph_scale(w: u32, h: u32) -> u32 {
    (w.max(h) / 800 + 1).min(4)
}

/// Pixel size of a drawn label (band included): width is clipped to the image.
pub fn label_size(label: &str, w: u32, h: u32) -> (u32, u32) {
    let s = glyph_scale(w, h);
    let chars = label.chars().count().min(64) as u32;
    ((chars * 8 * s + 2 * s).min(w), (8 * s + 2 * s).min(h))
}

/// A label's band of colour `c` at (x, y), its characters in black or white (whichever reads
/// better on `c`), clipped to the image. Characters outside Basic Latin are drawn as `?`.
fn draw_label(img: &mut RgbImage, label: &str, x: u32, y: u32, c: Rgb<u8>) {
    let (w, h) = img.dimensions();
    let s = glyph_scale(w, h);
    let (bw, bh) = label_size(label, w, h);
    let ink = if 299 * c.0[0] as u32 + 587 * c.0[1] as u32 + 114 * c.0[2] as u32 > 128_000 {
        Rgb([0, 0, 0])
    } else {
        Rgb([255, 255, 255])
    };
    for yy in y..(y + bh).min(h) {
        for xx in x..(x + bw).min(w) {
            img.put_pixel(xx, yy, c);
        }
    }
    for (i, ch) in label.chars().take(64).enumerate() {
        let code = if ch.is_ascii() && !ch.is_ascii_control() { ch as usize } else { '?' as usize };
        let glyph = font8x8::legacy::BASIC_LEGACY[code];
        for (row, bits) in glyph.iter().enumerate() {
            for col in 0..8u32 {
                if bits >> col & 1 == 0 {
                    continue;
                }
                for dy in 0..s {
                    for dx in 0..s {
                        let px = x + s + (i as u32 * 8 + col) * s + dx;
                        let py = y + s + row as u32 * s + dy;
                        if px < (x + bw).min(w) && py < (y + bh).min(h) {
                            img.put_pixel(px, py, ink);
                        }
                    }
                }
            }
        }
    }
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
    fn box_edges_are_drawn_at_their_pixels_and_nothing_else_changes() {
        let grey = Rgb([100, 100, 100]);
        let mut img = RgbImage::from_pixel(100, 50, grey);
        let shapes = parse(r#"[{"bbox_2d": [100, 200, 500, 600]}]"#, Q3).shapes;
        // 0..1000 of 100 x 50: x 10..50, y 10..30.
        let px = to_pixels(&shapes, Q3, 100, 50, (32, 64));
        assert_eq!(px[0].geometry, Geometry::Box([10.0, 10.0, 50.0, 30.0]));
        draw(&mut img, &px);
        let red = Rgb(PALETTE[0]);
        // Lines 2 px wide, inside the span [10, 50) x [10, 30).
        for (x, y, want) in [
            (10, 20, red),
            (11, 20, red),
            (12, 20, grey),
            (49, 20, red),
            (48, 20, red),
            (47, 20, grey),
            (50, 20, grey),
            (9, 20, grey),
            (30, 10, red),
            (30, 11, red),
            (30, 12, grey),
            (30, 29, red),
            (30, 28, red),
            (30, 27, grey),
            (30, 30, grey),
            (30, 9, grey),
            (10, 10, red),
            (49, 29, red),
        ] {
            assert_eq!(*img.get_pixel(x, y), want, "pixel ({x}, {y})");
        }
        let changed = img.enumerate_pixels().filter(|(_, _, p)| **p != grey).count();
        // The outline: 40 x 20 span less its 36 x 16 inside.
        assert_eq!(changed, 40 * 20 - 36 * 16);
    }

    #[test]
    fn labels_sit_above_their_box_and_points_are_discs() {
        let grey = Rgb([0, 0, 0]);
        let mut img = RgbImage::from_pixel(200, 200, grey);
        let shapes =
            parse(r#"[{"bbox_2d": [250, 500, 750, 900], "label": "cat"}, {"point_2d": [100, 100]}]"#, Q3).shapes;
        draw(&mut img, &to_pixels(&shapes, Q3, 200, 200, (64, 64)));
        // The box spans x 50..150, y 100..180; its label band is 10 px tall above it, 3 x 8 + 2
        // wide: x 50..76, y 90..100.
        for (x, y) in img.enumerate_pixels().filter(|(_, _, p)| **p != grey).map(|(x, y, _)| (x, y)) {
            let in_box = (50..150).contains(&x) && (100..180).contains(&y);
            let in_label = (50..76).contains(&x) && (90..100).contains(&y);
            // The point at (20, 20): a disc of radius 4.
            let in_point = (x as i64 - 20).pow(2) + (y as i64 - 20).pow(2) <= 16;
            assert!(in_box || in_label || in_point, "pixel ({x}, {y}) changed");
        }
        assert_eq!(*img.get_pixel(50, 90), Rgb(PALETTE[0]), "the label band's corner");
        assert_eq!(*img.get_pixel(20, 20), Rgb(PALETTE[1]), "the point's centre");
        assert_eq!(*img.get_pixel(20, 24), Rgb(PALETTE[1]));
        assert_eq!(*img.get_pixel(20, 25), grey);
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
