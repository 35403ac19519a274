//! 3-D (t, h, w) position ids for interleaved M-RoPE, mirroring `Qwen3VLModel.get_rope_index`
//! in transformers' `models/qwen3_vl/modeling_qwen3_vl.py`.
//!
//! Text tokens advance all three axes together. A run of vision tokens for a merged grid of
//! `rows x cols` sits at t = start, h = start + row, w = start + col, and the next text position
//! is start + max(rows, cols). Videos are split into frames (t = 1 each), since every frame is
//! preceded by its own timestamp text.

use super::vision::Grid;
use crate::error::{Error, Result};

/// Token modality as the processor's `mm_token_type_ids`: 0 text, 1 image, 2 video.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    Text = 0,
    Image = 1,
    Video = 2,
}

/// Token types of a prompt from its ids.
pub fn token_types(ids: &[u32], image_token: u32, video_token: u32) -> Vec<TokenType> {
    ids.iter()
        .map(|&i| match i {
            i if i == image_token => TokenType::Image,
            i if i == video_token => TokenType::Video,
            _ => TokenType::Text,
        })
        .collect()
}

/// Positions for every token and the rope delta (`max position + 1 - len`) that decoding adds
/// to the plain token index. `image_grids` / `video_grids` are the vision tower's patch grids.
pub fn mrope_positions(
    types: &[TokenType],
    image_grids: &[Grid],
    video_grids: &[Grid],
    spatial_merge: usize,
) -> Result<(Vec<[i64; 3]>, i64)> {
    let frames: Vec<Grid> = video_grids.iter().flat_map(|&[t, h, w]| std::iter::repeat_n([1, h, w], t)).collect();
    let mut grids = [image_grids.iter(), frames.iter()];
    let mut out = Vec::with_capacity(types.len());
    let mut pos: i64 = 0;
    let mut i = 0;
    while i < types.len() {
        let kind = types[i];
        let run = types[i..].iter().take_while(|&&t| t == kind).count();
        if kind == TokenType::Text {
            out.extend((0..run as i64).map(|k| [pos + k; 3]));
            pos += run as i64;
        } else {
            let (name, list) =
                if kind == TokenType::Image { ("image", &mut grids[0]) } else { ("video frame", &mut grids[1]) };
            let mut left = run;
            while left > 0 {
                let &[_, h, w] = list.next().ok_or_else(|| Error::Input {
                    what: "prompt".into(),
                    message: format!("more {name} tokens than {name} grids"),
                })?;
                let (rows, cols) = (h / spatial_merge, w / spatial_merge);
                if rows * cols > left {
                    return Err(Error::Input {
                        what: "prompt".into(),
                        message: format!(
                            "{left} {name} placeholder tokens left but the next grid needs {}",
                            rows * cols
                        ),
                    });
                }
                for r in 0..rows as i64 {
                    for c in 0..cols as i64 {
                        out.push([pos, pos + r, pos + c]);
                    }
                }
                pos += rows.max(cols) as i64;
                left -= rows * cols;
            }
        }
        i += run;
    }
    for (list, name) in grids.iter_mut().zip(["image", "video frame"]) {
        if list.next().is_some() {
            return Err(Error::Input {
                what: "prompt".into(),
                message: format!("fewer {name} placeholder runs than {name} grids"),
            });
        }
    }
    let max = out.iter().flat_map(|p| p.iter().copied()).max().unwrap_or(-1);
    Ok((out, max + 1 - types.len() as i64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use TokenType::{Image as I, Text as T, Video as V};

    #[test]
    fn text_only_is_arange_on_all_axes() {
        let (p, delta) = mrope_positions(&[T, T, T], &[], &[], 2).unwrap();
        assert_eq!(p, vec![[0, 0, 0], [1, 1, 1], [2, 2, 2]]);
        assert_eq!(delta, 0);
    }

    #[test]
    fn one_2x3_merged_image_between_text() {
        // 2 text, a 4x6 patch grid (2x3 merged = 6 tokens), 2 text.
        let types = [T, T, I, I, I, I, I, I, T, T];
        let (p, delta) = mrope_positions(&types, &[[1, 4, 6]], &[], 2).unwrap();
        assert_eq!(
            p,
            vec![
                [0, 0, 0],
                [1, 1, 1],
                [2, 2, 2],
                [2, 2, 3],
                [2, 2, 4],
                [2, 3, 2],
                [2, 3, 3],
                [2, 3, 4],
                [5, 5, 5],
                [6, 6, 6],
            ]
        );
        // max 6 + 1 - 10 tokens
        assert_eq!(delta, -3);
    }

    #[test]
    fn two_images_of_different_sizes() {
        // text, 2x2 image (4 tokens), text, 1x3 image (3 tokens), text
        let types = [T, I, I, I, I, T, I, I, I, T];
        let (p, delta) = mrope_positions(&types, &[[1, 4, 4], [1, 2, 6]], &[], 2).unwrap();
        assert_eq!(
            p,
            vec![
                [0, 0, 0],
                [1, 1, 1],
                [1, 1, 2],
                [1, 2, 1],
                [1, 2, 2],
                [3, 3, 3],
                [4, 4, 4],
                [4, 4, 5],
                [4, 4, 6],
                [7, 7, 7],
            ]
        );
        assert_eq!(delta, 8 - 10);
    }

    #[test]
    fn a_two_frame_video_gets_one_start_per_frame() {
        // <t0> frame 1x2 merged, <t1> frame 1x2 merged: each frame restarts t at its own start.
        let types = [T, V, V, T, V, V];
        let (p, delta) = mrope_positions(&types, &[], &[[2, 2, 4]], 2).unwrap();
        assert_eq!(p, vec![[0, 0, 0], [1, 1, 1], [1, 1, 2], [3, 3, 3], [4, 4, 4], [4, 4, 5]]);
        assert_eq!(delta, 6 - 6);
    }

    #[test]
    fn count_mismatches_are_errors() {
        let err = mrope_positions(&[T, I, I, I], &[[1, 4, 4]], &[], 2).unwrap_err().to_string();
        assert!(err.contains("3 image placeholder tokens") && err.contains("needs 4"), "{err}");
        let err = mrope_positions(&[T, I], &[], &[], 2).unwrap_err().to_string();
        assert!(err.contains("more image tokens than image grids"), "{err}");
        let err = mrope_positions(&[T], &[[1, 2, 2]], &[], 2).unwrap_err().to_string();
        assert!(err.contains("fewer image"), "{err}");
    }

    #[test]
    fn token_types_from_ids() {
        assert_eq!(token_types(&[1, 151655, 151656, 151652], 151655, 151656), vec![T, I, V, T]);
    }
}
