//! A Gated DeltaNet token mixer (linear attention with the gated delta rule): projections to
//! q, k, v (through a depthwise causal convolution with SiLU), an output gate z, a rate b and a
//! decay input a; q and k L2-normalised, q scaled by 1/sqrt(k_dim); g = -exp(A_log) *
//! softplus(a + dt_bias), beta = sigmoid(b); the rule (`kernels::delta`) per value head; the
//! output RMS-normed per head, times silu(z), projected back. All of the recurrence in f32.
//!
//! A sequence's state is two f32 CPU tensors, replaced (never written into) by each call: the
//! convolution window [kernel - 1, conv_dim] and the rule's state [v_heads, k_dim, v_dim].

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::kernels::delta::{gated_delta_rule_trail, DeltaShape};
use crate::kernels::delta_conv::{causal_conv1d_silu, gated_rms_norm, ConvTaps};
use crate::QLinear;

/// Widths of a Gated DeltaNet layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaNetShape {
    pub hidden: usize,
    pub rule: DeltaShape,
    pub conv_kernel: usize,
}

impl DeltaNetShape {
    pub fn key_dim(&self) -> usize {
        self.rule.k_heads * self.rule.k_dim
    }
    pub fn value_dim(&self) -> usize {
        self.rule.v_heads * self.rule.v_dim
    }
    /// Channels of the convolution: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Bytes of one sequence's state (window and rule state, f32).
    pub fn state_bytes(&self) -> usize {
        4 * ((self.conv_kernel - 1) * self.conv_dim() + self.rule.state_len())
    }
}

/// The layer's weights.
#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    pub shape: DeltaNetShape,
    pub in_qkv: QLinear,
    pub in_z: QLinear,
    pub in_b: QLinear,
    pub in_a: QLinear,
    pub out: QLinear,
    /// The convolution's weight, laid out for `causal_conv1d_silu`.
    conv: ConvTaps,
    /// -exp(A_log) per value head.
    neg_a: Vec<f32>,
    dt_bias: Vec<f32>,
    /// The gated RMSNorm's weight `[v_dim]`.
    norm: Vec<f32>,
    eps: f32,
}

/// A sequence's state: (window [kernel - 1, conv_dim], rule state [v_heads, k_dim, v_dim]).
pub type DeltaState = (Tensor, Tensor);

fn floats(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

impl GatedDeltaNet {
    /// From the projections and the small tensors: `conv` [conv_dim, 1, kernel] or
    /// [conv_dim, kernel], `a_log` and `dt_bias` `[v_heads]`, `norm` `[v_dim]`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        shape: DeltaNetShape,
        [in_qkv, in_z, in_b, in_a, out]: [QLinear; 5],
        conv: &Tensor,
        a_log: &Tensor,
        dt_bias: &Tensor,
        norm: &Tensor,
        eps: f64,
    ) -> Result<Self> {
        let r = shape.rule;
        let bad = |what: &str, t: &Tensor, want: usize| Error::Shape {
            layer: "GatedDeltaNet",
            message: format!("{what} has shape {:?}, {want} values expected", t.dims()),
        };
        if r.k_heads == 0 || !r.v_heads.is_multiple_of(r.k_heads) || shape.conv_kernel == 0 {
            return Err(Error::Shape {
                layer: "GatedDeltaNet",
                message: format!(
                    "{} value heads over {} key heads, kernel {}",
                    r.v_heads, r.k_heads, shape.conv_kernel
                ),
            });
        }
        let check = |what: &str, t: &Tensor, want: usize| -> Result<Vec<f32>> {
            if t.elem_count() != want {
                return Err(bad(what, t, want));
            }
            floats(t)
        };
        Ok(Self {
            conv: ConvTaps::new(
                &check("conv1d.weight", conv, shape.conv_dim() * shape.conv_kernel)?,
                shape.conv_dim(),
                shape.conv_kernel,
            ),
            neg_a: check("A_log", a_log, r.v_heads)?.into_iter().map(|x| -x.exp()).collect(),
            dt_bias: check("dt_bias", dt_bias, r.v_heads)?,
            norm: check("norm.weight", norm, r.v_dim)?,
            eps: eps as f32,
            shape,
            in_qkv,
            in_z,
            in_b,
            in_a,
            out,
        })
    }

    /// A fresh sequence's state (zeros).
    pub fn empty_state(&self) -> Result<DeltaState> {
        let s = self.shape;
        Ok((
            Tensor::zeros(((s.conv_kernel - 1), s.conv_dim()), DType::F32, &Device::Cpu)?,
            Tensor::zeros((s.rule.v_heads, s.rule.k_dim, s.rule.v_dim), DType::F32, &Device::Cpu)?,
        ))
    }

    /// `x` [rows, hidden], laid out sequence after sequence: `segments[i]` rows continue
    /// sequence `i` from `states[i]` (None: a fresh one). Returns [rows, hidden] in `x`'s dtype
    /// and each sequence's new state.
    pub fn forward(
        &self,
        x: &Tensor,
        segments: &[usize],
        states: &[Option<&DeltaState>],
    ) -> Result<(Tensor, Vec<DeltaState>)> {
        let (y, new, _) = self.forward_trail(x, segments, states, &vec![0; segments.len()])?;
        Ok((y, new))
    }

    /// `forward`, also returning, per sequence `i`, the states after its rows
    /// `segments[i] - 1 - keep[i] .. segments[i] - 1` (`keep[i]` < `segments[i]`, or 0): the
    /// points drafted tokens verified in one pass may be taken back to.
    pub fn forward_trail(
        &self,
        x: &Tensor,
        segments: &[usize],
        states: &[Option<&DeltaState>],
        keep: &[usize],
    ) -> Result<(Tensor, Vec<DeltaState>, Vec<Vec<DeltaState>>)> {
        let (rows, _) = x.dims2()?;
        let sh = self.shape;
        let r = sh.rule;
        let bad_keep = keep.len() != segments.len() || keep.iter().zip(segments).any(|(&k, &n)| k > 0 && k >= n);
        if segments.iter().sum::<usize>() != rows || states.len() != segments.len() || bad_keep {
            return Err(Error::Shape {
                layer: "GatedDeltaNet",
                message: format!("{rows} rows for segments {segments:?} and {} states", states.len()),
            });
        }
        let [qkv, z, b, a] = QLinear::forward_each([&self.in_qkv, &self.in_z, &self.in_b, &self.in_a], x)?;
        let (qkv, z, b, a) = (floats(&qkv)?, floats(&z)?, floats(&b)?, floats(&a)?);
        let (cd, kd, vw) = (sh.conv_dim(), sh.key_dim(), sh.value_dim());
        let win_len = (sh.conv_kernel - 1) * cd;
        // Convolution per sequence, continuing its window.
        let mut mixed = Vec::with_capacity(rows * cd);
        let mut windows = Vec::with_capacity(segments.len());
        let mut rules = Vec::with_capacity(segments.len());
        let mut trail_windows: Vec<Vec<Vec<f32>>> = Vec::with_capacity(segments.len());
        // The rule states read in place where they are CPU f32 and contiguous (the kernel copies
        // each head into the new state where it runs it), else copied here.
        let guards: Vec<_> = states.iter().map(|st| st.map(|(_, s)| s.storage_and_layout())).collect();
        let from: Vec<Option<&[f32]>> = guards
            .iter()
            .map(|g| {
                let (storage, layout) = g.as_ref()?;
                let (a, b) = layout.contiguous_offsets()?;
                crate::cpu::cpu_slice::<f32>(storage).and_then(|v| v.get(a..b)).filter(|v| v.len() == r.state_len())
            })
            .collect();
        let mut start = 0;
        for ((&n, state), from) in segments.iter().zip(states).zip(&from) {
            let (mut win, rule) = match state {
                Some((w, _)) if from.is_some() => (floats(w)?, vec![]),
                Some((w, s)) => (floats(w)?, floats(s)?),
                None => (vec![0f32; win_len], vec![0f32; r.state_len()]),
            };
            if win.len() != win_len || (from.is_none() && rule.len() != r.state_len()) {
                return Err(Error::Shape {
                    layer: "GatedDeltaNet",
                    message: format!(
                        "a state of {} + {} values, {win_len} + {} expected",
                        win.len(),
                        rule.len(),
                        r.state_len()
                    ),
                });
            }
            let seg = &qkv[start * cd..(start + n) * cd];
            // The windows after the kept rows: the last kernel - 1 inputs up to each.
            let mut all_in = Vec::new();
            if keep[windows.len()] > 0 {
                all_in.extend_from_slice(&win);
                all_in.extend_from_slice(seg);
            }
            let first = n.saturating_sub(1 + keep[windows.len()]);
            let kept_windows: Vec<Vec<f32>> = (first..n.saturating_sub(1))
                .filter(|_| keep[windows.len()] > 0)
                .map(|j| all_in[(j + 1) * cd..(j + 1) * cd + win_len].to_vec())
                .collect();
            mixed.extend(causal_conv1d_silu(seg, &self.conv, &mut win));
            trail_windows.push(kept_windows);
            windows.push(win);
            rules.push(rule);
            start += n;
        }
        // Split, normalise, scale.
        let mut q = Vec::with_capacity(rows * kd);
        let mut k = Vec::with_capacity(rows * kd);
        let mut v = Vec::with_capacity(rows * vw);
        let scale = 1.0 / (r.k_dim as f32).sqrt();
        for row in mixed.chunks_exact(cd) {
            for (dst, src, s) in [(&mut q, &row[..kd], scale), (&mut k, &row[kd..2 * kd], 1.0)] {
                for head in src.chunks_exact(r.k_dim) {
                    let inv = 1.0 / (head.iter().map(|x| x * x).sum::<f32>() + 1e-6).sqrt();
                    dst.extend(head.iter().map(|x| x * inv * s));
                }
            }
            v.extend_from_slice(&row[2 * kd..]);
        }
        let mut g = vec![0f32; rows * r.v_heads];
        let mut beta = vec![0f32; rows * r.v_heads];
        for i in 0..rows * r.v_heads {
            let h = i % r.v_heads;
            let x = a[i] + self.dt_bias[h];
            let softplus = if x > 20.0 { x } else { x.exp().ln_1p() };
            g[i] = self.neg_a[h] * softplus;
            beta[i] = 1.0 / (1.0 + (-b[i]).exp());
        }
        let mut o = vec![0f32; rows * vw];
        let mut trails: Vec<Vec<Vec<f32>>> = keep.iter().map(|&m| vec![vec![0f32; r.state_len()]; m]).collect();
        gated_delta_rule_trail(r, segments, &q, &k, &v, &g, &beta, (&from, &mut rules), &mut o, &mut trails);
        drop(from);
        drop(guards);
        // Gated RMSNorm per head: norm(o) * weight * silu(z).
        gated_rms_norm(&mut o, &z, &self.norm, self.eps);
        let o = Tensor::from_vec(o, (rows, vw), x.device())?.to_dtype(x.dtype())?;
        let y = self.out.forward(&o)?;
        let cpu = Device::Cpu;
        let new_states = windows
            .into_iter()
            .zip(rules)
            .map(|(w, s)| {
                Ok((
                    Tensor::from_vec(w, (sh.conv_kernel - 1, cd), &cpu)?,
                    Tensor::from_vec(s, (r.v_heads, r.k_dim, r.v_dim), &cpu)?,
                ))
            })
            .collect::<Result<_>>()?;
        let kept = trail_windows
            .into_iter()
            .zip(trails)
            .map(|(ws, t)| {
                ws.into_iter()
                    .zip(t)
                    .map(|(w, s)| {
                        Ok((
                            Tensor::from_vec(w, (sh.conv_kernel - 1, cd), &cpu)?,
                            Tensor::from_vec(s, (r.v_heads, r.k_dim, r.v_dim), &cpu)?,
                        ))
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        Ok((y, new_states, kept))
    }
}
