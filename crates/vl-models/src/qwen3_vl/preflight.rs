//! Every check that loading a model directory runs, done before any weight is read: config
//! bounds, the tensor plan (keys, shapes, dtypes, quantization parts), tokenizer, chat template,
//! image processor and generation config, and their agreement with each other. `vl run` and
//! `vl inspect` both start here, so inspect can never pass a directory that run rejects.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::config::Qwen3VlConfig;
use super::plan::{check_plan, plan_for, PlanReport, PlannedTensor};
use super::processor::{Content, Message, Processor};
use super::weights::Weights;
use crate::error::{Error, Result};
use crate::formats::generation_config::GenerationConfig;

/// Stop ids used when `generation_config.json` names none: `<|im_end|>`, `<|endoftext|>`.
pub const DEFAULT_EOS: [u32; 2] = [151_645, 151_643];

/// A model directory whose files have all been checked; weights are mapped, not loaded.
pub struct ModelDir {
    pub dir: PathBuf,
    pub config: Qwen3VlConfig,
    pub weights: Arc<Weights>,
    pub plan: Vec<PlannedTensor>,
    pub plan_report: PlanReport,
    pub processor: Processor,
    pub generation: GenerationConfig,
}

impl ModelDir {
    pub fn open(dir: &Path) -> Result<Self> {
        let mut config = Qwen3VlConfig::from_dir(dir)?;
        let weights = Arc::new(Weights::open(dir)?);
        config.follow_layout(&weights);
        let plan = plan_for(&config, &weights);
        let plan_report = check_plan(&plan, &weights)?;
        let processor = Processor::from_dir(dir)?;
        check_processor(dir, &config, &processor)?;
        let generation = GenerationConfig::from_dir(dir, &DEFAULT_EOS)?;
        let gen_path = dir.join("generation_config.json");
        if let Some(bad) = generation.eos_token_ids.iter().find(|&&id| id as usize >= config.text.vocab_size) {
            return Err(Error::Config {
                path: gen_path,
                field: "eos_token_id".into(),
                message: format!("{bad} is outside the vocabulary of {}", config.text.vocab_size),
            });
        }
        if generation.eos_token_ids.is_empty() {
            return Err(Error::Config {
                path: gen_path,
                field: "eos_token_id".into(),
                message: "an empty list: generation could never stop".into(),
            });
        }
        Ok(Self { dir: dir.to_path_buf(), config, weights, plan, plan_report, processor, generation })
    }
}

/// The image and video processors must produce what the vision tower takes, the tokenizer must know the
/// config's special tokens, and the chat template must render a conversation with an image.
fn check_processor(dir: &Path, cfg: &Qwen3VlConfig, p: &Processor) -> Result<()> {
    let v = &cfg.vision;
    let video_file = ["video_preprocessor_config.json", "preprocessor_config.json"]
        .into_iter()
        .find(|f| dir.join(f).is_file())
        .unwrap_or("video_preprocessor_config.json");
    for (file, c) in [("preprocessor_config.json", &p.images.config), (video_file, &p.videos.config.base)] {
        for (field, ours, theirs, theirs_name) in [
            ("patch_size", c.patch_size, v.patch_size, "vision_config.patch_size"),
            ("merge_size", c.merge_size, v.spatial_merge_size, "vision_config.spatial_merge_size"),
            ("temporal_patch_size", c.temporal_patch_size, v.temporal_patch_size, "vision_config.temporal_patch_size"),
        ] {
            if ours != theirs {
                return Err(Error::Config {
                    path: dir.join(file),
                    field: field.into(),
                    message: format!("{ours} differs from config.json {theirs_name} {theirs}"),
                });
            }
        }
    }
    let tok = dir.join("tokenizer.json");
    for (name, id) in [
        ("<|image_pad|>", cfg.image_token_id),
        ("<|video_pad|>", cfg.video_token_id),
        ("<|vision_start|>", cfg.vision_start_token_id),
        ("<|vision_end|>", cfg.vision_end_token_id),
    ] {
        let found = p.tokenizer.token_to_id(name);
        if found != Some(id) {
            return Err(Error::Input {
                what: tok.display().to_string(),
                message: format!(
                    "token {name} is {}, but config.json says {id}",
                    found.map_or("missing".to_string(), |f| format!("id {f}"))
                ),
            });
        }
    }
    let n = p.tokenizer.get_vocab_size(true);
    if n > cfg.text.vocab_size {
        return Err(Error::Input {
            what: tok.display().to_string(),
            message: format!("{n} tokens, more than config.json's vocab_size {}", cfg.text.vocab_size),
        });
    }
    let probe = [
        Message::text("system", "probe"),
        Message::new(
            "user",
            vec![Content::Image { image: "probe.png".into() }, Content::Text { text: "probe".into() }],
        ),
    ];
    p.prompt_len(&probe, &[1]).map_err(|e| Error::Input {
        what: format!("chat template ({})", template_name(p)),
        message: format!("cannot render a system + image + text conversation: {e}"),
    })?;
    Ok(())
}

fn template_name(p: &Processor) -> String {
    match &p.template.source {
        super::processor::TemplateSource::File(f) => f.display().to_string(),
        super::processor::TemplateSource::BuiltIn => "built-in".into(),
    }
}
